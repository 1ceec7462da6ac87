"""Inductor's kernels captured into our graphs on a GPU (skipped without CUDA by tests/conftest.py).

A compiled step is captured like any step: the breakable backend still cuts one segment per break
(a row norm standing in for attention: 2 segments, 1 break; the digits model: one break per layer),
the full backend one segment, every bucket from one compile. Results against the uncompiled step:
float32, Inductor's fused elementwise kernels against eager's (matrix products are cuBLAS in both),
so rounding only: 1e-4 absolute on the tiny step; 1e-3 relative on digits' final latents after 6
steps, where rounding compounds through the sampler.
"""

import pytest
import torch
import torch.nn.functional as F

from workers.config import WorkerConfig
from workers.speed import SpeedConfig
from graphs import GraphRunner, TensorSpec, eager_on_graph
from graphs.compiled import CompiledStep, opaque_break

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

DEV = "cuda"
INPUTS = {"x": TensorSpec((16,), torch.float32), "t": TensorSpec((), torch.float32)}
OUTPUTS = {"y": TensorSpec((16,), torch.float32), "m": TensorSpec((), torch.float32)}


@eager_on_graph
def rownorm_into(h, out):
    out.copy_(h / (h.norm(dim=-1, keepdim=True) + 1.0))


def make_step(seed=0):
    """A row-wise step: gelu MLP around one break."""
    g = torch.Generator().manual_seed(seed)
    w1, b1, w2 = (torch.randn(16, 32, generator=g) / 4).to(DEV), torch.randn(32, generator=g).to(DEV), \
        (torch.randn(32, 16, generator=g) / 6).to(DEV)

    def step(x, t):
        h = F.gelu(x @ w1 + b1 + t[:, None])  # (b, 32)
        out = torch.empty_like(h)
        rownorm_into(h, out)                  # (b, 32): a break in `breakable`, captured inline in `full`
        return {"y": x + out @ w2, "m": out.mean(dim=-1)}

    return step


def make_live(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 16, generator=g).to(DEV), "t": torch.randn(n, generator=g).to(DEV)}


@pytest.mark.parametrize("backend, segments", [("breakable", 2), ("full", 1)])
def test_one_compile_is_captured_into_every_bucket(backend, segments):
    opaque_break(rownorm_into)
    plain = make_step()
    step = CompiledStep(plain, "mlp")
    runner = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend=backend, device=DEV)
    runner.warmup()  # compiles at the first warm-up call of bucket 8, then captures 8, 4, 2, 1
    assert step.compiled and step.graphs == 1
    for b, s in runner.stats()["buckets"].items():
        assert (s["captures"], s["capture_failures"]) == (1, 0), b
        assert (s["segments"], s["breaks"]) == (segments, segments - 1), b
    for n in range(1, 10):
        live = make_live(n, seed=n)
        got, want = runner.run(**live), plain(**live)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    totals = runner.stats()["totals"]
    assert totals["eager_fallbacks"] == 0 and totals["replays"] >= 9
    assert step.graphs == 1  # captures and replays compiled nothing more


@pytest.fixture(scope="module")
def digits_cuda():
    from workers.loading import load_model

    return load_model("digits", device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_compiled_digits_engine_on_graphs_matches_uncompiled(digits_cuda, backend):
    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    compiled = Engine(digits_cuda, WorkerConfig(backend=backend, max_batch=16), speed=SpeedConfig(compile="inductor"))
    compiled.warmup()
    plain = Engine(digits_cuda, WorkerConfig(backend=backend, max_batch=16))
    plain.warmup()
    reqs = [ItemSpec(id=f"r{i}", label=i % 10, seed=100 + i, sampler="ddim", steps=6, guidance=2.0) for i in range(13)]
    for a, b in zip(compiled.generate(reqs), plain.generate(reqs)):
        assert (a.latents - b.latents).abs().max().item() <= 1e-3 * max(1.0, b.latents.abs().max().item())
    stats = next(iter(compiled.stats()["groups"].values()))
    want = {b: s["segments"] for b, s in next(iter(plain.stats()["groups"].values()))["buckets"].items()}
    layers = len(digits_cuda.transformer.transformer_blocks)
    assert want == {b: layers + 1 if backend == "breakable" else 1 for b in want}
    assert {b: s["segments"] for b, s in stats["buckets"].items()} == want  # the same cuts, compiled
    assert stats["totals"]["capture_failures"] == stats["totals"]["eager_fallbacks"] == 0
    assert stats["compile"]["compiled"] and stats["compile"]["graphs"] == 1


def test_aliased_break_args_on_graphs_match_uncompiled(digits_cuda):
    """Aliased break arguments on a real breakable capture: 13 digits through every bucket equal the
    uncompiled engine's (so no aliased break read memory that a later segment or capture had reused)."""
    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    compiled = Engine(digits_cuda, WorkerConfig(backend="breakable", max_batch=16), speed=SpeedConfig(compile="inductor"))
    compiled.warmup()
    plain = Engine(digits_cuda, WorkerConfig(backend="breakable", max_batch=16))
    plain.warmup()
    reqs = [ItemSpec(id=f"r{i}", label=i % 10, seed=300 + i, sampler="ddim", steps=6, guidance=2.0) for i in range(13)]
    for a, b in zip(compiled.generate(reqs), plain.generate(reqs)):
        assert (a.latents - b.latents).abs().max().item() <= 1e-3 * max(1.0, b.latents.abs().max().item())
