"""The `dit-serve` command line. Bad input prints one line to stderr and exits 2; so does a server-side
command (serve, generate, demo, keys) where only the base install (the SDK and the client commands) is.

    dit-serve serve [--config FILE]          the service (local Ray, SQLite, digits on the CPU by default)
    dit-serve submit --labels 3,7 [--out D]  queue a job (and wait for it and write its images);
                                             text models: --prompt "a handwritten seven" (repeatable)
    dit-serve status JOB                     a job's state and progress
    dit-serve list [--limit N]               jobs, newest first
    dit-serve fetch JOB --out DIR            write a job's PNGs, grid.png and manifest.json
    dit-serve cancel JOB [--delete]          stop a job (and delete it with its images)
    dit-serve keys create|list|revoke        tenants' API keys, in the service's store
    dit-serve generate ...                   run locally, no service
    dit-serve demo                           the main job: service + SDK + images, then shut down
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

EXIT_USAGE = 2
DEFAULT_URL = "http://127.0.0.1:8000"
# What the server-side commands import beyond the base install; `pip install 'dit-serve[server]'` brings it.
SERVICE_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "prometheus_client")  # dit_serve.server.service: API, store, metrics
MODEL_MODULES = ("torch", "diffusers", "safetensors")  # loading and running a model


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump) and exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _labels(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _add_conditioning(p) -> None:
    """Labels (class models) or prompts (text models); the model decides which it takes."""
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--labels", type=_labels, help="class models: comma-separated class numbers or names")
    what.add_argument("--prompt", action="append", dest="prompts", help="text models: a prompt (repeatable)")
    what.add_argument("--prompts-file", type=Path, help="text models: one prompt per line")
    p.add_argument("--negative-prompt", default=None, help="text models: what to steer away from")
    p.add_argument("--num-per-label", type=int, default=None, help="images per label (default 1)")
    p.add_argument("--num-per-prompt", type=int, default=None, help="images per prompt (default 1)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the model's size); models with "
                                                           "aspect-ratio bins make the nearest bin")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the model's size)")
    p.add_argument("--exact-size", action="store_true", help="resize (and centre-crop) to exactly "
                                                              "--width x --height")


def prompts_of(args) -> list[str] | None:
    """--prompt values, or the lines of --prompts-file (blank lines skipped); None for a labels job."""
    if args.prompts_file is not None:
        try:
            return [line.strip() for line in args.prompts_file.read_text().splitlines() if line.strip()]
        except OSError as e:
            from dit_serve.errors import UsageError

            raise UsageError(f"cannot read --prompts-file {str(args.prompts_file)!r}: {e.strerror or e}") from None
    return args.prompts


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate images locally and write PNGs + manifest.json")
    p.add_argument("--model", default=None, help="'digits' (the default), 'digits-flow', a built-in architecture, "
                                                 "or a model directory")
    _add_conditioning(p)
    p.add_argument("--sampler", default=None, help="ddpm, ddim, euler, euler_a, dpmpp_2m, flow_euler")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale (>= 0)")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM eta (0 = deterministic)")
    p.add_argument("--seed", type=int, default=0, help="image i uses seed + i")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "eager", "full", "breakable", "graphs"],
                   help="auto: graphs on CUDA (whole-step graphs per model, breakable ones where a step has eager "
                        "breaks), eager on the CPU")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8", "fp8+attention"],
                   help="fp8: the transformer blocks' linears as FP8 matrix products (GPUs of compute capability "
                        "8.9+, or the CPU); fp8+attention: and SD3's and FLUX.1's joint attention in FP8 (Hopper, "
                        "with the cuDNN frontend installed); bf16: the model's dtype")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the service: HTTP API, job store, scheduler and Ray workers")
    p.add_argument("--config", type=Path, help="TOML config file (every field has a default)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default 8000; 0 picks a free one)")
    p.add_argument("--ray-address", help="join this Ray cluster (default: start a local Ray)")
    p.add_argument("--database-url", help="sqlite:///path.db or postgresql://user:pw@host/db")
    p.add_argument("--data-dir", help="where images (and the default SQLite database) live")
    p.add_argument("--model", action="append", dest="models", help="serve this model (repeatable)")
    p.add_argument("--role", choices=["all", "api", "scheduler"], default="all",
                   help="api: HTTP only; scheduler: workers only (several API processes share one PostgreSQL)")


def _add_client(sub) -> None:
    p = sub.add_parser("submit", help="queue a job on a running service")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", help="a model the service serves (default: its first)")
    _add_conditioning(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler")
    p.add_argument("--steps", type=int)
    p.add_argument("--guidance", type=float)
    p.add_argument("--eta", type=float)
    p.add_argument("--priority", type=int, help="-100..100 (default 0): higher runs first")
    p.add_argument("--webhook-url", help="POSTed the finished job as JSON")
    p.add_argument("--wait", action="store_true", help="wait for the job with a progress bar")
    p.add_argument("--out", type=Path, help="wait, then write the images here")
    p = sub.add_parser("status", help="a job's state and progress")
    p.add_argument("job")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--json", action="store_true", help="print the whole job as JSON")
    p = sub.add_parser("list", help="the service's jobs, newest first")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--limit", type=int, default=20, help="how many (1..100)")
    p.add_argument("--offset", type=int, default=0)
    p = sub.add_parser("cancel", help="cancel a job (queued items never run, running ones stop at the next step)")
    p.add_argument("job")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--delete", action="store_true", help="also delete the job and its images from the service")
    p = sub.add_parser("fetch", help="write a job's PNGs, grid.png and manifest.json")
    p.add_argument("job")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--wait", action="store_true", help="wait for the job to finish first")


def _add_keys(sub) -> None:
    keys = sub.add_parser("keys", help="tenants' API keys (stored hashed in the service's job store)")
    actions = keys.add_subparsers(dest="action", required=True, parser_class=_Parser)
    create = actions.add_parser("create", help="make a key for a tenant and print it (shown only this once)")
    create.add_argument("--tenant", required=True, help="a-z, 0-9, '_', '.', '-' (created if new)")
    create.add_argument("--admin", action="store_true", help="the key sees and acts on every tenant's jobs")
    create.add_argument("--name", help="a note to tell keys apart in `keys list`")
    create.add_argument("--max-queued", type=int, help="the tenant's bound on queued items (default: [limits])")
    create.add_argument("--max-priority", type=int, help="the tenant's highest job priority (default: [limits])")
    actions.add_parser("list", help="every key: id, tenant, role, created, revoked (never the key)")
    revoke = actions.add_parser("revoke", help="revoke a key by its id (it stops working within seconds)")
    revoke.add_argument("key_id")
    for p in actions.choices.values():
        p.add_argument("--config", type=Path, help="the service's TOML config (names its store)")
        p.add_argument("--database-url", help="the store, if not the config's")
        p.add_argument("--data-dir", help="the data dir of the default SQLite store")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dit-serve", description="Batch image generation with diffusion transformers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_serve(sub)
    _add_client(sub)
    _add_generate(sub)
    _add_keys(sub)
    demo = sub.add_parser("demo", help="the main job: start the service, submit digits through the SDK, "
                                       "write PNGs + grid.png, shut down")
    demo.add_argument("--out", type=Path, default=Path("out/demo"))
    demo.add_argument("--num-per-label", type=int, default=8)
    demo.add_argument("--config", type=Path, help="TOML config (default: the embedded defaults)")
    return parser


def _cmd_generate(args) -> int:
    from dit_serve.server.generate import GenerateArgs, run_generate

    a = GenerateArgs(model=args.model, labels=args.labels or (), num_per_label=args.num_per_label or 1,
                     prompts=tuple(prompts_of(args) or ()), negative_prompt=args.negative_prompt or "",
                     num_per_prompt=args.num_per_prompt or 1, width=args.width, height=args.height,
                     exact_size=args.exact_size,
                     sampler=args.sampler, steps=args.steps, guidance=args.guidance, seed=args.seed,
                     eta=args.eta, out=args.out, device=args.device, backend=args.backend,
                     precision=args.precision)
    manifest = run_generate(a, progress=sys.stderr.isatty())
    print(f"wrote {manifest}")
    return 0


def _cmd_serve(args) -> int:
    from dit_serve.commands import serve

    return serve(args)


def _cmd_client(args) -> int:
    from dit_serve import commands

    return {"submit": commands.submit, "status": commands.status, "fetch": commands.fetch,
            "cancel": commands.cancel, "list": commands.list_jobs}[args.command](args)


def _cmd_keys(args) -> int:
    from dit_serve.commands import keys

    return keys(args)


def _cmd_demo(args) -> int:
    from dit_serve.commands import demo

    return demo(args)


COMMANDS = {"generate": _cmd_generate, "demo": _cmd_demo, "serve": _cmd_serve,
            "submit": _cmd_client, "status": _cmd_client, "fetch": _cmd_client, "cancel": _cmd_client,
            "list": _cmd_client, "keys": _cmd_keys}


def server_modules(args) -> tuple[str, ...]:
    """The server-side modules a command imports; none for the client commands. ``serve --role api``
    runs neither Ray nor a model."""
    workers = ("ray", *MODEL_MODULES)  # the scheduler's Ray actors load the models
    if args.command == "serve":
        return SERVICE_MODULES if args.role == "api" else SERVICE_MODULES + workers
    return {"generate": MODEL_MODULES, "keys": SERVICE_MODULES,
            "demo": SERVICE_MODULES + workers}.get(args.command, ())


def missing_extra(args) -> str | None:
    """One line naming the extra to install when a command's server-side modules are missing (found
    with find_spec, before anything imports them); None when they are all there."""

    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # a broken install, or a module without a spec
            return True

    missing = next((m for m in server_modules(args) if absent(m)), None)
    if missing is None:
        return None
    return f"dit-serve {args.command} needs the server extra ({missing} is not installed): pip install 'dit-serve[server]'"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (message := missing_extra(args)) is not None:
        print(message, file=sys.stderr)
        return EXIT_USAGE

    from dit_serve.commands import CommandError, user_error
    from dit_serve.errors import UsageError

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"dit-serve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CommandError as e:
        print(f"dit-serve: error: {e.message}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("dit-serve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        mapped = user_error(e)
        if mapped is None:
            raise
        print(f"dit-serve: error: {mapped.message}", file=sys.stderr)
        return mapped.code


if __name__ == "__main__":
    sys.exit(main())
