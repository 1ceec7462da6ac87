"""The headline figures of one checkout, measured the same way at any commit: has a change slowed the engine?

Run it once per checkout on one GPU, the checkout's packages first on the path, and compare the two reports
(``--compare``):

    PYTHONPATH=/path/to/old/checkout python bench/parity.py --label before --out /tmp/parity
    PYTHONPATH=$PWD python bench/parity.py --label after --out /tmp/parity
    python bench/parity.py --compare /tmp/parity/parity_before.json /tmp/parity/parity_after.json --out docs/benchmarks

A checkout's run writes ``parity_<label>.json`` under ``--out`` (default: a temporary folder); the comparison prints
the table and, with ``--out``, writes the one current report there: ``parity.json``, both runs with their samples.

Figures (built-in models with random weights made on the GPU, bf16 unless named):

  dit one image        DiT-XL/2 256, one image end to end (DDIM 50 steps, guidance 4, decode), speed ``default``
  dit images/s         the same, 128 images admitted 64 at a time, run to completion
  pixart one image     PixArt-Σ 512, one image end to end (its card's sampler and steps, a prompt not seen
                       before: its encode included), speed ``default``
  flux step fast       FLUX.1-dev 1024, one image's denoising step, speed ``fast`` (compiled by blocks)
  flux step fastest    the same, speed ``fastest`` (FP8 linears and FP8 attention)

The engine is reached through its public API of either shape: ``workers.config.WorkerConfig`` with speeds, or
the ``workers.engine.EngineConfig`` of earlier commits (the same settings spelled out). ``--smoke``: the tiny
shipped models on a CPU, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

FLUX_SCOPE = "blocks"  # FLUX.1's `fast` compiles its blocks (workers.families.flux.Flux.compile_scope)


def engine(models, speed: str, family: str, precision: str = "bf16", max_batch: int = 64):
    """An engine over ``models`` at ``speed``, warmed, through whichever config API the checkout has."""
    from workers import engine as engine_module
    from workers.engine import Engine

    if hasattr(engine_module, "EngineConfig"):  # an earlier commit: the speed's settings spelled out
        EngineConfig = engine_module.EngineConfig
        fast = speed != "default"
        config = EngineConfig(backend="graphs", max_batch=max_batch, compile="inductor" if fast else "off", decode_graphs=fast,
                              compile_scope=FLUX_SCOPE if fast and family == "flux" else "step")
        eng = Engine(models, config)
    else:
        from workers.config import WorkerConfig

        eng = Engine(models, WorkerConfig(backend="graphs", max_batch=max_batch, speed=speed, precision={
            m.name: precision for m in ([models] if not isinstance(models, list) else models)}))
    eng.warmup()
    harness.sync()
    return eng


def unavailable(precision: str, device: str) -> str | None:
    """Why ``precision`` cannot run on ``device`` at this checkout, or None."""
    from workers import engine as engine_module

    if hasattr(engine_module, "EngineConfig"):  # an earlier commit
        from workers import fp8, fp8_attention

        if precision == "bf16":
            return None
        return fp8.unsupported_reason(device) or (
            fp8_attention.unavailable_reason(device) if precision == "fp8+attention" else None)
    from workers.speed.apply import unsupported_reason

    return unsupported_reason(precision, device)


def spec(i: int, **fields):
    try:
        from workers.request.spec import ItemSpec
    except ImportError:  # an earlier commit's layout
        from workers.spec import ItemSpec

    return ItemSpec(id=str(i), seed=i, **fields)


def one_image_ms(eng, make, runs: int) -> list[float]:
    """Wall ms of ``runs`` single requests end to end (``make(i)`` the i-th), after one unmeasured."""
    out = []
    for i in range(runs + 1):
        harness.sync()
        t0 = time.perf_counter()
        eng.generate([make(i)])
        harness.sync()
        if i:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def images_per_s(eng, make, n: int, active: int) -> float:
    eng.generate([make(10_000 + i) for i in range(active)], max_active=active)  # the buckets' first replays
    harness.sync()
    t0 = time.perf_counter()
    eng.generate([make(20_000 + i) for i in range(n)], max_active=active)
    harness.sync()
    return n / (time.perf_counter() - t0)


def step_ms(eng, request, steps: int) -> list[float]:
    """Wall ms of each of ``steps`` engine steps of one admitted request (synchronised), after two."""
    eng.add(request)
    out = []
    for i in range(steps + 2):
        harness.sync()
        t0 = time.perf_counter()
        eng.step()
        harness.sync()
        if i >= 2:
            out.append((time.perf_counter() - t0) * 1e3)
    eng.cancel(request.id)
    return out


def run(args) -> dict:
    from workers.loading import load_model

    device, dtype = harness.device_and_dtype(args.smoke)
    load = lambda name, precision="bf16": load_model(name, device=device, dtype=dtype, precision=precision)  # noqa: E731
    names = {"dit": "digits", "pixart": "digits-text", "flux": None} if args.smoke else \
        {"dit": "dit-xl-2-256", "pixart": "pixart-sigma-512", "flux": "flux-dev-1024"}
    runs = 3 if args.smoke else args.runs
    result: dict = {"label": args.label, "environment": harness.environment(device), "figures": {}, "samples": {}}
    figures, samples = result["figures"], result["samples"]

    def record(name, values, unit):
        samples[name] = values
        figures[name] = {"median": round(statistics.median(values), 3), "unit": unit}
        print(json.dumps({name: figures[name]}), flush=True)

    dit = engine(load(names["dit"]), "default", "dit")
    cls = 207 % next(iter(dit.models.values())).num_classes
    label = lambda i: spec(i, label=cls, sampler="ddim", steps=50, guidance=4.0)  # noqa: E731
    record("dit one image", one_image_ms(dit, label, runs), "ms")
    record("dit images/s", [images_per_s(dit, label, 16 if args.smoke else 128, 8 if args.smoke else 64)], "img/s")
    del dit
    harness.free()
    pixart = engine(load(names["pixart"]), "default", "pixart")
    card = pixart.models[names["pixart"]].card
    prompt = lambda i: spec(i, prompt=f"a watercolour of lighthouse number {i} on a cliff at dusk",  # noqa: E731
                            sampler=card.defaults["sampler"], steps=int(card.defaults["steps"]),
                            guidance=float(card.defaults["guidance"]))
    record("pixart one image", one_image_ms(pixart, prompt, runs), "ms")
    del pixart
    harness.free()
    if names["flux"] is None:
        return result
    for speed, precision in (("fast", "bf16"), ("fastest", "fp8+attention")):
        if (why := unavailable(precision, device)) is not None:
            result[f"flux step {speed}"] = f"skipped: {why}"
            continue
        # one image's step: buckets up to 4, which fit beside the weights on an 80 GB GPU
        flux = engine(load(names["flux"], precision), speed, "flux", precision, max_batch=4)
        request = spec(0, prompt="a red fox in fresh snow", sampler="flow_euler", steps=28, guidance=3.5)
        record(f"flux step {speed}", step_ms(flux, request, args.steps), "ms")
        del flux
        harness.free()
    return result


def compare(before: Path, after: Path) -> str:
    """A Markdown table of two reports' medians and their ratio (after / before)."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    rows = []
    for name, fa in a["figures"].items():
        fb = b["figures"].get(name)
        if fb is None:
            continue
        ratio = fb["median"] / fa["median"]
        rows.append([name, f"{fa['median']} {fa['unit']}", f"{fb['median']} {fb['unit']}", f"{ratio:.3f}"])
    return "\n".join(harness.table(["figure", a["label"], b["label"], f"{b['label']} / {a['label']}"], rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default="checkout", help="the report's name: parity_<label>.json")
    p.add_argument("--out", type=Path, default=None, help="folder of a run's report (default: a temporary one); "
                   "with --compare, where parity.json goes")
    p.add_argument("--runs", type=int, default=7, help="single-image runs per figure")
    p.add_argument("--steps", type=int, default=12, help="FLUX.1 steps timed per speed")
    p.add_argument("--smoke", action="store_true", help="the shipped tiny models on a CPU")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="print two reports' table")
    args = p.parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            runs = {"before": json.loads(args.compare[0].read_text()), "after": json.loads(args.compare[1].read_text())}
            (args.out / "parity.json").write_text(json.dumps(runs, indent=1) + "\n")
        return
    torch.manual_seed(0)
    result = run(args)
    out = harness.out_dir(args.out, True)  # a run's own report is an input of --compare, not a current report
    out.mkdir(parents=True, exist_ok=True)
    (out / f"parity_{args.label}.json").write_text(json.dumps(result, indent=1))
    print(out / f"parity_{args.label}.json")


if __name__ == "__main__":
    main()
