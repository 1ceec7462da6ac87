"""Start and stop the whole service in one process: Ray (local, or joining a cluster), the store,
the scheduler thread and the HTTP server thread.

    with Service(load_config(None)) as svc:   # local Ray, SQLite, digits on the CPU
        Client(svc.url).submit(labels=[7])

``roles`` picks what this process runs: ``api`` and ``scheduler`` (the default, one process), or
only one of them, e.g. several ``api`` processes and one ``scheduler`` sharing a PostgreSQL store.
``stop()`` stops accepting requests, hands the scheduler's leases back to the queue, stops the
workers and shuts Ray down if this process started it.

Embedded (a script, a test), the HTTP server runs on a thread of its own. ``dit-serve serve`` passes
``http_thread=False`` and calls ``serve_http()`` on the main thread instead: uvicorn then handles
SIGINT and SIGTERM itself and shuts down its own way (listeners closed, open event streams ended,
requests in flight finished), and the app's lifespan drains the scheduler at its end (no new
leases; running items may finish for up to ``[scheduler] drain_seconds``). A second signal skips
what is left of the drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import tempfile
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from dit_serve.server.api import create_app
from dit_serve.server.catalog import Catalog
from dit_serve.server.loras import LoraPolicy, register_dir
from dit_serve.server.config import Config
from dit_serve.server.metrics import Metrics
from dit_serve.server.reaper import release_local_ray, watch_local_ray
from dit_serve.server.store import Store

log = logging.getLogger(__name__)

# The local Ray the service starts runs worker actors only (one per GPU), never tasks: Ray's pool of
# prestarted idle workers (up to one per CPU core, each a Python process of tens of MB) is of no use to
# it, and on a GPU host with many cores it is many processes doing nothing. Return values up to 1 MiB (a
# worker's answer with one finished PNG of up to 512 px) travel inline in the call's reply instead of
# through the object store (Ray's default limit is 100 KiB): one copy and one round trip fewer per image.
LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False,
                           "max_direct_call_object_size": 1 << 20}

# Ray (2.5x) turns token authentication on for each new local cluster and warns that it did, on every start,
# unless RAY_AUTH_MODE is set; setting it after `import ray` leaves Ray's cached config behind (its processes
# then refuse each other), so the notice is quieted instead, for the local start only: joining a cluster
# still warns when that cluster runs without authentication.
RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"

# The interpreter's thread switch interval in the service's processes (Python's default: 5 ms). The HTTP
# server's thread, its request threads and the scheduler share one interpreter lock; with the default, a
# thread woken on the critical path of an image (the scheduler at a submission or an answer) can wait up
# to 5 ms behind a thread that keeps taking the lock back between short blocking calls.
SWITCH_INTERVAL_S = 0.001


@contextmanager
def _quiet(logger_name: str):
    """``logger_name``'s warnings off (errors still shown) for the block; its level restored after."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class ServiceError(RuntimeError):
    """The service could not start (bad model, port in use, unreachable database or cluster)."""


def build_catalog(config: Config) -> Catalog:
    """The configured models' cards; each model's default sampler settings are checked now."""
    try:
        catalog = Catalog.of(list(config.workers.models), config.limits,
                             [config.workers.speed_of(m) for m in config.workers.models])
        for info in catalog.models.values():
            catalog.params(info, None, None, None, 0.0)
    except (ValueError, KeyError) as e:
        raise ServiceError(f"cannot serve the configured models: {getattr(e, 'message', e)}") from None
    for table in ("model_speed", "precision"):
        if unknown := sorted(set(getattr(config.workers, table)) - set(config.workers.models)):
            raise ServiceError(f"[workers.{table}] names {', '.join(map(repr, unknown))}, not among the served "
                               f"models ({', '.join(config.workers.models)})")
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
    """Deletes finished jobs (rows, images and inputs) ``seconds`` after they end (0 keeps them), uploads past
    their expiry (``[store] upload_retention_hours``, checked every ``sweep_every_s``), and the temp files of
    results a killed process never finished writing. A thread of its own: deleting many images must not hold
    up the scheduler's dispatch."""

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
                    if expired := self.store.purge_uploads():
                        log.info("deleted %d upload(s) past retention", len(expired))
                if self.seconds and (purged := self.store.purge_finished(self.seconds)):
                    log.info("deleted %d finished job(s) past retention", len(purged))
            except Exception:  # a store hiccup must not end the policy
                log.exception("retention round failed; retrying")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server; a second signal of either kind (not only SIGINT) forces the exit, and open
        event streams end as the shutdown begins (their clients resume elsewhere) instead of holding it
        until the graceful-shutdown timeout."""

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                self.force_exit = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            streams = getattr(self.config.app.state, "event_streams", None)
            if streams is not None:
                streams.close()
            await super().shutdown(sockets)

    return Server


class Service:
    def __init__(self, config: Config, roles: tuple[str, ...] = ("api", "scheduler"), http_thread: bool = True):
        self.config, self.roles, self.http_thread = config, roles, http_thread
        self.metrics = Metrics()
        self.store: Store | None = None
        self.scheduler = None
        self.notifier = None
        self.retention = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server = None
        self._sock = None
        self._drain_at_exit = False  # serve_http(): the lifespan's end drains the scheduler
        self._started_ray = False
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = self.config.server.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    def start(self) -> "Service":
        from dit_serve.server import heap

        sys.setswitchinterval(SWITCH_INTERVAL_S)
        catalog = build_catalog(self.config)
        self.store = open_store(self.config)
        if self.config.workers.lora_dir and self.config.workers.lora_slots:
            register_dir(self.store, self.config.workers.lora_dir, LoraPolicy.of(self.config.workers), catalog.models)
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
        self.scheduler = Scheduler(self.store, cfg.worker_config(), cfg.scheduler, cfg.store.lease_seconds, self.metrics,
                                   cfg.autoscale)
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
                with _quiet(RAY_TOKEN_LOGGER):
                    ray.init(address="local", num_cpus=rc.num_cpus, _system_config=LOCAL_RAY_SYSTEM_CONFIG,
                             **kwargs)  # never join a stray local cluster
                watch_local_ray(self.config.store.data_dir)  # nothing of our Ray may outlive this process
        except Exception as e:
            raise ServiceError(f"cannot start or join Ray{f' at {rc.address}' if rc.address else ''}: {e}") from None
        self._started_ray = True

    def _start_api(self, catalog: Catalog) -> None:
        import uvicorn

        app = create_app(self.store, catalog, self.config.server, self.metrics,
                         lambda: self.scheduler.num_ready if self.scheduler else None, self.config.webhooks.allow_hosts,
                         upload_ttl_s=self.config.store.upload_retention_hours * 3600,
                         lora_policy=LoraPolicy.of(self.config.workers))
        app.router.lifespan_context = self._lifespan
        self._sock = _bind(self.config.server.host, self.config.server.port)
        self.port = self._sock.getsockname()[1]
        self._server = _server_class()(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
        if not self.http_thread:  # serve_http() runs it on the main thread
            return
        self._spawn("http", self._server.run, [self._sock])  # off the main thread uvicorn leaves signals alone
        if not _wait_for(lambda: self._server.started or not self._threads[-1].is_alive(), 30):
            raise ServiceError("the HTTP server did not start within 30 s")
        log.info("dit-serve API at %s", self.url)

    def serve_http(self) -> None:
        """Serve HTTP on the calling (main) thread until SIGINT or SIGTERM, with uvicorn's own signal
        handling and graceful shutdown; the lifespan's end drains the scheduler. Returns once done."""
        for sig in (signal.SIGINT, signal.SIGTERM):  # what uvicorn restores and raises again after its exit
            signal.signal(sig, lambda *_: None)      # (the default would end the process before stop())
        self._drain_at_exit = True
        self._server.run([self._sock])

    @asynccontextmanager
    async def _lifespan(self, _app):
        """Nothing to start (the store and the scheduler run before HTTP does); at the end of a
        ``serve_http`` shutdown, the drain, off the event loop; a second signal ends it early."""
        yield
        if self._drain_at_exit and self.scheduler is not None:
            print(f"dit-serve: stopping (draining for up to {self.config.scheduler.drain_seconds:.0f} s; "
                  "signal again to stop now)", file=sys.stderr, flush=True)
            await asyncio.to_thread(self.drain, None, lambda: self._server.force_exit)

    def _spawn(self, name: str, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name=f"dit-serve-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Block until at least one worker is ready (models loaded and warm)."""
        return _wait_for(lambda: self.scheduler is not None and self.scheduler.num_ready > 0, timeout)

    def drain(self, timeout_s: float | None = None, hurry=lambda: False) -> bool:
        """Stop leasing new work and wait up to ``timeout_s`` (``[scheduler] drain_seconds``) for the
        running items to finish, or until ``hurry()``; True if they did. ``stop`` then hands back
        whatever is left."""
        if self.scheduler is None:
            return True
        self.scheduler.draining = True
        timeout_s = self.config.scheduler.drain_seconds if timeout_s is None else timeout_s
        _wait_for(lambda: self.scheduler.held == 0 or hurry(), timeout_s, interval=0.1)
        return self.scheduler.held == 0

    def stop(self) -> None:
        if self._server is not None:
            streams = getattr(self._server.config.app.state, "event_streams", None)
            if streams is not None:  # open event streams end now (clients resume elsewhere), not at a timeout
                streams.close()
            self._server.should_exit = True
        self._stop.set()
        if self.store is not None:
            self.store.work.set()  # the scheduler's loop waits on it: it sees the stop now, not after a tick
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
