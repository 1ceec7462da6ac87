"""PixArt's FP8 blocks with their norms and quantizations fused (``workers.speed.norm_fusion``) compute what
diffusers' blocks compute, and the row arithmetic (``workers.kernels.norm.reference``, which the CUDA kernel
is checked against in test_norm_kernel_gpu.py) is the block's: add, LayerNorm, modulation, FP8 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.config import WorkerConfig
from workers.speed.apply import to_precision
from workers.speed import SpeedConfig
from workers.kernels import norm as norm_kernel
from workers.speed import fp8, norm_fusion


def _rows(b=3, t=5, k=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(b, 6, k, generator=g) * 0.3
    x, y = (torch.randn(b, t, k, generator=g) for _ in range(2))
    return x, y, *table.chunk(6, dim=1)[:3]  # gate, shift, scale: (B, 1, K) views with a batch stride of 6K


@pytest.mark.parametrize("case", ["all", "norm and modulation", "add only", "add and gate", "rows only"])
def test_the_reference_is_the_blocks_add_norm_modulation_and_row_quantization(case):
    x, y, gate, shift, scale = _rows()
    kw = {"all": dict(y=y, gate=gate, shift=shift, scale=scale), "norm and modulation": dict(shift=shift, scale=scale),
          "add only": dict(y=y, norm=False), "add and gate": dict(y=y, gate=gate, norm=False), "rows only": {}}[case]
    out, q, s = norm_kernel.add_norm_quantize(x, **kw)  # a CPU tensor: the PyTorch path
    want_x = x + (kw["gate"] * y if "gate" in kw else y) if "y" in kw else x
    n = F.layer_norm(want_x, want_x.shape[-1:], eps=1e-6) if kw.get("norm", True) else want_x
    if "scale" in kw:
        n = n * (1 + scale) + shift
    assert torch.allclose(out, want_x, atol=1e-6) and (out is x) == ("y" not in kw)
    rows = n.reshape(-1, n.shape[-1])
    wq, ws = fp8.quantize_rows(rows)
    assert q.dtype == fp8.FP8 and q.shape == rows.shape and s.shape == (rows.shape[0], 1)
    assert torch.allclose(s, ws, rtol=1e-6)
    assert (q.float() != wq.float()).float().mean() < 0.01  # the same codes but for float32 rounding
    # within one e4m3 step (2^-3 relative) of the rows it quantized
    assert ((q.float() * s - rows).abs() <= rows.abs() * 2 ** -3 + s * 2 ** -9).all()


def test_a_batch_vector_shaped_b_by_k_or_strided_gives_the_same_rows():
    x, y, gate, shift, scale = _rows()
    a = norm_kernel.add_norm_quantize(x, y, gate, shift, scale)
    b = norm_kernel.add_norm_quantize(x, y, gate.reshape(3, -1).clone(), shift.reshape(3, -1).clone(),
                                      scale.reshape(3, -1).clone())
    assert all(torch.equal(u.float(), v.float()) for u, v in zip(a, b))


@pytest.fixture(scope="module")
def tiny_pixart_fp8(tmp_path_factory):
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart

    return to_precision(load_model(make_tiny_pixart(tmp_path_factory.mktemp("p") / "pixart"), precision="fp8"))


def _block_inputs(block, b=2, t=16, keys=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = block.norm1.normalized_shape[0]
    mask = torch.zeros(b, 1, keys)
    mask[1, :, 5:] = -10000.0  # the second prompt has 5 real tokens
    return dict(hidden_states=torch.randn(b, t, d, generator=g), timestep=torch.randn(b, 6 * d, generator=g) * 0.3,
                encoder_hidden_states=torch.randn(b, keys, block.attn2.to_k.in_features, generator=g),
                encoder_attention_mask=mask)


@pytest.mark.parametrize("cross", ["varlen", "padded"])
def test_fused_norm_blocks_compute_what_diffusers_blocks_compute(tiny_pixart_fp8, cross, monkeypatch):
    from workers.families import family_named

    pixart = family_named("pixart")
    from workers.speed.patches import break_attention, restore_attention

    tr = tiny_pixart_fp8.transformer
    break_attention(tr)
    pixart.set_cross_attention(tiny_pixart_fp8, cross)
    calls = []
    kernel = norm_fusion.add_norm_quantize
    monkeypatch.setattr(norm_fusion, "add_norm_quantize", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    try:
        assert norm_fusion.fuse_block_norms(tr) == len(tr.transformer_blocks) == norm_fusion.fuse_block_norms(tr)
        for i, block in enumerate(tr.transformer_blocks):
            inputs = _block_inputs(block, seed=i)
            with torch.no_grad():
                got = block(**inputs)
                assert type(block) is norm_fusion._block_class()
                block.__class__ = type(block).__mro__[1]  # diffusers' BasicTransformerBlock again
                want = block(**inputs)
                block.__class__ = norm_fusion._block_class()
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel < 1e-3, (i, rel)  # float32 on a CPU: the same arithmetic, but for rounding order
        # per block: the first norm, then the residual add for a varlen query, then the second norm
        assert len(calls) == len(tr.transformer_blocks) * (3 if cross == "varlen" else 2)
    finally:
        norm_fusion.restore_block_norms(tr)
        restore_attention(tr)
        pixart.set_cross_attention(tiny_pixart_fp8, "padded")


def test_without_the_engines_self_attention_a_fused_block_runs_diffusers_forward(tiny_pixart_fp8, monkeypatch):
    tr = tiny_pixart_fp8.transformer
    monkeypatch.setattr(norm_fusion, "add_norm_quantize", lambda *a, **k: pytest.fail("fused path taken"))
    try:
        norm_fusion.fuse_block_norms(tr)
        block = tr.transformer_blocks[0]
        with torch.no_grad():
            out = block(**_block_inputs(block))
        assert out.shape == (2, 16, block.norm1.normalized_shape[0])
    finally:
        norm_fusion.restore_block_norms(tr)
    assert all(type(b).__name__ == "BasicTransformerBlock" for b in tr.transformer_blocks)


def test_blocks_without_fp8_linears_are_left_alone_and_dit_fp8_blocks_are_taken(tmp_path, monkeypatch):
    from workers.loading import load_model
    from workers.models.tiny_dit import write_tiny_dit
    from workers.models.tiny_pixart import make_tiny_pixart

    assert norm_fusion.fuse_block_norms(load_model(make_tiny_pixart(tmp_path / "p")).transformer) == 0
    write_tiny_dit(tmp_path / "dit")
    assert norm_fusion.fuse_block_norms(load_model(tmp_path / "dit").transformer) == 0
    dit = to_precision(load_model(tmp_path / "dit", precision="fp8")).transformer
    assert norm_fusion.fuse_block_norms(dit) == len(dit.transformer_blocks) > 0


@pytest.mark.parametrize("hoisted", [True, False])
def test_fused_norm_dit_blocks_compute_what_diffusers_blocks_compute(tmp_path, hoisted, monkeypatch):
    """DiT's adaLN-Zero blocks, their modulation from each block's norm1 or from the hoisted one: the whole
    transformer with the fused blocks against diffusers' (float32 on a CPU)."""
    from workers.loading import load_model
    from workers.models.tiny_dit import write_tiny_dit
    from workers.speed.patches import break_attention, hoist_modulation, restore_modulation

    write_tiny_dit(tmp_path / "dit")
    tr = to_precision(load_model(tmp_path / "dit", precision="fp8")).transformer
    break_attention(tr)
    assert hoist_modulation(tr) if hoisted else True
    calls = []
    kernel = norm_fusion.add_norm_quantize
    monkeypatch.setattr(norm_fusion, "add_norm_quantize", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    g = torch.Generator().manual_seed(0)
    cfg = tr.config
    x = torch.randn(3, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g)
    t, y = torch.tensor([10, 500, 999]), torch.tensor([0, 3, cfg.num_embeds_ada_norm])  # the last: the null class
    with torch.no_grad():
        assert norm_fusion.fuse_block_norms(tr) == len(tr.transformer_blocks)
        got = tr(x, timestep=t, class_labels=y).sample
        assert len(calls) == 2 * len(tr.transformer_blocks)
        norm_fusion.restore_block_norms(tr)
        want = tr(x, timestep=t, class_labels=y).sample
    restore_modulation(tr)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3


@pytest.mark.slow
def test_the_engine_fuses_pixart_fp8_norms_under_the_graph_backends_and_compiled_its_images_stay_the_same(tmp_path):
    """The fused blocks under a blocks-scope compile: one graph for every block and bucket, no fallback,
    and the latents of eager diffusers blocks (float32 on a CPU)."""
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart
    from workers.request.spec import ItemSpec

    folder = make_tiny_pixart(tmp_path / "p")
    prompts = ["a red cat", "the big blue house", "a dog"]
    specs = [ItemSpec(id=str(i), seed=i, sampler="dpmpp_2m", steps=3, guidance=1.0 + i, prompt=p,
                      negative_prompt="small" if i % 2 else "") for i, p in enumerate(prompts)]
    runs = {}
    for name, backend, compile_mode in (("fused", "breakable", "inductor"), ("eager", "eager", "off")):
        model = to_precision(load_model(folder, precision="fp8"))
        engine = Engine(model, WorkerConfig(backend=backend, max_batch=4), speed=SpeedConfig(cross_attention="varlen", compile=compile_mode, compile_scope="blocks"))
        patched = [type(b) is norm_fusion._block_class() for b in model.transformer.transformer_blocks]
        assert all(patched) if backend != "eager" else not any(patched)
        runs[name] = [r.latents for r in engine.generate(specs)]
        if compile_mode != "off":
            (stats,) = engine.stats()["groups"].values()
            c = stats["compile"]
            assert c["compiled"] and c["fallback_reason"] is None and c["region_graphs"] == 1, c
    for got, want in zip(runs["fused"], runs["eager"]):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3


def test_rows_quantized_by_the_caller_are_refused_for_a_plain_linear():
    from torch import nn

    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="FP8 linears only"):
        fp8.linear_into(x, [(lin, torch.empty(4, 16))], quantized=fp8.quantize_rows(x))


def test_text_rows_are_normed_as_the_rows_of_the_concatenation():
    x, _, _, shift, scale = _rows(b=2, t=7)
    text = torch.randn(2, 3, x.shape[-1], generator=torch.Generator().manual_seed(1)) * 2
    out, q, s = norm_kernel.add_norm_quantize(x, shift=shift, scale=scale, text=text)
    _, wq, ws = norm_kernel.add_norm_quantize(torch.cat([text, x], dim=1), shift=shift, scale=scale)
    assert out is x and q.shape == (2 * 10, x.shape[-1])
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)
    with pytest.raises(ValueError, match="no residual add"):
        norm_kernel.add_norm_quantize(x, x, text=text)
