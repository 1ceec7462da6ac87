"""FP8 linears (workers/fp8.py) on the CPU: the arithmetic, which linears are taken, the devices that are
refused, and the shipped text model's oracle through FP8 against its own dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from workers.config import WorkerConfig
from workers.speed.apply import to_precision
from workers.loading import load_model
from workers.speed import SpeedConfig
from workers.speed import fp8
from workers.speed.fp8 import Fp8Linear, linear_into, quantize_linears, quantize_rows


def _linear(k: int, n: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def test_rows_quantize_within_e4m3s_relative_step_and_zero_rows_stay_zero():
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different magnitudes
    x[5] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1) and scale.dtype == torch.float32
    back = q.float() * scale
    assert torch.equal(back[5], torch.zeros(128))
    rel = (back - x).abs() / x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert rel.max() <= 2 ** -4  # e4m3: 3 mantissa bits, so half a step of 2**-3 at the row's largest value
    assert q.float().abs().amax(dim=1)[torch.arange(64) != 5].min() == fp8.FP8_MAX  # each row uses the full range


@pytest.mark.parametrize("bias", [True, False])
def test_an_fp8_linear_is_the_product_of_its_quantized_operands_and_close_to_the_original(bias):
    lin = _linear(256, 384, bias)
    x = torch.randn(3, 50, 256)
    got = Fp8Linear(lin)(x)
    assert got.shape == (3, 50, 384) and got.dtype == x.dtype
    xq, xs = quantize_rows(x.reshape(-1, 256))
    wq, ws = quantize_rows(lin.weight.detach())
    emulated = (xq.float() * xs) @ (wq.float() * ws).t() + (lin.bias.detach() if bias else 0.0)
    torch.testing.assert_close(got.reshape(-1, 384), emulated, rtol=1e-4, atol=1e-4)
    want = lin(x).detach()
    rel = (got - want).norm() / want.norm()
    assert rel < 0.05, f"relative error {rel:.4f}"


def test_quantizing_bf16_rows_never_widens_them_to_float32():
    """Every full-size intermediate of quantizing bf16 activations stays in 2 bytes per value or less (on a
    GPU each pass over them is memory-bound; a float32 copy doubles it), and the scales are float32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.seen.append((str(func), tuple(t.shape), t.dtype))
            return out

    x = torch.randn(64, 256).to(torch.bfloat16)
    with Outputs() as mode:
        q, scale = quantize_rows(x)
    full = [(f, d) for f, shape, d in mode.seen if shape == (64, 256)]
    assert full and all(d in (torch.bfloat16, fp8.FP8) for _, d in full), full
    assert q.dtype == fp8.FP8 and scale.dtype == torch.float32 and scale.shape == (64, 1)
    back = q.float() * scale
    assert ((back - x.float()).abs() <= x.float().abs().amax(1, keepdim=True) / 16 + 1e-6).all()


def test_float32_results_take_the_bias_after_the_product_and_others_in_its_epilogue(monkeypatch):
    """CUDA's scaled product refuses a bias with a float32 result (the float32 text model through FP8 on
    a GPU): there the bias is added after it, in both ``forward`` and ``mm_into``; bf16 keeps it fused."""
    lin = _linear(64, 32)
    layer, x = Fp8Linear(lin), torch.randn(6, 64)
    real, seen = torch._scaled_mm, []

    def scaled_mm(*args, bias=None, out_dtype=None, **kw):
        seen.append((out_dtype, bias is not None))
        if out_dtype == torch.float32 and bias is not None:
            raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
        return real(*args, bias=bias, out_dtype=out_dtype, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    with torch.no_grad():
        want = lin(x)
        torch.testing.assert_close(layer(x), want, rtol=0.05, atol=0.05)
        out = torch.empty(6, 32)
        torch.testing.assert_close(linear_into(x, [(layer, out)]) or out, want, rtol=0.05, atol=0.05)
        layer_bf16 = Fp8Linear(_linear(64, 32).to(torch.bfloat16))
        layer_bf16(x.to(torch.bfloat16))
    assert seen == [(torch.float32, False)] * 2 + [(torch.bfloat16, True)]


@pytest.mark.slow
def test_a_compiled_fp8_step_compiles_once_and_computes_what_the_uncompiled_one_does():
    """Inductor traces the FP8 products (``_scaled_mm.out`` has no fake kernel: the compiled path takes the
    functional op), so ``kernels = "fused"`` with ``precision = "fp8"`` really compiles instead of falling
    back to the uncompiled step."""
    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    compiled = Engine(to_precision(load_model("digits", precision="fp8")), WorkerConfig(backend="breakable", max_batch=4), speed=SpeedConfig(compile="inductor"))
    compiled.warmup()
    stats = next(iter(compiled.stats()["groups"].values()))["compile"]
    assert stats["compiled"] and stats["graphs"] == 1 and stats["fallback_reason"] is None
    plain = Engine(load_model("digits"), WorkerConfig(backend="breakable", max_batch=4))
    reqs = [ItemSpec(id=f"r{i}", label=i, seed=i, sampler="ddim", steps=4, guidance=2.0) for i in range(5)]
    for a, b in zip(compiled.generate(reqs), plain.generate(reqs)):
        rel = ((a.latents - b.latents).norm() / b.latents.norm()).item()
        assert 0.0 < rel < 0.1, rel  # FP8 against float32, over 4 steps


def test_projections_into_slices_share_one_quantization_and_match_forward(monkeypatch):
    x = torch.randn(40, 128)
    fp = [Fp8Linear(_linear(128, 64, seed=s)) for s in range(3)]
    plain = _linear(128, 64, seed=9)
    out = torch.empty(40, 4 * 64)  # q, k, v, and a plain linear's output as column slices of one buffer
    slots = [out[:, i * 64:(i + 1) * 64] for i in range(4)]
    calls = []
    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda t, gelu="none", **kw: calls.append(1) or real(t, gelu))
    with torch.no_grad():
        linear_into(x, [*zip(fp, slots[:3]), (plain, slots[3])])
    assert len(calls) == 1  # one quantization of x for the three fp8 projections
    for layer, slot in zip([*fp, plain], slots):
        torch.testing.assert_close(slot, layer(x).detach(), rtol=1e-5, atol=1e-5)


def test_the_block_linears_are_taken_and_modulation_embedders_and_odd_sizes_are_not():
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
    dit.transformer_blocks[1].ff.net[2] = nn.Linear(dit.transformer_blocks[1].ff.net[2].in_features, 40)  # 40 % 16 != 0
    linears = {n for n, m in dit.named_modules() if isinstance(m, nn.Linear)}
    taken = quantize_linears(dit)
    assert set(taken) < linears
    assert {n.split(".", 2)[2] for n in taken} == {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                                                  "ff.net.0.proj", "ff.net.2"}
    assert "transformer_blocks.1.ff.net.2" not in taken and "transformer_blocks.0.ff.net.2" in taken
    assert all(not n.startswith("transformer_blocks") or "norm" in n or n == "transformer_blocks.1.ff.net.2"
               for n in linears - set(taken))  # besides the odd one, only modulation linears are left in blocks
    assert isinstance(dit.transformer_blocks[0].attn1.to_out[0], Fp8Linear)
    assert isinstance(dit.transformer_blocks[0].norm1.linear, nn.Linear)
    fused = {n.split(".", 2)[2] for n, m in dit.named_modules() if getattr(m, "fused_input", False)}
    assert fused == {"attn1.to_q", "attn1.to_k", "attn1.to_v", "ff.net.0.proj"}  # the norms' consumers


def test_a_cross_attentions_query_takes_the_fused_quantization_and_its_keys_and_values_do_not(tmp_path):
    """PixArt's attn2 reads the block's residual (made by the compiled code) for its query, and the prompt's
    states (an input of the step) for its keys and values; the fused qkv of attn1 keeps its parts' mark."""
    from workers.models.tiny_pixart import make_tiny_pixart

    model = to_precision(load_model(make_tiny_pixart(tmp_path / "p"), precision="fp8"))
    blk = model.transformer.transformer_blocks[0]
    assert blk.attn2.to_q.fused_input and not blk.attn2.to_k.fused_input and not blk.attn2.to_v.fused_input
    assert blk.ff.net[0].proj.fused_input and not blk.ff.net[2].fused_input and not blk.attn2.to_out[0].fused_input
    assert fp8.fuse_linears([blk.attn1.to_q, blk.attn1.to_k, blk.attn1.to_v]).fused_input


def test_under_compile_a_fused_inputs_rows_are_quantized_by_pytorch_ops_and_otherwise_by_the_kernel(monkeypatch):
    """Where the row kernel serves (on CUDA), a ``fuse`` call traced by dynamo runs PyTorch's operations
    (which Inductor fuses into the producer), while untraced calls and unfused ones run the kernel; the
    codes are the same function of the rows either way."""
    from workers.kernels import quant as quant_kernel

    launched = []

    def launch(x, gelu, plan):  # the kernel's stand-in on a CPU: counted, computing the PyTorch path
        launched.append(gelu)
        return _torch_rows(x)

    monkeypatch.setattr(quant_kernel, "available", lambda x: True)
    monkeypatch.setattr(quant_kernel, "launch", launch)
    x = torch.randn(8, 64)
    for fuse, compile_, kernel_calls in [(True, True, 0), (False, True, 1), (True, False, 1)]:
        launched.clear()
        fn = lambda t: quantize_rows(t * 2.0, fuse=fuse)
        q, s = (torch.compile(fn, backend="aot_eager", fullgraph=True) if compile_ else fn)(x)
        torch._dynamo.reset()
        assert len(launched) == kernel_calls, (fuse, compile_, launched)
        want_q, want_s = _torch_rows(x * 2.0)
        torch.testing.assert_close(s, want_s)
        assert torch.equal(q.float(), want_q.float())


def _torch_rows(x):
    scale = fp8._row_scales(x)
    return (x * scale.reciprocal().to(x.dtype)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), scale


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_a_feed_forwards_gelu_moves_into_its_second_linears_quantization_and_computes_the_same(approximate,
                                                                                              monkeypatch):
    """quantize_linears folds GELU(proj) -> Dropout -> linear: the first linear keeps only its product, the
    second applies the GELU as it quantizes its input; the block's output is what the unfolded FP8
    feed-forward gives (the same operations on a CPU), and a net already folded is left alone."""
    import copy

    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(64, activation_fn="gelu-approximate" if approximate == "tanh" else "gelu")

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer_blocks = nn.ModuleList([nn.ModuleDict({"ff": ff})])

    folded = Blocks()
    unfolded = copy.deepcopy(folded)
    with monkeypatch.context() as m:
        m.setattr(fp8, "fold_gelus", lambda transformer: 0)
        quantize_linears(unfolded)
    quantize_linears(folded)
    net = folded.transformer_blocks[0]["ff"].net
    assert isinstance(net[0], fp8.Projection) and isinstance(net[0].proj, Fp8Linear)
    assert net[2].gelu == ("tanh" if approximate == "tanh" else "erf")
    assert type(unfolded.transformer_blocks[0]["ff"].net[0]) is GELU
    assert fp8.fold_gelus(folded) == 0  # nothing left to fold
    keys = set(folded.state_dict())
    assert keys == set(unfolded.state_dict()) and "transformer_blocks.0.ff.net.0.proj.weight_fp8" in keys
    x = torch.randn(3, 10, 64)
    with torch.no_grad():
        got, want = folded.transformer_blocks[0]["ff"](x), unfolded.transformer_blocks[0]["ff"](x)
    assert torch.equal(got, want)
    assert "gelu(tanh)" in repr(net[2]) or "gelu(erf)" in repr(net[2])


def test_mmdit_blocks_and_flux_single_blocks_are_taken_and_the_latents_stay_close(tmp_path):
    """The tiny FLUX.1-dev layout: its double blocks' joint projections and its single blocks' linears
    are taken; the final latents of a 5-step image stay within a few percent of float32's."""
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux
    from workers.request.spec import ItemSpec

    folder = make_tiny_flux(tmp_path / "flux")
    model = to_precision(load_model(folder, precision="fp8"))
    names = [n for n, m in model.transformer.named_modules() if isinstance(m, Fp8Linear)]
    assert model.precision == "fp8" and model.fp8_linears == len(names) > 0
    assert any(n.startswith("single_transformer_blocks.") and n.endswith("proj_mlp") for n in names)
    assert any(n.endswith("attn.add_q_proj") for n in names) and not any("norm" in n for n in names)
    spec = ItemSpec(id="a", seed=1, sampler="flow_euler", steps=5, guidance=3.5, prompt="a red cat")
    got, want = (Engine(m, WorkerConfig(backend="eager", max_batch=1)).generate([spec])[0].latents
                 for m in (model, load_model(folder)))
    rel = ((got - want).norm() / want.norm()).item()
    assert 0.0 < rel < 0.05, rel


def test_devices_without_fp8_are_refused_with_the_reason(monkeypatch):
    assert fp8.unsupported_reason("cpu") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    why = fp8.unsupported_reason("cuda:0")
    assert "A100" in why and "8.0" in why and "8.9" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert fp8.unsupported_reason("cuda:0") is None
    from workers.loading import ModelError, load_model

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(ModelError, match="cannot run digits in fp8: .*A100"):
        to_precision(load_model("digits", device="cuda:0", precision="fp8"))
    with pytest.raises(ModelError, match="unknown precision"):
        to_precision(load_model("digits", precision="fp4"))


def text_oracle(device: str, backend: str, compile_mode: str = "off", per_digit: int = 20) -> dict[str, float]:
    """The shipped digits-text model (float32), ``per_digit`` prompts of the training grammar for each digit,
    through the engine on ``device`` with ``backend`` (and ``compile_mode``): oracle accuracy in its own dtype
    ("bf16") and with FP8 linears, same seeds."""
    from workers.models.digits import oracle_accuracy
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models import train_digits_text as recipe
    from workers.request.spec import ItemSpec

    prompts, labels = recipe.oracle_prompts(per_digit, held_out=False, seed=3)
    acc = {}
    for precision in ("bf16", "fp8"):
        model = to_precision(load_model("digits-text", device=device, dtype=torch.float32, precision=precision))
        assert (model.fp8_linears > 0) == (precision == "fp8")
        engine = Engine(model, WorkerConfig(backend=backend, max_batch=64), speed=SpeedConfig(compile=compile_mode))
        d = model.defaults
        reqs = [ItemSpec(id=str(i), model="digits-text", prompt=p, seed=100 + i, sampler=d["sampler"],
                         steps=d["steps"], guidance=d["guidance"]) for i, p in enumerate(prompts)]
        images = np.stack([r.image.astype(np.float32) / 127.5 - 1.0 for r in engine.generate(reqs, max_active=64)])
        acc[precision] = oracle_accuracy(images.reshape(len(prompts), 8, 8), labels)
    return acc


@pytest.mark.slow
def test_the_text_oracle_through_fp8_is_within_two_points_of_the_models_dtype():
    """100 prompts on a CPU (both read 100%, as do 200; FP8 runs at half float32's speed here), 200 on a
    GPU (test_fp8_gpu.py)."""
    acc = text_oracle("cpu", "eager", per_digit=10)
    print(f"digits-text oracle on the CPU: {acc}")
    assert acc["bf16"] >= 0.9 and acc["fp8"] >= acc["bf16"] - 0.02, acc


def test_each_measured_row_plan_holds_its_rows_and_others_get_a_split_or_whole_row():
    from workers.kernels import quant as quant_kernel

    for k, plan in quant_kernel.PLANS.items():
        assert (plan.block >= k) if plan.kind == "whole" else (plan.kind == "split" and sum(plan.parts) >= k), k
        assert plan.block == (plan.parts[0] if plan.parts else quant_kernel._next_pow2(k))
    assert quant_kernel.plan_for(2304) == quant_kernel.split_plan(2304)  # 2048 + 256: two parts
    assert quant_kernel.plan_for(2304).parts == (2048, 256) and quant_kernel.plan_for(2304).warps == 2
    wide = quant_kernel.plan_for(7 * 1024)  # 4096 + 2048 + 1024: three parts measured slower than a whole row
    assert wide.kind == "whole" and wide.block == 8192 and wide.warps == 4


def test_fast_accumulation_reaches_every_product(monkeypatch):
    """Every product takes ``use_fast_accum``, in ``forward``, ``mm_into`` and ``mm_rows`` alike."""
    layer, x = Fp8Linear(_linear(64, 32)), torch.randn(6, 64)
    real, seen = torch._scaled_mm, []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, use_fast_accum=False, **kw: seen.append(use_fast_accum)
                        or real(*a, use_fast_accum=use_fast_accum, **kw))
    with torch.no_grad():
        layer(x)
        linear_into(x, [(layer, torch.empty(6, 32))])
        layer.mm_rows(*fp8.quantize_rows(x))
    assert seen == [True] * 3
