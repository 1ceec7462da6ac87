"""FP8 linears on a GPU that has them (compute capability 8.9+): captured steps equal eager per bucket,
a step stays close to bf16, and the shipped text model's oracle holds through FP8.

Tolerances: replay against eager at the same shape runs the same kernels (at most 1e-3 relative, as the
bf16 graphs); FP8 against bf16 on the same inputs, DiT-XL/2 with random weights: x_next within 5%
(relative norm of the difference), the quantization error of e4m3 with per-row scales."""

import pytest
import torch

from .test_fp8 import text_oracle
from .test_graphs_on_models_gpu import _inputs, _rel, _runner

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _fp8_gpu():
    from workers.fp8 import unsupported_reason

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if (why := unsupported_reason("cuda")) is not None:
        pytest.skip(why)


def _dit(precision: str):
    from workers.loading import load_model
    from workers.patches import break_attention

    model = load_model("dit-xl-2-256", device="cuda", dtype=torch.bfloat16, precision=precision)
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
    from workers.engine import Engine, EngineConfig
    from workers.loading import load_model

    acc = text_oracle("cuda", "breakable", compile_mode="inductor")
    print(f"digits-text oracle through compiled graphs: {acc}")
    assert acc["bf16"] >= 0.9 and acc["fp8"] >= acc["bf16"] - 0.02, acc
    engine = Engine(load_model("digits-text", device="cuda", dtype=torch.float32, precision="fp8"),
                    EngineConfig(backend="breakable", max_batch=64, compile="inductor"))
    engine.warmup()
    (group,) = engine.stats()["groups"].values()
    assert group["compile"]["compiled"] and group["compile"]["graphs"] == 1  # every bucket from one compile


@pytest.mark.parametrize("k", [1152, 4608, 15360])
@pytest.mark.parametrize("gelu", ["none", "tanh", "erf"])
def test_the_row_kernel_quantizes_as_the_pytorch_reference_does(k, gelu, monkeypatch):
    """workers.quant_kernel against the PyTorch path in float32 on the same bf16 rows (a zero row among
    them): the same scales, and codes that differ only where the two GELU formulas round a value across a
    code boundary (at most one code step, on at most 0.1% of the values)."""
    from workers import fp8

    torch.manual_seed(k)
    x = (torch.randn(333, k, device="cuda") * torch.logspace(-2, 2, 333, device="cuda")[:, None]).bfloat16()
    x[7] = 0
    q, scale = fp8.quantize_rows(x, gelu)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (333, k) and scale.shape == (333, 1)
    with monkeypatch.context() as m:
        m.setattr(fp8, "ROW_KERNEL", False)
        rq, rscale = fp8.quantize_rows(x.float(), gelu)
    torch.testing.assert_close(scale, rscale, rtol=1e-5, atol=0)
    got, want = q.float(), rq.float()
    assert torch.equal(got[7], torch.zeros(k, device="cuda"))
    differ = got != want
    assert differ.float().mean().item() <= 1e-3
    step = (want.abs().clamp(min=2 ** -6).log2().floor() - 3).exp2()  # e4m3's spacing at each value
    assert ((got - want).abs() <= step * 1.0001 + 2 ** -9)[differ].all()


def test_the_row_kernel_compiles_once_for_a_dynamic_batch_and_captures_into_a_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    from workers import fp8

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
