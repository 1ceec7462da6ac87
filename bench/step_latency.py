"""Step latency of one CFG denoising step of DiT-XL/2 (random weights, bf16) on a GPU.

Compares, in one run, at each batch size 1, 2, 4, ..., 64 and at 256 and 512 px:
  diffusers  - the loop body of diffusers' DiTPipeline (what a user runs today), eager
  eager      - our step runner with no capture (same static buffers)
  full       - our runner, one CUDA graph per bucket
  breakable  - our runner, graph segments with each layer's attention as an eager break
  compile    - torch.compile(mode="reduce-overhead") of our step function, for a few batches
plus the capture time of all buckets (against torch.compile's compile time per shape), graph
memory with one shared pool against one pool per bucket and against the largest bucket alone,
and the arena's size. Prints a table; writes docs/benchmarks/step_latency.{json,md}.

    python bench/step_latency.py [--resolutions 256 512] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

BATCHES = (1, 2, 4, 8, 16, 32, 64)
COMPILE_BATCHES = (1, 8, 64)


def cuda_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, synchronised (fn includes its own host work)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def iters_for(batch: int, res: int) -> int:
    return 30 if batch * (res // 256) ** 2 <= 16 else 12


def live_inputs(model, batch: int):
    from samplers import gather_rows, make_plan

    dev = model.device
    plan = make_plan("ddim", 50, model.schedule)
    t, coeffs = gather_rows([plan] * batch, [10] * batch)
    x = torch.randn(batch, *model.latent_shape, device=dev)
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), labels=torch.randint(0, 1000, (batch,), device=dev),
                guidance=torch.full((batch,), 4.0, device=dev), hist=torch.zeros_like(x), noise=torch.zeros_like(x))


def diffusers_step_fn(model, batch: int):
    """One iteration of DiTPipeline.__call__'s loop, as diffusers 0.3x writes it."""
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False)
    sched.set_timesteps(50)
    t = sched.timesteps[10]
    c = model.latent_shape[0]
    lat = torch.randn(2 * batch, *model.latent_shape, device=model.device, dtype=model.dtype)
    labels = torch.cat([torch.randint(0, 1000, (batch,)), torch.full((batch,), 1000)]).to(model.device)

    def step():
        half = lat[: len(lat) // 2]
        inp = sched.scale_model_input(torch.cat([half, half]), t)
        timesteps = t[None].to(inp.device).expand(inp.shape[0])
        noise_pred = model.transformer(inp, timestep=timesteps, class_labels=labels).sample
        eps, rest = noise_pred[:, :c], noise_pred[:, c:]
        cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + 4.0 * (cond_eps - uncond_eps)
        eps = torch.cat([half_eps, half_eps], dim=0)
        model_output, _ = torch.split(torch.cat([eps, rest], dim=1), c, dim=1)
        return sched.step(model_output, t, inp).prev_sample

    return step


def mem_mb() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() / 2**20


def build_runner(model, backend: str, **kw):
    from graphs import GraphRunner
    from workers.engine import step_specs
    from workers.families import family_of

    inputs, outputs = step_specs(model)
    return GraphRunner(family_of(model).make_step(model), inputs, outputs, max_batch=max(BATCHES), backend=backend,
                       device=model.device, **kw)


def bench_resolution(res: int, rows: list, capture_s: dict, memory: dict) -> None:
    from workers.loading import load_model
    from workers.patches import break_attention, restore_attention

    model = load_model(f"dit-xl-2-{res}", device="cuda", dtype=torch.bfloat16)
    name = f"dit-xl-2-{res}"
    with torch.no_grad():
        for b in BATCHES:
            rows.append(dict(model=name, resolution=res, batch=b, backend="diffusers",
                             ms=cuda_ms(diffusers_step_fn(model, b), iters_for(b, res))))
        break_attention(model.transformer)  # same math; an eager break only under `breakable`
        for backend in ("eager", "full", "breakable"):
            base = mem_mb()
            runner = build_runner(model, backend)
            t0 = time.perf_counter()
            runner.warmup()
            torch.cuda.synchronize()
            capture_s[f"{name}/{backend}"] = round(time.perf_counter() - t0, 3)
            memory[f"{name}/{backend}/reserved_delta_mb"] = round(mem_mb() - base, 1)
            memory[f"{name}/{backend}/shared_pool_mb"] = round(runner.stats()["pool_reserved_bytes"] / 2**20, 1)
            memory[f"{name}/arena_mb"] = round(runner.stats()["arena_bytes"] / 2**20, 3)
            for b in BATCHES:
                inp = live_inputs(model, b)
                rows.append(dict(model=name, resolution=res, batch=b, backend=backend,
                                 ms=cuda_ms(lambda: runner.run(**inp), iters_for(b, res))))
            rows.append(dict(model=name, resolution=res, batch=0, backend=f"{backend}_stats",
                             ms=0.0, stats=_jsonable(runner.stats())))
            del runner
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        _memory_variants(model, name, memory)
        _capture_variants(model, name, capture_s)
        restore_attention(model.transformer)
        if res == 256:
            _bench_compile(model, name, rows, capture_s)
    del model
    torch.cuda.empty_cache()


def _memory_variants(model, name: str, memory: dict) -> None:
    """Graph memory with one pool per bucket (and so the largest bucket alone) against the shared pool."""
    torch.cuda.empty_cache()
    runner = build_runner(model, "full", separate_pools=True)
    runner.warmup()
    per_bucket = {b: s["pool_reserved_bytes"] / 2**20 for b, s in runner.stats()["buckets"].items()}
    memory[f"{name}/full/separate_pools_mb"] = round(sum(per_bucket.values()), 1)
    memory[f"{name}/full/largest_bucket_alone_mb"] = round(per_bucket[max(per_bucket)], 1)
    del runner
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _capture_variants(model, name: str, capture_s: dict) -> None:
    """Capture time with the lean warm-up (1 eager step and 3 timed replays per bucket, against 2 and 5):
    the warm-up and the timing of the buckets are most of the capture time."""
    for backend in ("full", "breakable"):
        runner = build_runner(model, backend, warmup_iters=1, timing_reps=3)
        t0 = time.perf_counter()
        runner.warmup()
        torch.cuda.synchronize()
        capture_s[f"{name}/{backend}/lean_warmup"] = round(time.perf_counter() - t0, 3)
        failures = sum(s["capture_failures"] for s in runner.stats()["buckets"].values())
        capture_s[f"{name}/{backend}/lean_warmup_capture_failures"] = failures
        del runner
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _bench_compile(model, name: str, rows: list, capture_s: dict) -> None:
    from workers.families import family_of

    step = torch.compile(family_of(model).make_step(model), mode="reduce-overhead")
    for b in COMPILE_BATCHES:
        inp = live_inputs(model, b)
        t0 = time.perf_counter()
        for _ in range(3):  # compile, record, first replay
            step(**inp)
        torch.cuda.synchronize()
        capture_s[f"{name}/compile/batch{b}"] = round(time.perf_counter() - t0, 2)
        rows.append(dict(model=name, resolution=256, batch=b, backend="compile",
                         ms=cuda_ms(lambda: step(**inp), iters_for(b, 256))))


def _jsonable(stats: dict) -> dict:
    return json.loads(json.dumps(stats, default=str))


def markdown(result: dict) -> str:
    rows = [r for r in result["rows"] if r["batch"] > 0]
    backends = [b for b in ("diffusers", "eager", "full", "breakable", "compile") if any(r["backend"] == b for r in rows)]
    lines = [f"# Step latency (ms, median) on {result['gpu']}, torch {result['torch']}, diffusers {result['diffusers']}",
             "", "| model | batch | " + " | ".join(backends) + " | diffusers / full | breakable / full |",
             "|---|---|" + "---|" * (len(backends) + 2)]
    for (model, batch) in sorted({(r["model"], r["batch"]) for r in rows}):
        ms = {r["backend"]: r["ms"] for r in rows if r["model"] == model and r["batch"] == batch}
        cells = [f"{ms[b]:.2f}" if b in ms else "" for b in backends]
        ratio = lambda a, b: f"{ms[a] / ms[b]:.2f}x" if a in ms and b in ms else ""
        lines.append(f"| {model} | {batch} | " + " | ".join(cells) + f" | {ratio('diffusers', 'full')} | "
                     f"{ratio('breakable', 'full')} |")
    lines += ["", "Capture / compile time (s): " + ", ".join(f"{k} {v}" for k, v in result["capture_s"].items()),
              "", "Memory (MiB): " + ", ".join(f"{k} {v}" for k, v in result["memory_mb"].items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    import diffusers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--resolutions", type=int, nargs="+", default=[256, 512])
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows, capture_s, memory = [], {}, {}
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "diffusers": diffusers.__version__,
              "rows": rows, "capture_s": capture_s, "memory_mb": memory}
    args.out.mkdir(parents=True, exist_ok=True)
    for res in args.resolutions:
        bench_resolution(res, rows, capture_s, memory)
        (args.out / "step_latency.json").write_text(json.dumps(result, indent=1) + "\n")  # partial results survive
        md = markdown(result)
        (args.out / "step_latency.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
