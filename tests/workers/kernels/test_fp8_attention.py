"""FP8 attention's bookkeeping (workers/fp8_attention.py, workers/joint_attention.py), on a CPU through the
kernel's PyTorch reference (``reference_codes``): the per-tensor codes and their power-of-two scales, the
head padded to a multiple of 16, the fixed q and k scales from the RMS norms' bound, and SD3's and FLUX.1's
routed processors in FP8 against their float32 attention. cuDNN's kernel against the reference, and in CUDA
graphs, is tests/workers/test_fp8_attention_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

from workers.config import WorkerConfig

from workers.kernels import fp8_attention as fa
from workers.families.flux.attention import RoutedFluxAttention
from workers.speed.apply import to_precision
from workers.speed.joint_attention import static_scale
from workers.speed.routing import route_joint_attention

from tests.workers.speed.test_joint_attention import _flux_inputs, _run, _sd3_inputs
from tests.workers.speed.test_joint_attention import _tiny_flux as _flux_of
from tests.workers.speed.test_joint_attention import _tiny_sd3 as _sd3_of


def _tiny_flux(head=16):  # heads of 16: the FP8 kernel's multiple
    return _flux_of(head)


def _tiny_sd3(qk_norm="rms_norm"):
    return _sd3_of(16, qk_norm)


def _rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def test_padded_head_rounds_up_to_16():
    assert [fa.padded_head(d) for d in (64, 72, 80, 128, 129)] == [64, 80, 80, 128, 144]


def test_quantize_scales_by_a_power_of_two_within_448_and_pads_with_zeros():
    x = torch.randn(2, 7, 3, 72) * 5.0
    codes, descale = fa.quantize(x, 80)
    scale = 1.0 / descale.item()
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (2, 7, 3, 80)
    assert math.log2(scale) == int(math.log2(scale))                # a power of two: exact to undo
    assert x.abs().max() * scale <= 448 < 2 * x.abs().max() * scale  # the largest that keeps x within 448
    assert (codes[..., 72:].float() == 0).all()
    back = codes[..., :72].float() * descale.reshape(())
    assert _rel_rms(back, x) < 0.04  # e4m3's 3 mantissa bits: rms rounding error about 2-3% of a value


def test_fp8_attention_is_attention_within_fp8_error_and_keeps_the_real_head():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 72, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = fa.attention(q, k, v)
    assert out.shape == ref.shape
    err = _rel_rms(out, ref)
    assert 0.005 < err < 0.09  # e4m3 codes of q, k, v, P and the output: about 6% rms; not exact (it is FP8)
    buf = torch.empty_like(q)
    assert fa.attention(q, k, v, out=buf) is buf and torch.equal(buf, out)


def test_the_output_codes_keep_headroom_below_448():
    q = torch.zeros(1, 1, 4, 16)  # equal scores: the output is v's column means; v's largest row is 448
    v = torch.zeros(1, 1, 4, 16)
    v[..., 0] = torch.tensor([448.0, 448.0, 448.0, 448.0])
    (q8, dq), (v8, dv) = fa.quantize(q + 1e-3), fa.quantize(v)
    out = torch.empty_like(q8)
    descale_o = fa.attention_codes(q8, q8, v8, dq, dq, dv, out, 0.25)
    assert out[..., 0].float().max() <= 448 / 2 + 1e-6  # at half v's scale
    assert torch.allclose(out.float()[..., 0] * descale_o.reshape(()), torch.full((1, 1, 4), 448.0))


def _rms_norm(n, weight):
    norm = torch.nn.RMSNorm(n, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def test_static_scale_bounds_normed_and_rotated_values_and_is_the_largest_power_of_two():
    w = torch.linspace(-3.0, 2.0, 16)
    scale = static_scale(_rms_norm(16, w))
    bound = math.sqrt(16) * 3.0  # a one-hot row puts all of its norm in one value: sqrt(n) x the largest weight
    assert scale * bound <= 448 < 2 * scale * bound
    norm = _rms_norm(16, w)
    worst = torch.zeros(1, 16)
    worst[0, 0] = 7.0  # the value under the largest weight
    assert (norm(worst).abs().max() * scale).item() <= 448
    x = norm(torch.randn(1000, 16))  # and a rotation of pairs (cos, sin) keeps each pair's length
    angle = torch.rand(1000, 8)
    a, b = x[:, 0::2], x[:, 1::2]
    rotated = torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)
    assert (rotated.abs().max() * scale).item() <= 448
    assert static_scale(_rms_norm(16, w), _rms_norm(16, 2 * w)) == scale / 2  # the joint q: both norms' bound
    assert static_scale(None) is None and static_scale(torch.nn.LayerNorm(16)) is None


@pytest.mark.parametrize("make, inputs, calls", [(_tiny_flux, _flux_inputs, 3), (_tiny_sd3, _sd3_inputs, 2)])
def test_routed_processors_in_fp8_match_their_float_attention_within_fp8_error(make, inputs, calls, monkeypatch):
    model, x = make(), inputs()
    ref = _run(model, x)
    seen = []
    real = fa.attention_codes
    monkeypatch.setattr(fa, "attention_codes", lambda *a: seen.append(a[0].shape) or real(*a))
    assert route_joint_attention(model, fp8=True) == calls
    out = _run(model, x)
    assert len(seen) == calls  # every attention through the FP8 kernel's contract
    err = _rel_rms(out, ref)
    assert 1e-4 < err < 0.05, err  # FP8 attention only (the linears stay float32 here)
    route_joint_attention(model)  # made again without FP8: float attention, as diffusers' computes
    torch.testing.assert_close(_run(model, x), ref, rtol=1e-5, atol=1e-5)


def test_flux_q_and_k_take_fixed_scales_and_v_its_own():
    model = _tiny_flux()
    route_joint_attention(model, fp8=True)
    processors = [m.processor for m in model.modules() if isinstance(getattr(m, "processor", None), RoutedFluxAttention)]
    assert len(processors) == 3
    for p in processors:  # FLUX.1's q and k are RMS-normed: fixed, exact powers of two; descales on the device
        assert p.fp8.q is not None and p.fp8.k is not None
        assert p.fp8.descale_q.item() == 1.0 / p.fp8.q and p.fp8.descale_q.shape == (1, 1, 1, 1)


def test_sd3_without_q_and_k_norms_scales_them_from_their_largest_magnitude():
    model, x = _tiny_sd3(qk_norm=None), _sd3_inputs()  # SD3 (not 3.5): no bound, so no fixed scale
    ref = _run(model, x)
    route_joint_attention(model, fp8=True)
    processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
    assert processors and all(p.fp8.q is None and p.fp8.k is None for p in processors)
    assert 1e-4 < _rel_rms(_run(model, x), ref) < 0.05


def test_heads_the_kernel_cannot_run_keep_their_attention():
    model = _tiny_flux(head=8)  # 8 is not a multiple of 16
    assert route_joint_attention(model, fp8=True) == 3
    assert all(m.processor.fp8 is None for m in model.modules() if isinstance(getattr(m, "processor", None),
                                                                              RoutedFluxAttention))


def test_the_precision_is_refused_where_the_kernel_cannot_run_and_the_config_knows_it():
    from typing import get_args

    from dit_serve.server.config import WorkerConfig
    from workers.loading import PRECISIONS, ModelError, load_model

    with pytest.raises(ModelError, match=r"cannot run digits in fp8\+attention: FP8 attention runs on CUDA GPUs only"):
        to_precision(load_model("digits", precision="fp8+attention"))
    allowed = get_args(get_args(WorkerConfig.model_fields["precision"].annotation)[1])
    assert allowed == PRECISIONS  # the API's config validates without torch; one list


def test_the_engine_routes_fp8_attention_for_a_model_in_fp8_plus_attention(tmp_path, monkeypatch):
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux
    from workers.request.spec import ItemSpec

    model = to_precision(load_model(str(make_tiny_flux(tmp_path / "flux", head_dim=16)), precision="fp8"))
    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=2, guidance=3.5, prompt="a red cat")
             for i in range(2)]
    want = Engine(model, WorkerConfig(backend="breakable", max_batch=2)).generate(specs)
    model.precision = "fp8+attention"
    engine = Engine(model, WorkerConfig(backend="breakable", max_batch=2))
    assert engine.attention[model.name] == "fp8 (cuDNN)"
    processors = [m.processor for m in model.transformer.modules() if hasattr(m, "processor")]
    assert processors and all(p.fp8 is not None for p in processors)
    calls = []
    real = fa.attention_codes
    monkeypatch.setattr(fa, "attention_codes", lambda *a: calls.append(1) or real(*a))
    got = engine.generate(specs)
    assert calls  # through the FP8 kernel's contract
    for g, w in zip(got, want):
        err = ((g.latents - w.latents).norm() / w.latents.norm()).item()
        assert 0 < err < 0.05, err
    model.precision = "fp8"  # and back: an engine made now routes the attention in the model's dtype
    Engine(model, WorkerConfig(backend="breakable", max_batch=2))
    assert all(m.processor.fp8 is None for m in model.transformer.modules() if hasattr(m, "processor"))


def test_fp8_output_projections_take_the_attentions_codes_as_they_are(monkeypatch):
    """FLUX.1 in FP8 linears and FP8 attention: the double blocks' ``to_out`` and ``to_add_out`` multiply the
    attention's e4m3 codes at its one descale (``project_codes``), the single blocks' output quantization
    reads them (``quantize_pair``'s ``a_scale``): no bf16 copy in between. The model stays within FP8's error of
    float32, and of the path that dequantizes and quantizes again (where the projections take no codes)."""
    from workers.families.flux import attention as flux_attention, fast as flux_fast
    from workers.speed.fp8 import quantize_linears

    ref_model, x = _tiny_flux(), _flux_inputs()
    ref = _run(ref_model, x)
    model = _tiny_flux()
    quantize_linears(model)
    flux_fast.fold_single_block_gelus(model)  # as the family's "precision" rewrite
    assert route_joint_attention(model, fp8=True) == 3
    projected, scaled = [], []
    real_project, real_pair = flux_attention.project_codes, flux_fast.quantize_pair
    monkeypatch.setattr(flux_attention, "project_codes", lambda p, c, d: projected.append(c.dtype) or real_project(p, c, d))
    monkeypatch.setattr(flux_fast, "quantize_pair", lambda a, b, g="tanh", s=None: scaled.append(
        (a.dtype, s is not None)) or real_pair(a, b, g, s))
    coded = _run(model, x)
    assert projected == [fa.FP8, fa.FP8]  # one double block: its image's and its text's projections
    assert scaled == [(fa.FP8, True)] * 2  # two single blocks
    monkeypatch.setattr(flux_attention, "takes_codes", lambda *projections: False)
    monkeypatch.setattr(RoutedFluxAttention, "attention_codes", lambda *a, **kw: None)
    projected.clear(), scaled.clear()
    requantized = _run(model, x)
    assert projected == [] and all(not s for _, s in scaled) and len(scaled) == 2
    assert 1e-4 < _rel_rms(coded, ref) < 0.02, _rel_rms(coded, ref)  # 0.4% here, as the requantized path's
    assert 0 < _rel_rms(coded, requantized) < 0.01, _rel_rms(coded, requantized)
