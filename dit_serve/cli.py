"""Batch image generation with diffusion transformers.

    dit-serve serve [--config FILE]          the service (local Ray, SQLite, digits on the CPU by default)
    dit-serve submit --labels 3,7 [--out D]  queue a job (and wait for it and write its images);
                                             text models: --prompt "a handwritten seven" (repeatable);
                                             edits: --image IN.png [--mask M.png] [--strength S];
                                             several references: --image A.png --image B.png
    dit-serve status JOB                     a job's state and progress
    dit-serve list [--limit N]               jobs, newest first
    dit-serve fetch JOB --out DIR            write a job's PNGs, grid.png and manifest.json
    dit-serve cancel JOB [--delete]          stop a job (and delete it with its images)
    dit-serve loras [upload|delete]          adapters (LoRA): list, register a .safetensors, delete;
                                             submit --lora NAME[:SCALE] (repeatable) applies one
    dit-serve keys create|list|revoke        tenants' API keys, in the service's store
    dit-serve generate ...                   run locally, no service (--lora FILE[:SCALE] applies an adapter file)
    dit-serve demo                           the main job: service + SDK + images, then shut down

The client commands talk to $DIT_SERVE_URL (else http://127.0.0.1:8000) with the key in $DIT_SERVE_API_KEY;
--url and --api-key override them. Bad input prints one line to stderr and exits 2; so does a server-side
command (serve, generate, demo, keys) where only the base install (the SDK and the client commands) is.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

from dit_serve import __version__, commands
from dit_serve.commands import EXIT_PIPE, EXIT_USAGE, CommandError, user_error
from dit_serve.errors import UsageError
from samplers.rules import RULES

SAMPLERS_HELP = f"{', '.join(RULES)} (default: the model's; GET /v1/models lists the samplers each model takes)"
# What the server-side commands import beyond the base install; `pip install 'dit-serve[server]'` brings it.
SERVICE_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "prometheus_client")  # dit_serve.server.service: API, store, metrics
MODEL_MODULES = ("torch", "diffusers", "safetensors")  # loading and running a model


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump) and exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _labels(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _lora(text: str) -> tuple[str, float]:
    """``NAME[:SCALE]`` -> (name, scale); scale 1 when omitted."""
    name, sep, scale = text.rpartition(":") if ":" in text else (text, "", "")
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME[:SCALE]")
    if not sep:
        return name, 1.0
    try:
        value = float(scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the scale {scale!r} is not a number (NAME[:SCALE])") from None
    if value != value or abs(value) == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the scale must be a finite number")
    return name, value


def _lora_file(text: str) -> tuple[Path, float]:
    """``FILE[:SCALE]`` -> (path, scale): the part after the last colon is the scale when it is a number, so a path
    with a colon of its own still reads (``C:/x.safetensors``); scale 1 when omitted."""
    path, sep, scale = text.rpartition(":")
    try:
        value = float(scale) if sep and path else None
    except ValueError:
        value = None
    if value is None:
        path, value = text, 1.0
    if value != value or abs(value) == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the scale must be a finite number")
    return Path(path), value


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


def _add_edit(p) -> None:
    """An input image to vary (image-to-image) or, with a mask, to inpaint (models whose card says so)."""
    p.add_argument("--image", type=Path, action="append",
                   help="edits: a PNG, JPEG or WebP image to start from (image-to-image; the models that take one: "
                        "GET /v1/models, takes_image); repeated: an instruction edit's reference images in order, "
                        "for models that take several (max_images: Qwen-Image-Edit-Plus 3)")
    p.add_argument("--mask", type=Path, help="inpainting: an image of --image's size, white = repaint, "
                                             "black = keep")
    p.add_argument("--strength", type=float, help="edits: how much of the schedule runs, in (0, 1] (default 0.6; "
                                                  "1.0 with --mask): 1 repaints from noise, 0.3 stays close")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate images locally and write PNGs + manifest.json")
    p.add_argument("--model", default=None, help="'digits' (the default: class-conditional, --labels), "
                                                 "'digits-text' (--prompt), a built-in architecture, or a model "
                                                 "directory")
    _add_conditioning(p)
    _add_edit(p)
    _add_sampling(p)
    p.add_argument("--lora", action="append", type=_lora_file, dest="loras", metavar="FILE[:SCALE]",
                   help="apply an adapter (LoRA: a .safetensors of diffusers/PEFT or kohya keys) to every image, at "
                        "SCALE in [-4, 4] (default 1); repeatable, up to 4")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "eager", "full", "breakable", "graphs"],
                   help="auto: graphs on CUDA (whole-step graphs per model, breakable ones where a step has eager "
                        "breaks), eager on the CPU")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8", "fp8+attention"],
                   help="fp8: the transformer blocks' linears as FP8 matrix products (GPUs of compute capability "
                        "8.9+, or the CPU); fp8+attention: and SD3's and FLUX.1's joint attention in FP8 (Hopper, "
                        "with the cuDNN frontend installed); bf16: the model's dtype")


def _add_sampling(p) -> None:
    p.add_argument("--seed", type=int, default=None, help="image i uses seed + i (default: a random seed, "
                                                          "recorded with each image)")
    p.add_argument("--sampler", help=SAMPLERS_HELP)
    p.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale, 0..100 (default: the model's)")
    p.add_argument("--eta", type=float, help="DDIM's eta, 0..1: 0 is deterministic (the default), 1 DDPM-like")


def _add_service(p, inner: bool = False) -> None:
    """--url and --api-key; ``inner``: on a subcommand's own parser, where an absent option leaves the outer's."""
    keep = {"default": argparse.SUPPRESS} if inner else {}
    p.add_argument("--url", help="the service's base URL (default: $DIT_SERVE_URL, else http://127.0.0.1:8000)", **keep)
    p.add_argument("--api-key", help="the service's API key (default: $DIT_SERVE_API_KEY)", **keep)


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
    job_help = "the job's id (submit prints it; list shows them)"
    p = sub.add_parser("submit", help="queue a job on a running service")
    _add_service(p)
    p.add_argument("--model", help="a model the service serves (default: its first)")
    _add_conditioning(p)
    _add_edit(p)
    _add_sampling(p)
    p.add_argument("--priority", type=int, help="-100..100 (default 0): higher runs first")
    p.add_argument("--preview-every", type=int, metavar="N", help="a preview of each running image every N steps "
                                                                  "(models with a preview map)")
    p.add_argument("--lora", action="append", type=_lora, dest="loras", metavar="NAME[:SCALE]",
                   help="apply a registered adapter at SCALE (default 1; repeatable; dit-serve loras lists them)")
    p.add_argument("--webhook-url", help="POSTed the finished job as JSON")
    p.add_argument("--wait", action="store_true", help="wait for the job with a progress bar")
    p.add_argument("--out", type=Path, help="wait, then write the images here (an empty or new folder)")
    p.add_argument("--force", action="store_true", help="write into --out even when it holds files")
    p = sub.add_parser("status", help="a job's state and progress")
    p.add_argument("job", help=job_help)
    _add_service(p)
    p.add_argument("--json", action="store_true", help="print the whole job as JSON")
    p = sub.add_parser("list", help="the service's jobs, newest first")
    _add_service(p)
    p.add_argument("--limit", type=int, default=20, help="how many (1..100)")
    p.add_argument("--offset", type=int, default=0, help="skip this many of the newest")
    p = sub.add_parser("cancel", help="cancel a job (queued items never run, running ones stop at the next step)")
    p.add_argument("job", help=job_help)
    _add_service(p)
    p.add_argument("--delete", action="store_true", help="also delete the job and its images from the service")
    p = sub.add_parser("fetch", help="write a job's PNGs, grid.png and manifest.json")
    p.add_argument("job", help=job_help)
    _add_service(p)
    p.add_argument("--out", type=Path, required=True, help="the folder to write into (an empty or new one)")
    p.add_argument("--force", action="store_true", help="write into --out even when it holds files")
    p.add_argument("--wait", action="store_true", help="wait for the job to finish first")


def _add_loras(sub) -> None:
    loras = sub.add_parser("loras", help="adapters (LoRA) jobs may apply: list (the default), upload, delete")
    _add_service(loras)
    actions = loras.add_subparsers(dest="action", parser_class=_Parser)
    up = actions.add_parser("upload", help="register a .safetensors adapter for a model")
    up.add_argument("file", type=Path, help="the adapter (diffusers/PEFT or kohya keys; safetensors only)")
    up.add_argument("--name", help="what jobs call it (default: the file's stem)")
    up.add_argument("--model", help="the model it is for (default: the service's first)")
    up.add_argument("--shared", action="store_true", help="admin key: every tenant may use it")
    _add_service(up, inner=True)
    rm = actions.add_parser("delete", help="delete an adapter you registered")
    rm.add_argument("name")
    _add_service(rm, inner=True)


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
    parser = _Parser(prog="dit-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--version", action="version", version=f"dit-serve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_serve(sub)
    _add_client(sub)
    _add_generate(sub)
    _add_loras(sub)
    _add_keys(sub)
    demo = sub.add_parser("demo", help="the main job: start the service, submit digits through the SDK, "
                                       "write PNGs + grid.png, shut down")
    demo.add_argument("--out", type=Path, default=Path("out/demo"), help="where the images go (default out/demo)")
    demo.add_argument("--num-per-label", type=int, default=8, help="images of each digit (default 8)")
    demo.add_argument("--config", type=Path, help="TOML config (default: the embedded defaults)")
    return parser


COMMANDS = {"generate": commands.generate, "demo": commands.demo, "serve": commands.serve,
            "submit": commands.submit, "status": commands.status, "fetch": commands.fetch,
            "cancel": commands.cancel, "list": commands.list_jobs, "keys": commands.keys,
            "loras": commands.loras}


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
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, not at exit: a reader gone by then is a BrokenPipeError caught below
        return code
    except BrokenPipeError:  # `dit-serve status JOB --json | head`: the reader went away; end quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        return EXIT_PIPE
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
