"""The families' GPU tests' per-bucket check of a whole step: a GraphRunner over the family's step replays, at each
bucket alone, what an eager runner computes on the same inputs; and a full-size built-in with random weights, loaded
for one check and freed after it (one full-size model resident at a time).

Full-size tolerances (bf16), relative to the largest eager value: 1e-3 on ``x_next`` (the sampler's float32 update
of the bf16 prediction), 1e-2 on ``hist_next`` (the denoised estimate x - sigma v, where one bf16 rounding of the
prediction's largest values shows at sigma ~ 0.9). At one shape a replay runs the kernels eager runs, so both are
bit-identical in practice."""

from __future__ import annotations

import gc
from typing import Callable

import torch

PROMPTS = ("a red cat", "the big blue house", "a dog", "small green tree drawn", "a photo of a cat")
BF16_TOLERANCES = {"x_next": 1e-3, "hist_next": 1e-2}


def live_inputs(model, family, plan, b: int, shape, prompts=PROMPTS) -> dict[str, torch.Tensor]:
    """The step's inputs for b rows at step 1 of ``plan``: b of ``prompts`` (negative prompts too under CFG), guidance
    scales 1 to 4 (so a CFG batch holds rows with and without guidance)."""
    from samplers import gather_rows
    from workers.request.spec import ItemSpec

    n = len(prompts)
    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=plan.num_steps, guidance=1.0 + i % 4,
                      prompt=prompts[i % n], negative_prompt=prompts[(i + 2) % n] if i % 2 else "") for i in range(b)]
    enc, dev = family.encode(model, specs), model.device
    t, coeffs = gather_rows([plan] * b, [1] * b)
    gen = torch.Generator(dev).manual_seed(b)
    x = torch.randn(b, *shape, device=dev, generator=gen)
    return dict(x=x, t=t.to(dev), coeffs=coeffs.to(dev), guidance=torch.tensor([s.guidance for s in specs]).to(dev),
                hist=torch.randn(x.shape, device=dev, generator=gen), noise=torch.zeros_like(x),
                **{k: torch.stack([c[k] for c in enc]).to(dev) for k in enc[0]})


def runner_outputs(model, buckets=(1, 2, 4), steps: int = 4, backend: str = "full", prompts=PROMPTS,
                   live: Callable[[int], dict] | None = None) -> tuple[dict, dict]:
    """{(backend, b, output): CPU tensor} for an eager and a ``backend`` GraphRunner over the family's step at the
    model's native shape, each bucket run alone (greedy plans: b rows in bucket b), and the graph runner's stats.
    ``live(b)``: the step's inputs for b rows (default ``live_inputs`` at step 1 of a flow Euler plan of ``steps``)."""
    from graphs import GraphRunner
    from samplers import make_plan
    from workers.engine import step_specs
    from workers.families import family_of

    family, shape = family_of(model), tuple(model.latent_shape)
    if live is None:
        plan = make_plan("flow_euler", steps, model.schedule, **family.plan_kwargs(model, shape))
        live = lambda b: live_inputs(model, family, plan, b, shape, prompts)  # noqa: E731
    live = {b: live(b) for b in buckets}
    outs, stats = {}, {}
    for kind in ("eager", backend):
        inputs, outputs = step_specs(model, shape)
        runner = GraphRunner(family.make_step(model, shape), inputs, outputs, max_batch=max(buckets),
                             backend=kind, device=model.device)
        runner.warmup(example=live[max(buckets)])
        runner.replay_ms = {}
        for b in buckets:
            assert runner.plan(b) == (b,)
            out = runner.run(**live[b])
            outs.update({(kind, b, k): v.float().cpu() for k, v in out.items()})
        stats = runner.stats()
        del runner
    return outs, stats


def assert_replays_equal_eager(outs: dict, stats: dict, buckets=(1, 2, 4), backend: str = "full",
                               tolerances: dict[str, float] | None = None) -> None:
    """Each bucket captured once and replayed once with no eager fallback, and each output within its tolerance
    (relative to the largest eager value; 1e-5 on every output by default, float32) of eager's."""
    tolerances = tolerances or {"x_next": 1e-5, "hist_next": 1e-5}
    assert stats["backend"] == backend and stats["totals"]["captures"] == len(buckets), stats["totals"]
    assert stats["totals"]["eager_fallbacks"] == 0 and stats["totals"]["replays"] == len(buckets), stats["totals"]
    for b in buckets:
        for key, tol in tolerances.items():
            want, got = outs["eager", b, key], outs[backend, b, key]
            assert torch.isfinite(got).all(), (b, key)
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= tol, (b, key, err)


def on_full_size(name: str, check: Callable):
    """``check(model)`` on the built-in ``name`` with random weights, bf16 on CUDA; the model freed after it, before
    the next test loads its own (AssertionError if a GiB or more stays allocated). Returns what ``check`` returns,
    which must not hold the model."""
    from workers.loading import load_model

    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = load_model(name, device="cuda", dtype=torch.bfloat16)
    try:
        out = check(model)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - before < 2**30, f"{name} was not freed"
    return out
