"""Start and stop the whole service in one process: Ray (local, or joining a cluster), the store,
the scheduler thread and the HTTP server thread.

    with Service(load_config(None)) as svc:   # local Ray, SQLite, digits on the CPU
        Client(svc.url).submit(labels=[7])

``roles`` picks what this process runs: ``api`` and ``scheduler`` (the default, one process), or
only one of them, e.g. several ``api`` processes and one ``scheduler`` sharing a PostgreSQL store.
``stop()`` stops accepting requests, hands the scheduler's leases back to the queue, stops the
workers and shuts Ray down if this process started it.
"""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from dit_serve.server.api import create_app
from dit_serve.server.catalog import Catalog
from dit_serve.server.config import Config
from dit_serve.server.metrics import Metrics
from dit_serve.server.reaper import release_local_ray, watch_local_ray
from dit_serve.server.store import Store

log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """The service could not start (bad model, port in use, unreachable database or cluster)."""


def build_catalog(config: Config) -> Catalog:
    """The configured models' cards; each model's default sampler settings are checked now."""
    try:
        catalog = Catalog.of(list(config.workers.models), config.limits)
        for info in catalog.models.values():
            catalog.params(info, None, None, None, 0.0)
    except (ValueError, KeyError) as e:
        raise ServiceError(f"cannot serve the configured models: {getattr(e, 'message', e)}") from None
    return catalog


def open_store(config: Config) -> Store:
    try:
        return Store(config.store.database_url(), config.store.data_dir, config.store.max_requeues,
                     config.store.poison_crashes)
    except ModuleNotFoundError as e:
        raise ServiceError(f"the job store {config.store.database_url()!r} needs {e.name!r}: "
                           "pip install 'dit-serve[postgres]'") from None
    except Exception as e:  # driver errors vary: say which database could not be opened
        raise ServiceError(f"cannot open the job store {config.store.database_url()!r}: {e}") from None


class Retention:
    """Deletes finished jobs (rows and images) ``seconds`` after they end (0 keeps them), and the temp
    files of results a killed process never finished writing. A thread of its own: deleting many images
    must not hold up the scheduler's dispatch."""

    def __init__(self, store: Store, seconds: float, sweep_every_s: float = 60.0):
        self.store, self.seconds, self.sweep_every_s = store, seconds, sweep_every_s

    def run(self, stop: threading.Event) -> None:
        last_sweep = 0.0
        while not stop.wait(min(60.0, self.seconds / 10) if self.seconds else 1.0):
            try:
                if time.monotonic() - last_sweep >= self.sweep_every_s:
                    last_sweep = time.monotonic()
                    if swept := self.store.sweep_temp_files():
                        log.info("removed %d result temp file(s) left by a process that was killed", swept)
                if self.seconds and (purged := self.store.purge_finished(self.seconds)):
                    log.info("deleted %d finished job(s) past retention", len(purged))
            except Exception:  # a store hiccup must not end the policy
                log.exception("retention round failed; retrying")


class Service:
    def __init__(self, config: Config, roles: tuple[str, ...] = ("api", "scheduler")):
        self.config, self.roles = config, roles
        self.metrics = Metrics()
        self.store: Store | None = None
        self.scheduler = None
        self.notifier = None
        self.retention = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server = None
        self._started_ray = False
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = self.config.server.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    def start(self) -> "Service":
        from dit_serve.server import heap

        catalog = build_catalog(self.config)
        self.store = open_store(self.config)
        self._spawn("heap-trim", heap.trim_every, 60.0, self._stop)
        if "api" in self.roles and self.store.engine.dialect.name == "postgresql":
            self._spawn("changes", self.store.listen, self._stop)  # other processes' writes wake our waiters
        try:
            if "scheduler" in self.roles:
                self._start_scheduler()
            if "api" in self.roles:
                self._start_api(catalog)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_scheduler(self) -> None:
        from dit_serve.server.scheduler import Scheduler

        self._init_ray()
        cfg = self.config
        self.scheduler = Scheduler(self.store, cfg.workers, cfg.scheduler, cfg.store.lease_seconds, self.metrics)
        # the first actors are created from this thread: Ray sets up its serializers (importing pydantic.v1)
        # on first use, and doing that while another thread imports FastAPI raced into a KeyError
        self.scheduler.reconcile()
        self._spawn("scheduler", self.scheduler.run, self._stop)
        from dit_serve.server.webhooks import Notifier

        self.notifier = Notifier(self.store, cfg.webhooks)
        self._spawn("webhooks", self.notifier.run, self._stop)
        self.retention = Retention(self.store, cfg.store.retention_hours * 3600)
        self._spawn("retention", self.retention.run, self._stop)

    def _init_ray(self) -> None:
        import ray

        rc = self.config.ray
        if ray.is_initialized():  # an embedding program (or a test) owns Ray
            return
        kwargs = dict(namespace=rc.namespace, log_to_driver=rc.log_to_driver, include_dashboard=False)
        try:
            if rc.address:
                ray.init(address=rc.address, **kwargs)
            else:
                ray.init(address="local", num_cpus=rc.num_cpus, **kwargs)  # never join a stray local cluster
                watch_local_ray(self.config.store.data_dir)  # nothing of our Ray may outlive this process
        except Exception as e:
            raise ServiceError(f"cannot start or join Ray{f' at {rc.address}' if rc.address else ''}: {e}") from None
        self._started_ray = True

    def _start_api(self, catalog: Catalog) -> None:
        import uvicorn

        app = create_app(self.store, catalog, self.config.server, self.metrics,
                         lambda: self.scheduler.num_ready if self.scheduler else None, self.config.webhooks.allow_hosts)
        sock = _bind(self.config.server.host, self.config.server.port)
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self._server.install_signal_handlers = lambda: None  # signals belong to the main thread (the CLI)
        self._spawn("http", self._server.run, [sock])
        if not _wait_for(lambda: self._server.started or not self._threads[-1].is_alive(), 30):
            raise ServiceError("the HTTP server did not start within 30 s")
        log.info("dit-serve API at %s", self.url)

    def _spawn(self, name: str, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name=f"dit-serve-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Block until at least one worker is ready (models loaded and warm)."""
        return _wait_for(lambda: self.scheduler is not None and self.scheduler.num_ready > 0, timeout)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Stop leasing new work and wait up to ``timeout_s`` (``[scheduler] drain_seconds``) for the
        running items to finish; True if they did. ``stop`` then hands back whatever is left."""
        if self.scheduler is None:
            return True
        self.scheduler.draining = True
        timeout_s = self.config.scheduler.drain_seconds if timeout_s is None else timeout_s
        return _wait_for(lambda: self.scheduler.held == 0, timeout_s, interval=0.1)

    def stop(self) -> None:
        if self._server is not None:
            streams = getattr(self._server.config.app.state, "event_streams", None)
            if streams is not None:  # open event streams end now (clients resume elsewhere), not at a timeout
                streams.close()
            self._server.should_exit = True
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        self._threads.clear()
        if self._started_ray:
            import ray

            ray.shutdown()
            release_local_ray()
            self._started_ray = False
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> "Service":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def local_service(config: Config | None = None, data_dir: Path | None = None):
    """A throwaway service for a script or a test: a free port, data in a temporary folder unless
    ``data_dir`` is given, Ray local unless the config names a cluster."""
    with tempfile.TemporaryDirectory(prefix="dit-serve-") as tmp:
        cfg = (config or Config()).with_overrides(server={"port": 0}, store={"data_dir": str(data_dir or tmp)})
        with Service(cfg) as svc:
            yield svc


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted sockets
    # whose proto says TCP. With it on, a response written in two parts (headers, then body) waited for
    # the client's delayed ACK: 40 ms added to every request on Linux
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServiceError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _wait_for(cond, timeout: float, interval: float = 0.05) -> bool:
    event = threading.Event()
    waited = 0.0
    while not cond():
        if waited >= timeout:
            return False
        event.wait(interval)
        waited += interval
    return True
