"""The per-row LoRA kernels (``workers.kernels.lora``) against the gathered batched products
(``workers.lora.linear.lora_delta``): rows with one, several or no adapters, token and plain (N, in) inputs, ranks
below the kernel's block, CFG's repeated rows.

On a CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess: the flag is read when the
kernels are defined), where Triton is installed; on CUDA in bf16 and float32, inside a CUDA graph and a compiled
function too (``pytest -m gpu``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
CASES = [  # rows, tokens (0: an (N, in) input), in, out, slots, rank, places
    (3, 70, 40, 50, 4, 5, 2), (4, 0, 32, 96, 3, 16, 4), (2, 5, 130, 20, 2, 64, 1), (6, 9, 64, 64, 2, 8, 2)]


def _inputs(case, device="cpu", dtype=torch.float32, seed=0):
    n, t, fin, fout, s, r, p = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *((t,) if t else ()), fin, generator=g)
    a, b = torch.randn(s + 1, r, fin, generator=g) / fin ** 0.5, torch.randn(s + 1, fout, r, generator=g)
    a[0], b[0] = 0, 0
    slots = torch.randint(0, s + 1, (n, p), generator=g)
    slots[0] = 0  # a row without adapters
    scales = torch.randn(n, p, generator=g)
    return [v.to(device, dtype) if v.is_floating_point() else v.to(device) for v in (x, a, b, slots, scales)]


INTERPRETED = """
import torch
from workers.kernels.lora import available, lora_add_, lora_rows
from workers.lora.linear import lora_delta
from tests.workers.kernels.test_lora_kernel import CASES, _inputs, _live
for case in CASES:
    x, a, b, slots, scales = _inputs(case)
    assert available(x)
    live = _live(a)
    got, want = lora_rows(x, a, b, live, slots, scales), lora_delta(x, a, b, slots, scales)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, (case, err)
    assert got[0].abs().max() == 0  # the row without adapters
    # added in place, into a part's columns of a wider product: the other columns and the empty row untouched
    fused = torch.randn(*want.shape[:-1], want.shape[-1] + 9)
    before = fused.clone()
    lora_add_(x, a, b, live, slots, scales, fused[..., 4:4 + want.shape[-1]])
    torch.testing.assert_close(fused[..., 4:4 + want.shape[-1]], before[..., 4:4 + want.shape[-1]] + want,
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(fused[..., :4], before[..., :4]) and torch.equal(fused[..., 4 + want.shape[-1]:],
                                                                          before[..., 4 + want.shape[-1]:])
    assert torch.equal(fused[0], before[0])
    # a slot not live for this linear is skipped, as if its weights were zero
    off = _live(a)
    off[1] = 0
    a0, b0 = a.clone(), b.clone()
    a0[1], b0[1] = 0, 0
    torch.testing.assert_close(lora_rows(x, a, b, off, slots, scales), lora_delta(x, a0, b0, slots, scales),
                               rtol=1e-5, atol=1e-4)
x, a, b, slots, scales = _inputs(CASES[0])
live, want = _live(a), lora_delta(x, a, b, slots, scales)


def step(x, y):  # a compiled region adding the term into a part's columns of a product it made
    y = y * 1
    lora_add_(x, a, b, live, slots, scales, y[..., 3:3 + want.shape[-1]])
    return y


y = torch.randn(*want.shape[:-1], want.shape[-1] + 5)
got = torch.compile(step, fullgraph=True)(x, y)
torch.testing.assert_close(got[..., 3:3 + want.shape[-1]], y[..., 3:3 + want.shape[-1]] + want, rtol=1e-5, atol=1e-4)
assert torch.equal(got[..., :3], y[..., :3]) and torch.equal(got[..., 3 + want.shape[-1]:], y[..., 3 + want.shape[-1]:])
cfg = torch.cat([x, 2 * x])  # CFG's two copies of the rows: each copy gets its row's adapters
got = lora_delta(cfg, a, b, slots, scales, kernel="triton")
torch.testing.assert_close(got, lora_delta(cfg, a, b, slots, scales), rtol=1e-5, atol=1e-4)
print("ok")
"""


# Triton's interpreter hands a kernel's int arguments to range() as one-element NumPy arrays, which NumPy 2.4 no
# longer converts to ints (Triton 3.6 with NumPy 2.4 on a CPU): every kernel with a runtime loop bound fails there
INTERPRETER_BROKEN = "only 0-dimensional arrays can be converted to Python scalars"


def _interpret(code: str) -> None:
    """Run ``code`` (ends by printing "ok") under Triton's interpreter in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode and INTERPRETER_BROKEN in r.stderr:
        pytest.skip("Triton's interpreter cannot run these kernels' loops with this NumPy (its ints reach range() "
                    "as one-element arrays, which NumPy 2.4 refuses); they run on CUDA (pytest -m gpu)")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def _live(a: torch.Tensor) -> torch.Tensor:
    """Every slot of the bank ``a`` live but the empty slot 0."""
    live = torch.ones(a.shape[0], dtype=torch.int32, device=a.device)
    live[0] = 0
    return live


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter on a CPU)")
def test_the_kernels_compute_the_gathered_products_term_under_the_interpreter():
    _interpret(INTERPRETED)


def test_elsewhere_the_gathered_products_run():
    from workers.kernels.lora import available
    from workers.lora.linear import lora_delta

    x, a, b, slots, scales = _inputs(CASES[0])
    if available(x):
        pytest.skip("the kernels run here")
    torch.testing.assert_close(lora_delta(x, a, b, slots, scales, kernel="triton"), lora_delta(x, a, b, slots, scales))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES)
def test_the_kernels_on_cuda_in_a_graph_and_compiled(case, dtype, tol):
    from workers.kernels.lora import available, lora_add_, lora_rows
    from workers.lora.linear import lora_delta

    x, a, b, slots, scales = _inputs(case, "cuda", dtype)
    live = _live(a)
    assert available(x)
    want = lora_delta(*(v.float() if v.is_floating_point() else v for v in (x, a, b, slots, scales)))
    rel = lambda got: float((got.float() - want).abs().max() / want.abs().max())
    assert rel(lora_rows(x, a, b, live, slots, scales)) < tol
    graph, out = torch.cuda.CUDAGraph(), None
    lora_rows(x, a, b, live, slots, scales)  # compiled once before capture
    with torch.cuda.graph(graph):
        out = lora_rows(x, a, b, live, slots, scales)
    slots.copy_(slots.flip(0))  # new rows' slots, read by the replay on the GPU
    want = lora_delta(*(v.float() if v.is_floating_point() else v for v in (x, a, b, slots, scales)))
    graph.replay()
    assert rel(out) < tol
    compiled = torch.compile(lambda *v: lora_rows(*v) * 2, dynamic=True, fullgraph=True)
    assert float((compiled(x, a, b, live, slots, scales).float() / 2 - want).abs().max() / want.abs().max()) < tol
    # added in place into a part's columns of one product, called, in a graph and compiled
    width, bf16 = want.shape[-1], 2e-2 if dtype == torch.bfloat16 else 0  # the sum rounded once more in bf16
    fused = torch.randn(*want.shape[:-1], width + 8, device="cuda").to(dtype)
    before = fused.clone()
    lora_add_(x, a, b, live, slots, scales, fused[..., 8:])
    assert rel(fused[..., 8:].float() - before[..., 8:].float()) < tol + bf16
    empty = slots.eq(0).all(1)  # rows without adapters: untouched
    assert torch.equal(fused[..., :8], before[..., :8]) and torch.equal(fused[empty], before[empty])
    y, graph = before.clone(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_add_(x, a, b, live, slots, scales, y[..., 8:])
    graph.replay()
    assert torch.equal(y, fused)

    def step(x, y):
        y = y * 1
        lora_add_(x, a, b, live, slots, scales, y[..., 8:])
        return y

    got = torch.compile(step, dynamic=True, fullgraph=True)(x, before)
    assert rel(got[..., 8:].float() - before[..., 8:].float()) < tol + bf16
    assert torch.equal(got[..., :8], before[..., :8])


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_every_blocking_the_benchmark_times_adds_the_same_term(case):
    """``add_rows_`` at each of ``bench/kernel_times.py``'s candidate blockings equals the default's sum."""
    sys.path.insert(0, str(ROOT / "bench"))
    from kernel_times import LORA_TILES
    from workers.kernels.lora import Tiles, add_rows_, lora_rows

    x, a, b, slots, scales = _inputs(case, "cuda", torch.float32)
    x = x if x.dim() == 3 else x[:, None]
    live, base = _live(a), torch.randn(*x.shape[:-1], b.shape[1], device="cuda")
    want = base + lora_rows(x, a, b, live, slots, scales)
    for tiles in (Tiles(*c) for c in LORA_TILES):
        got = base.clone()
        add_rows_(x, a, b, live, slots, scales, got, tiles)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=lambda m, tiles=tiles: f"{tiles}: {m}")


ENGINE = """
import tempfile
from pathlib import Path
from workers.config import WorkerConfig
from workers.engine import Engine
from workers.loading import load_model
from tests.workers.lora.test_engine_lora import _make, adapter_file, req
for family in ("flux", "sd3"):
    model_dir, out = _make(family, Path(tempfile.mkdtemp())), {}
    for kernel in ("bmm", "triton"):
        engine = Engine(load_model(model_dir), WorkerConfig(backend="graphs", max_batch=4, lora_slots=2,
                        lora_max_rank=4, lora_per_request=2, lora_kernel=kernel))
        tr = engine.models[next(iter(engine.models))].transformer
        engine.add_lora("a", adapter_file(tr, 4, every=1, skip=())[0])
        engine.add_lora("b", adapter_file(tr, 5, every=2, skip=())[0])
        out[kernel] = engine.generate([req(0, [("a", 0.9)]), req(1), req(2, [("a", 0.5), ("b", -1.0)])])
    for got, want in zip(out["triton"], out["bmm"]):
        assert float((got.latents - want.latents).abs().max() / want.latents.abs().max()) < 1e-5, family
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter on a CPU)")
def test_an_engine_with_the_triton_kernel_makes_what_the_gathered_products_make():
    """``lora_kernel = "triton"`` through the engine (tiny FLUX.1 and SD3, the graph backends' rewrites: hoisted
    modulation, the embedding's adapters in the tables) against ``"bmm"``."""
    _interpret(ENGINE)
