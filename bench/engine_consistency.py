"""Does a request's image depend on how it was batched? (bf16 on a GPU; float32 on a CPU)

Runs the same requests through the engine four ways: each alone (bucket 1), all together (split into
power-of-two replays), padded into larger buckets (timings that make padding win), and joining a
running batch mid-flight. Reports the max and mean uint8 pixel difference against "alone" and, for
the digits model, how often the digit classifier's verdict is unchanged. Writes
docs/benchmarks/engine_consistency.json.

    python bench/engine_consistency.py [--model digits] [--requests 200]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def requests(n: int, num_classes: int):
    from workers.spec import ItemSpec

    mix = [("ddim", 50, 2.0), ("dpmpp_2m", 20, 2.0), ("euler_a", 30, 1.5), ("ddim", 30, 3.0)]
    return [ItemSpec(id=str(i), label=i % num_classes, seed=7000 + i, sampler=mix[i % 4][0],
                         steps=mix[i % 4][1], guidance=mix[i % 4][2]) for i in range(n)]


def run_ways(model, reqs, backend: str, max_batch: int) -> dict[str, np.ndarray]:
    from workers.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(backend=backend, max_batch=max_batch))
    engine.warmup()
    runner = next(iter(engine.groups.values())).runner
    images = lambda rs: np.stack([r.image for r in rs]).astype(np.int16)
    out = {"alone": images([engine.generate([r])[0] for r in reqs]),
           "together": images(engine.generate(reqs))}
    measured = runner.replay_ms
    runner.replay_ms = {b: 1.0 for b in runner.buckets}  # every bucket costs the same: pad to the largest
    out["padded"] = images(engine.generate(reqs))
    runner.replay_ms = measured or {b: float(b) for b in runner.buckets}
    out["joined"] = images(engine.generate(reqs, max_active=max(1, len(reqs) // 3)))
    return out


def main() -> None:
    from workers.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="digits")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_model(args.model, device="cuda" if cuda else "cpu", dtype=dtype)
    reqs = requests(args.requests, model.num_classes)
    imgs = run_ways(model, reqs, "breakable" if cuda else "eager", max_batch=64)
    report = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "model": args.model, "dtype": str(dtype), "requests": len(reqs), "ways": {}}
    verdict = None
    if args.model.startswith("digits"):
        from workers.digits import classify

        verdict = {k: classify(v.astype(np.float32) / 127.5 - 1.0) for k, v in imgs.items()}
    for way in ("together", "padded", "joined"):
        diff = np.abs(imgs[way] - imgs["alone"])
        row = {"max_uint8_diff": int(diff.max()), "mean_uint8_diff": round(float(diff.mean()), 4)}
        if verdict is not None:
            row["verdict_unchanged"] = round(float(np.mean(verdict[way] == verdict["alone"])), 4)
        report["ways"][way] = row
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if cuda else "_cpu"
    (args.out / f"engine_consistency{suffix}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
