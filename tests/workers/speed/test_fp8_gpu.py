"""FP8 linears on a GPU that has them (compute capability 8.9+): captured steps equal eager per bucket,
a step stays close to bf16, and the shipped text model's oracle holds through FP8.

Tolerances: replay against eager at the same shape runs the same kernels (at most 1e-3 relative, as the
bf16 graphs); FP8 against bf16 on the same inputs, DiT-XL/2 with random weights: x_next within 5%
(relative norm of the difference), the quantization error of e4m3 with per-row scales."""

import pytest
import torch

from workers.config import WorkerConfig
from workers.speed.apply import to_precision
from workers.speed import SpeedConfig

from .test_fp8 import text_oracle
from tests.workers.test_graphs_on_models_gpu import _inputs, _rel, _runner

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _fp8_gpu():
    from workers.speed.fp8 import unsupported_reason

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if (why := unsupported_reason("cuda")) is not None:
        pytest.skip(why)


def _dit(precision: str):
    from workers.loading import load_model
    from workers.speed.patches import break_attention

    model = to_precision(load_model("dit-xl-2-256", device="cuda", dtype=torch.bfloat16, precision=precision))
    break_attention(model.transformer)
    return model


@pytest.fixture(scope="module")
def dit_fp8():
    return _dit("fp8")


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_fp8_dit_xl_every_bucket_replay_equals_eager(dit_fp8, backend):
    assert dit_fp8.fp8_linears == 28 * 6  # q, k, v, out, and the two feed-forward linears of each block
    graphs, eager = _runner(dit_fp8, backend), _runner(dit_fp8, "eager")
    graphs.warmup()
    for b in (1, 2, 4, 8, 16, 32, 64):
        inp = _inputs(dit_fp8, b, seed=b)
        got, want = graphs.run(**inp), eager.run(**inp)
        for name in ("x_next", "hist_next"):
            assert _rel(got[name], want[name]) <= 1e-3, (b, name)
    stats = graphs.stats()
    assert all(s["captures"] == 1 and s["eager_fallbacks"] == 0 for s in stats["buckets"].values())


def test_an_fp8_step_is_close_to_bf16(dit_fp8):
    bf16 = _dit("bf16")  # the built-in's init is seeded: the weights dit_fp8 was quantized from
    assert torch.equal(bf16.transformer.pos_embed.proj.weight, dit_fp8.transformer.pos_embed.proj.weight)
    fp, ref = _runner(dit_fp8, "eager"), _runner(bf16, "eager")
    for b in (2, 16):
        inp = _inputs(bf16, b, seed=100 + b)
        got, want = fp.run(**inp)["x_next"].float(), ref.run(**inp)["x_next"].float()
        rel = ((got - want).norm() / want.norm()).item()
        print(f"fp8 vs bf16 at {b} images: x_next relative error {rel:.4f}")
        assert rel < 0.05, rel


def test_the_text_oracle_through_fp8_graphs_is_within_two_points():
    acc = text_oracle("cuda", "breakable")
    print(f"digits-text oracle on the GPU (breakable graphs): {acc}")
    assert acc["bf16"] >= 0.9 and acc["fp8"] >= acc["bf16"] - 0.02, acc


def test_the_text_oracle_through_compiled_fp8_graphs_is_within_two_points():
    """The fused path (Inductor inside breakable graphs) with and without FP8: the oracle holds, and one
    compile serves every bucket (no recompiles)."""
    from workers.engine import Engine
    from workers.loading import load_model

    acc = text_oracle("cuda", "breakable", compile_mode="inductor")
    print(f"digits-text oracle through compiled graphs: {acc}")
    assert acc["bf16"] >= 0.9 and acc["fp8"] >= acc["bf16"] - 0.02, acc
    engine = Engine(to_precision(load_model("digits-text", device="cuda", dtype=torch.float32, precision="fp8")),
                    WorkerConfig(backend="breakable", max_batch=64), speed=SpeedConfig(compile="inductor"))
    engine.warmup()
    (group,) = engine.stats()["groups"].values()
    assert group["compile"]["compiled"] and group["compile"]["graphs"] == 1  # every bucket from one compile


@pytest.mark.parametrize("k", [1152, 4608, 15360])
def test_fast_accumulation_adds_little_to_the_products_fp8_error(k, monkeypatch):
    """cuBLASLt's fast accumulation (the FP8 products' ``use_fast_accum``) against float32 products of the same
    weights and rows: its error stays within a tenth more than the promoted accumulation's, which is FP8's
    own rounding of the rows and weights (the families' widths: 1152, FLUX's 15360 single-block input)."""
    from workers.speed import fp8

    torch.manual_seed(k)
    lin = torch.nn.Linear(k, 1024, device="cuda").bfloat16()
    x = torch.randn(4096, k, device="cuda").bfloat16()
    want = x.float() @ lin.weight.float().t() + lin.bias.float()
    layer, err = fp8.Fp8Linear(lin), {}
    real = torch._scaled_mm
    for fast in (False, True):
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(torch, "_scaled_mm", lambda *a, use_fast_accum=True, **kw: real(*a, use_fast_accum=fast, **kw))
            got = layer(x).float()
        err[fast] = ((got - want).norm() / want.norm()).item()
    print(f"K={k}: relative error promoted {err[False]:.4e}, fast {err[True]:.4e}")
    assert err[True] <= err[False] * 1.1 + 1e-4, err


def test_the_text_oracle_with_fast_accumulation_is_within_two_points():
    acc = text_oracle("cuda", "breakable")
    print(f"digits-text oracle, FP8 with fast accumulation: {acc}")
    assert acc["bf16"] >= 0.9 and acc["fp8"] >= acc["bf16"] - 0.02, acc


def _rows(k: int) -> torch.Tensor:
    """333 bf16 rows of K, seeded by K, their magnitudes spread over 1e-2 .. 1e2."""
    torch.manual_seed(k)
    return (torch.randn(333, k, device="cuda") * torch.logspace(-2, 2, 333, device="cuda")[:, None]).bfloat16()


@pytest.mark.parametrize("k", [1152, 4608, 15360])
@pytest.mark.parametrize("gelu", ["none", "tanh", "erf"])
def test_the_row_kernel_quantizes_as_the_pytorch_reference_does(k, gelu, monkeypatch):
    """workers.kernels.quant against the PyTorch path in float32 on the same bf16 rows (a zero row among
    them): the same scales, and codes that differ only where the two GELU formulas round a value across a
    code boundary (at most one code step, on at most 0.1% of the values). The exact tanh here; the fast
    one is the next test's."""
    from workers.kernels import quant as quant_kernel
    from workers.speed import fp8

    x = _rows(k)
    x[7] = 0
    q, scale = quant_kernel.launch(x, gelu, quant_kernel.split_plan(k, fast=False))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (333, k) and scale.shape == (333, 1)
    with monkeypatch.context() as m:
        m.setattr(quant_kernel, "available", lambda x: False)  # the PyTorch path
        rq, rscale = fp8.quantize_rows(x.float(), gelu)
    torch.testing.assert_close(scale, rscale, rtol=1e-5, atol=0)
    got, want = q.float(), rq.float()
    assert torch.equal(got[7], torch.zeros(k, device="cuda"))
    differ = got != want
    assert differ.float().mean().item() <= 1e-3
    step = (want.abs().clamp(min=2 ** -6).log2().floor() - 3).exp2()  # e4m3's spacing at each value
    assert ((got - want).abs() <= step * 1.0001 + 2 ** -9)[differ].all()


def _codes(q: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as ordered integers (sign and magnitude -> signed): a difference counts code steps."""
    c = q.view(torch.uint8).int()
    return torch.where(c >= 128, -(c - 128), c)


@pytest.mark.parametrize("k", [1152, 4608, 15360])
def test_the_fast_tanh_moves_few_codes_by_one_step(k):
    """The tanh GELU by tanh.approx.f32 (relative error about 2^-11) against the exact kernel: scales within
    0.2%, at most 2% of the codes differ, and those by one code step. And quantize_rows runs the plan
    measured for K."""
    from workers.kernels import quant as quant_kernel
    from workers.speed import fp8

    x = _rows(k)
    q, s = quant_kernel.launch(x, "tanh", quant_kernel.split_plan(k, fast=True))
    eq, es = quant_kernel.launch(x, "tanh", quant_kernel.split_plan(k, fast=False))
    torch.testing.assert_close(s, es, rtol=2e-3, atol=0)
    steps = (_codes(q) - _codes(eq)).abs()
    print(f"K={k}: {(steps > 0).float().mean().item():.3%} of codes differ")
    assert steps.max().item() <= 1 and (steps > 0).float().mean().item() <= 0.02
    dq, ds = fp8.quantize_rows(x, "tanh")
    pq, ps = quant_kernel.launch(x, "tanh", quant_kernel.plan_for(k))
    assert torch.equal(dq.view(torch.uint8), pq.view(torch.uint8)) and torch.equal(ds, ps)


@pytest.mark.parametrize("k", [1152, 4608, 15360])
@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_every_row_kernel_plan_gives_the_same_codes(k, gelu):
    """Whole rows one or several to a program (333 rows: the last program part empty), split rows and rows
    read in chunks (K not a multiple of every chunk) compute the same float32 arithmetic: bit-identical,
    among the exact plans and among the fast-tanh ones."""
    from workers.kernels import quant as quant_kernel
    from workers.kernels.quant import Plan

    x = _rows(k)
    x[5] = 0
    block, parts = quant_kernel._next_pow2(k), quant_kernel.split_parts(k)
    for fast in (False, True):
        want_q, want_s = quant_kernel.launch(x, gelu, quant_kernel.split_plan(k, fast=fast))
        for plan in (Plan("whole", block, 1, 8, fast=fast), Plan("whole", block, 4, 8, fast=fast),
                     Plan("split", parts[0], 1, 2, parts, fast), Plan("split", parts[0], 1, 16, parts, fast),
                     Plan("chunked", 512, 1, 4, fast=fast), Plan("chunked", 2048, 1, 8, fast=fast)):
            if plan.block * plan.rows > 2 ** 15:
                continue
            q, s = quant_kernel.launch(x, gelu, plan)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s), plan
    with pytest.raises(ValueError, match="cannot hold rows"):
        quant_kernel.launch(x, gelu, Plan("whole", block // 2, 1, 4))
    with pytest.raises(ValueError, match="cannot hold rows"):
        quant_kernel.launch(x, gelu, Plan("split", parts[0], 1, 4, parts[:1]))


def test_the_row_kernel_compiles_once_for_a_dynamic_batch_and_captures_into_a_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    from workers.speed import fp8

    def fn(x):
        q, s = fp8.quantize_rows(x, "tanh")
        return q.float() * s

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, dynamic=True, backend=counter)
    for m in (2, 6, 130):
        x = torch.randn(m, 1152, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), fn(x), rtol=0, atol=0)
    assert counter.frame_count == 1  # one graph for every batch
    x = torch.randn(64, 4608, device="cuda", dtype=torch.bfloat16)
    fn(x)  # the kernel compiled before capture
    out = torch.empty(64, 4608, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fn(x))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, fn(x), rtol=0, atol=0)


@pytest.mark.parametrize("ka,kb", [(3072, 12288), (1152, 4608), (80, 320)])
def test_the_pair_kernel_quantizes_the_concatenation_without_writing_it(ka, kb):
    """``quant_kernel.launch_pair(a, b, gelu)`` (FLUX.1's single blocks: attention beside the MLP) against the
    row kernel: without GELU, bit-identical to quantizing cat([a, b]) (rows where either part holds the peak,
    a zero row); with the tanh GELU and a below the activation's peak, b's codes and the scales are the row
    kernel's for gelu(b) bit for bit and a's are a over those scales; e4m3 codes for a at a descale give what
    their bf16 values give. Compiled, one graph for every batch."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from workers.kernels import quant as quant_kernel
    from workers.speed import fp8

    torch.manual_seed(ka + kb)
    a, b = _rows(ka + kb)[:, :ka].contiguous(), _rows(kb)
    a[::2] *= 100  # a holds the peak in half the rows
    a[3], b[3] = 0, 0
    q, s = quant_kernel.launch_pair(a, b, "none")
    wq, ws = quant_kernel.launch(torch.cat([a, b], dim=1), "none", quant_kernel.plan_for(ka + kb))
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)
    small = a * 1e-4
    q, s = quant_kernel.launch_pair(small, b, "tanh")
    bq, bs = quant_kernel.launch(b, "tanh", quant_kernel.split_plan(kb, fast=True))
    assert torch.equal(q[:, ka:].view(torch.uint8), bq.view(torch.uint8)) and torch.equal(s, bs)
    aq = (small.float() * (1.0 / s)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (_codes(q[:, :ka]) - _codes(aq)).abs().max().item() <= 1
    codes = (a.float() / 64).clamp(-448, 448).to(torch.float8_e4m3fn)  # e4m3 codes at a descale of 2^-3
    descale = torch.full((1, 1, 1, 1), 0.125, device="cuda")
    q, s = quant_kernel.launch_pair(codes, b, "tanh", descale)
    wq, ws = quant_kernel.launch_pair((codes.float() * 0.125).bfloat16(), b, "tanh")  # exact in bf16
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)

    def fn(a, b):
        q, s = fp8.quantize_pair(a, b, "tanh")
        return q.float() * s

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, dynamic=True, backend=counter)
    for m in (2, 6, 130):
        x, y = a[:m].contiguous(), b[:m].contiguous()
        torch.testing.assert_close(compiled(x, y), fn(x, y), rtol=0, atol=0)
    assert counter.frame_count == 1
