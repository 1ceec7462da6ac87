"""The `dit-serve` command line. Bad input prints one line to stderr and exits 2."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump) and exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _labels(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate images locally and write PNGs + manifest.json")
    p.add_argument("--model", default="digits", help="'digits', a built-in architecture, or a model directory")
    p.add_argument("--labels", type=_labels, required=True, help="comma-separated class numbers or names")
    p.add_argument("--num-per-label", type=int, default=1)
    p.add_argument("--sampler", default=None, help="ddpm, ddim, euler, euler_a, dpmpp_2m, flow_euler")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale (>= 0)")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM eta (0 = deterministic)")
    p.add_argument("--seed", type=int, default=0, help="image i uses seed + i")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--backend", default="auto", choices=["auto", "eager", "full", "breakable"])


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dit-serve", description="Batch image generation with diffusion transformers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    demo = sub.add_parser("demo", help="the main job on the embedded default (digits)")
    demo.add_argument("--out", type=Path, default=Path("out/demo"))
    return parser


def _cmd_generate(args) -> int:
    from dit_serve.generate import GenerateArgs, run_generate

    a = GenerateArgs(model=args.model, labels=args.labels, num_per_label=args.num_per_label,
                     sampler=args.sampler, steps=args.steps, guidance=args.guidance, seed=args.seed,
                     eta=args.eta, out=args.out, device=args.device, backend=args.backend)
    manifest = run_generate(a, progress=sys.stderr.isatty())
    print(f"wrote {manifest}")
    return 0


def _cmd_demo(args) -> int:
    from dit_serve.generate import GenerateArgs, run_generate

    a = GenerateArgs(model="digits", labels=tuple(str(i) for i in range(10)), num_per_label=8,
                     out=args.out)
    manifest = run_generate(a, progress=sys.stderr.isatty())
    print(f"wrote {manifest} and {args.out / 'grid.png'}")
    return 0


COMMANDS = {"generate": _cmd_generate, "demo": _cmd_demo}


def main(argv: list[str] | None = None) -> int:
    from dit_serve.generate import UsageError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except UsageError as e:
        print(f"dit-serve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dit-serve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
