"""What the CLI's commands do (``serve``, ``submit``, ``status``, ``cancel``, ``fetch``, ``generate``,
``keys``, ``demo``); ``cli.py`` keeps the parser and imports this module, never the other way. The client
commands import neither torch nor ray.

Exit codes: 0 ok; 2 bad input (a 4xx from the service, a bad config or URL, a port in use); 1 the service
could not be reached or failed (5xx); 130 interrupted; 141 the reader of stdout went away (as SIGPIPE).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from dit_serve.errors import UsageError

EXIT_USAGE, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_PIPE = 2, 1, 130, 141
URL_ENV = "DIT_SERVE_URL"
DEFAULT_URL = "http://127.0.0.1:8000"
RANDOM_SEEDS = 2**31  # a default seed is drawn below this: seed + i stays a small, easily retyped number


@dataclass
class CommandError(Exception):
    message: str
    code: int = EXIT_USAGE


def user_error(e: Exception) -> CommandError | None:
    """The one-line message and exit code for an error the user can act on; None for a bug."""
    import httpx

    from dit_serve.client import ApiError, InvalidRequest
    from dit_serve.errors import ConfigError

    if isinstance(e, ApiError) and e.status == 401:
        return CommandError(f"{e.message} (set DIT_SERVE_API_KEY or pass --api-key)")
    if isinstance(e, ApiError):
        return CommandError(e.message, EXIT_USAGE if e.status < 500 else EXIT_FAILURE)
    if isinstance(e, InvalidRequest):
        return CommandError(str(e))
    if isinstance(e, httpx.TransportError):
        url = getattr(getattr(e, "request", None), "url", "the service")
        return CommandError(f"cannot reach dit-serve at {url}: {e or type(e).__name__}", EXIT_FAILURE)
    if isinstance(e, ConfigError):
        return CommandError(str(e))
    if type(e).__name__ == "ServiceError":  # not imported here: it lives beside ray and torch
        return CommandError(str(e))
    return None


def _config(args):
    from dit_serve.client import API_KEY_ENV
    from dit_serve.server.config import load_config

    cfg = load_config(getattr(args, "config", None))
    env_key = os.environ.get(API_KEY_ENV, "")  # a key kept out of files and the process list
    return cfg.with_overrides(
        server={"host": getattr(args, "host", None), "port": getattr(args, "port", None),
                "api_keys": (*cfg.server.api_keys, env_key) if env_key else None},
        store={"url": getattr(args, "database_url", None), "data_dir": getattr(args, "data_dir", None)},
        ray={"address": getattr(args, "ray_address", None)},
        workers={"models": tuple(args.models) if getattr(args, "models", None) else None})


def serve(args) -> int:
    """Run until SIGINT or SIGTERM, then drain (no new leases; running items may finish for up to
    ``[scheduler] drain_seconds``) and stop cleanly (the rest back to the queue, workers stopped).
    A second signal skips the drain. With the API, uvicorn runs on this thread and handles the signals
    (``Service.serve_http``); a scheduler-only process waits for them here."""
    from dit_serve.server import heap
    from dit_serve.server.access_log import LOGGER as ACCESS_LOGGER
    from dit_serve.server.service import Service

    heap.limit_arenas()  # before the service's threads exist (dit_serve.server.heap says why)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)  # shown below the CLI's default warning level
    cfg = _config(args)
    roles = ("api", "scheduler") if args.role == "all" else (args.role,)
    if "api" in roles:
        _check_port(cfg.server.host, cfg.server.port)
    with Service(cfg, roles=roles, http_thread=False) as svc:
        where = svc.url if "api" in roles else "no HTTP (scheduler only)"
        print(f"dit-serve: serving {', '.join(cfg.workers.models)} at {where}; "
              f"store {cfg.store.database_url()}", flush=True)
        if "api" in roles:
            svc.serve_http()
        else:
            _serve_scheduler(svc, cfg)
    return 0


def _check_port(host: str, port: int) -> None:
    """A port in use is said at once, not after Ray and the models started (the service binds it later)."""
    import socket

    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the service binds
        try:
            probe.bind((host, port))
        except OSError as e:
            raise CommandError(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another with --port, "
                               "or 0 for a free one)") from None


def _serve_scheduler(svc, cfg) -> None:
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(*_):
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(sig, on_signal)
    stop.wait()
    print(f"dit-serve: stopping (draining for up to {cfg.scheduler.drain_seconds:.0f} s; "
          "signal again to stop now)", file=sys.stderr, flush=True)
    svc.drain(hurry=hurry.is_set)


def keys(args) -> int:
    """``dit-serve keys create|list|revoke``: works on the store the config names, no service needed."""
    import time

    from dit_serve.server import keys as k
    from dit_serve.server.service import open_store

    cfg = _config(args)
    where = _store_shown(cfg.store.database_url())
    if args.action != "create":
        _check_store_exists(cfg.store.database_url(), where)
    store = open_store(cfg)
    try:
        if args.action == "create":
            for flag, value, lo, hi in (("--max-queued", args.max_queued, 1, 10**9),
                                        ("--max-priority", args.max_priority, -100, 100)):
                if value is not None and not lo <= value <= hi:
                    raise CommandError(f"{flag} must be between {lo} and {hi}, got {value}")
            try:
                key_id, key = k.create_key(store, args.tenant, "admin" if args.admin else "user", args.name)
            except ValueError as e:
                raise CommandError(str(e)) from None
            k.set_limits(store, args.tenant, args.max_queued, args.max_priority)
            print(key)
            print(f"key {key_id} for tenant {args.tenant!r} ({'admin' if args.admin else 'user'}) written to the "
                  f"store {where}: keep the key now, it is not shown again", file=sys.stderr)
        elif args.action == "list":
            print(f"keys in the store {where}", file=sys.stderr)
            print(f"{'ID':<{KEY_ID_WIDTH}}  {'TENANT':<20} {'ROLE':<5} {'STATE':<7} {'CREATED':<16}  LIMITS  NAME")
            for row in k.list_keys(store):
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created_at"]))
                state = "revoked" if row["revoked_at"] else "active"
                limits = f"max_queued={row['max_queued'] or '-'} max_priority={row['max_priority'] if row['max_priority'] is not None else '-'}"
                print(f"{row['id']}  {row['tenant']:<20} {row['role']:<5} {state:<7} {when}  {limits}  {row['name'] or ''}")
        elif not k.revoke_key(store, args.key_id):
            raise CommandError(f"no active key with id {args.key_id!r} (see dit-serve keys list)")
        else:
            print(f"revoked key {args.key_id}", file=sys.stderr)
    finally:
        store.close()
    return 0


KEY_ID_WIDTH = 12  # an id as dit_serve.server.keys makes it (its header column is as wide)


def _store_shown(url: str) -> str:
    """The store's URL as said to a user: without its password."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _check_store_exists(url: str, where: str) -> None:
    """A read-only command (keys list, keys revoke) never creates a store: an SQLite file that is not there
    is a wrong folder or a missing --config, said as such."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and not Path(parsed.database).exists():
        raise CommandError(f"no job store at {parsed.database} ({where}): pass the service's --config, or "
                           "--database-url or --data-dir (keys create makes a store; this command only reads one)")


def prompts_of(args) -> list[str] | None:
    """--prompt values, or the lines of --prompts-file (blank lines skipped); None for a labels job."""
    if args.prompts_file is not None:
        try:
            return [line.strip() for line in args.prompts_file.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise UsageError(f"cannot read --prompts-file {str(args.prompts_file)!r}: {e.strerror or e}") from None
    return args.prompts


def seed_of(args) -> int:
    """--seed, else a random one (repeated runs differ, as in the reference UIs; the seed is recorded)."""
    return args.seed if args.seed is not None else secrets.randbelow(RANDOM_SEEDS)


def generate(args) -> int:
    from dit_serve.schemas import Manifest
    from dit_serve.server.generate import GenerateArgs, run_generate

    a = GenerateArgs(model=args.model, labels=args.labels or (), num_per_label=args.num_per_label or 1,
                     prompts=tuple(prompts_of(args) or ()), negative_prompt=args.negative_prompt or "",
                     num_per_prompt=args.num_per_prompt or 1, width=args.width, height=args.height,
                     exact_size=args.exact_size, sampler=args.sampler, steps=args.steps, guidance=args.guidance,
                     seed=seed_of(args), eta=args.eta or 0.0, out=args.out, device=args.device,
                     backend=args.backend, precision=args.precision, image=(args.image or [None])[0],
                     extra_images=tuple(args.image or ())[1:], mask=args.mask, strength=args.strength,
                     loras=tuple(args.loras or ()))
    manifest = run_generate(a, progress=sys.stderr.isatty())
    for warning in Manifest.model_validate_json(manifest.read_text()).params.warnings:
        print(f"dit-serve: warning: {warning}", file=sys.stderr)
    print(f"wrote {manifest}")
    return 0


def service_url(args) -> str:
    """--url, else $DIT_SERVE_URL, else the local default; UsageError unless it is an http(s) URL with a host."""
    import httpx

    given = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    where = "--url" if args.url else f"${URL_ENV}" if os.environ.get(URL_ENV) else "the default URL"
    try:
        url = httpx.URL(given)
    except httpx.InvalidURL as e:
        raise UsageError(f"{where} {given!r} is not a URL: {e}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise UsageError(f"{where} {given!r} is not a URL of the service: it needs http:// or https:// and a host "
                         f"(e.g. {DEFAULT_URL})")
    return given


def _client(args):
    from dit_serve.client import Client

    return Client(service_url(args), api_key=args.api_key)


def _images(paths: list[Path] | None):
    """``--image`` as ``submit`` takes it: one path, or the list of a model's reference images."""
    return paths[0] if paths and len(paths) == 1 else paths


def submit(args) -> int:
    if args.out is not None:
        _check_out(args.out, args.force)  # before the job exists: a folder that cannot take it stops here
    with _client(args) as client:
        job = client.submit(list(args.labels) if args.labels else None, prompts=prompts_of(args),
                            negative_prompt=args.negative_prompt, num_per_prompt=args.num_per_prompt,
                            model=args.model, num_per_label=args.num_per_label, seed=args.seed,
                            sampler=args.sampler, steps=args.steps, guidance=args.guidance, eta=args.eta,
                            priority=args.priority, webhook_url=args.webhook_url, width=args.width,
                            height=args.height, exact_size=args.exact_size or None,
                            preview_every=args.preview_every, image=_images(args.image), mask=args.mask,
                            strength=args.strength, loras=args.loras)
        try:  # from the moment the job exists: an interrupt says how to stop it, however early it comes
            print(job.id, flush=True)
            if args.wait or args.out:
                job = client.wait(job, progress=sys.stderr.isatty())
        except KeyboardInterrupt:
            raise CommandError(f"interrupted; job {job.id} keeps running on the service (stop it with: "
                               f"dit-serve cancel {job.id})", EXIT_INTERRUPTED) from None
        if args.wait or args.out:
            print(_report(job), file=sys.stderr)
        if args.out:
            return _write(client, job, args.out, force=True)  # checked above, before the job existed
    return 0 if job.state != "failed" else EXIT_FAILURE


def loras(args) -> int:
    """``dit-serve loras``: list (the default), ``upload FILE``, ``delete NAME``."""
    with _client(args) as client:
        if args.action == "upload":
            lora = client.upload_lora(args.file, args.name or args.file.stem, args.model, args.shared or None)
            print(_lora_line(lora))
        elif args.action == "delete":
            print(_lora_line(client.delete_lora(args.name)) + " (deleted)")
        else:
            listed = client.loras().data
            for lora in listed:
                print(_lora_line(lora))
            print(f"{len(listed)} adapters", file=sys.stderr)
    return 0


def _lora_line(lora) -> str:
    whose = "shared" if lora.shared else lora.owner
    return f"{lora.name}\t{lora.model or '(any ' + (lora.family or 'model') + ')'}\t{lora.format} rank {lora.rank}\t{whose}"


def status(args) -> int:
    with _client(args) as client:
        job = client.get(args.job, items=args.json)
        print(job.model_dump_json(indent=2) if args.json else _report(job))
    return 0


def list_jobs(args) -> int:
    with _client(args) as client:
        page = client.list(limit=args.limit, offset=args.offset)
        for job in page.data:
            print(_summary(job))
        shown = f"{args.offset + 1}-{args.offset + len(page.data)}" if page.data else "none"
        more = f"; more with --offset {page.next_offset}" if page.next_offset is not None else ""
        print(f"{shown} of {page.total} jobs{more}", file=sys.stderr)
    return 0


def cancel(args) -> int:
    with _client(args) as client:
        job = client.delete(args.job) if args.delete else client.cancel(args.job)
        print(_summary(job) + (" (deleted)" if args.delete else ""))
    return 0


def fetch(args) -> int:
    _check_out(args.out, args.force)
    with _client(args) as client:
        job = client.wait(args.job, progress=sys.stderr.isatty()) if args.wait else client.get(args.job)
        return _write(client, job, args.out, args.force)


def _check_out(out: Path, force: bool) -> None:
    from dit_serve.outputs import check_out

    try:
        check_out(out, force)
    except ValueError as e:
        raise CommandError(str(e)) from None


def _write(client, job, out: Path, force: bool = False) -> int:
    from dit_serve.outputs import write_job

    try:
        manifest = write_job(client, job, out, force)
    except ValueError as e:
        raise CommandError(str(e)) from None
    except OSError as e:
        raise CommandError(f"cannot write to {str(out)!r}: {e.strerror or e}") from None
    print(f"wrote {manifest}")
    return 0


def _summary(job) -> str:
    counts = ", ".join(f"{n} {state}" for state, n in sorted(job.counts.items()))
    return (f"{job.id} {job.state}: {counts}; {job.steps_done}/{job.steps_total} steps "
            f"({job.model}, {job.params.sampler}, {job.params.steps} steps)")


def _report(job) -> str:
    """``_summary``, then each distinct reason items failed for, with how many: one line each."""
    lines = [_summary(job)]
    for f in job.failures:
        lines.append(f"  {f.items} item{'s' if f.items != 1 else ''} failed (first: item {f.first}): {f.error}")
    return "\n".join(lines)


def demo(args) -> int:
    """The main job: the service on the embedded default (local Ray, SQLite in a temporary folder,
    digits on the CPU), a job of the ten digits through the SDK with a progress bar, PNGs + grid +
    manifest into --out, then a clean shutdown."""
    from dit_serve.client import Client
    from dit_serve.server.service import local_service

    if args.num_per_label < 1:
        raise CommandError(f"--num-per-label must be >= 1, got {args.num_per_label}")
    _check_out(args.out, force=True)  # a rerun replaces the last run's images (outputs.write_job)
    with local_service(_config(args)) as svc, Client(svc.url) as client:
        cfg = svc.config
        print(f"dit-serve: service at {svc.url} (Ray {'at ' + cfg.ray.address if cfg.ray.address else 'local'}, "
              f"SQLite in {cfg.store.data_dir})", file=sys.stderr)
        model = client.models().data[0].id
        job = client.submit(list(range(10)), model=model, num_per_label=args.num_per_label)
        job = client.wait(job, progress=True)
        print(_report(job), file=sys.stderr)
        code = _write(client, job, args.out, force=True)
    print(f"grid: {args.out / 'grid.png'}")
    return code
