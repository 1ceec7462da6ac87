"""FLUX.1's own fast paths (``workers.families.flux.fast``, ``workers.families.flux.attention``) on a CPU: the
FP8 single blocks' GELU folded into their output's quantization, the bf16 single blocks' epilogue, the FP8
blocks' fused norms, and the family's ``speed_rewrites`` hook that the speed layer calls for them. The
fused norms on the kernel, in compiled graphs, are ``test_flux_fast_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from workers.families.flux import fast
from workers.loading import load_model
from workers.models.tiny_flux import make_tiny_flux
from workers.speed import SpeedConfig
from workers.speed.apply import to_precision
from workers.speed.epilogues import fuse_gelu_epilogues
from workers.speed.routing import restore_joint_attention, route_joint_attention


def _rewrite(model, stage: str) -> int:
    """The family's rewrites at one of the speed layer's stages, as ``workers.speed.apply`` makes them."""
    from workers.families import family_of

    return family_of(model).speed_rewrites(model, stage, SpeedConfig(), True)


def _fp8(model):
    """``model`` in FP8 as the speed layer makes it: its linears (``to_precision``), then FLUX.1's
    "precision" rewrite (its single blocks' GELU folded)."""
    to_precision(model, "fp8")
    _rewrite(model, "precision")
    return model


def test_the_hook_rewrites_at_its_stages_only_and_again_changes_nothing(tmp_path):
    model = _fp8(load_model(make_tiny_flux(tmp_path / "flux", head_dim=16), precision="fp8"))
    assert _rewrite(model, "precision") == 0  # folded already
    assert _rewrite(model, "epilogues") == 0  # FP8 single blocks: their GELU is in the quantization
    route_joint_attention(model.transformer)
    blocks = len(model.transformer.transformer_blocks) + len(model.transformer.single_transformer_blocks)
    assert _rewrite(model, "norms") == blocks == _rewrite(model, "norms")
    assert _rewrite(model, "other") == 0


def test_the_speed_layer_applies_the_flux_rewrites(tmp_path):
    from workers.families import family_of
    from workers.speed.apply import apply

    model = load_model(make_tiny_flux(tmp_path / "flux", head_dim=16), precision="fp8")
    apply(model, family_of(model), SpeedConfig(), graphs=True)
    tr = model.transformer
    assert fast.fused_blocks(tr) == len(tr.transformer_blocks) + len(tr.single_transformer_blocks)


def test_flux_single_blocks_fold_their_gelu_into_the_output_projections_quantization(tmp_path, monkeypatch):
    """FP8 FLUX.1 single blocks: ``proj_mlp`` keeps only its product and ``proj_out`` quantizes
    cat([attention, gelu(mlp)]) by ``quantize_pair``; the transformer's output is what the unfolded FP8 blocks
    give (the same operations on a CPU), and bf16 single blocks are left to the GELU epilogue."""
    import copy

    folder = make_tiny_flux(tmp_path / "flux")
    model = _fp8(load_model(folder, precision="fp8"))
    (block,) = model.transformer.single_transformer_blocks
    assert type(block).__name__ == "Fp8FluxSingleBlock" and block._mlp_gelu == "tanh"
    assert fast.fold_single_block_gelus(model.transformer) == 0  # nothing left to fold
    assert type(load_model(folder).transformer.single_transformer_blocks[0]).__name__ == "FluxSingleTransformerBlock"
    unfolded = copy.deepcopy(model.transformer)
    assert fast.unfold_single_block_gelus(unfolded) == 1
    assert type(unfolded.single_transformer_blocks[0]).__name__ == "FluxSingleTransformerBlock"
    calls = []
    real = fast.quantize_pair
    monkeypatch.setattr(fast, "quantize_pair", lambda a, b, gelu="tanh", s=None: calls.append(gelu) or real(a, b, gelu, s))
    g = torch.Generator().manual_seed(0)
    cfg = model.transformer.config
    n, text = 16, 5
    inputs = dict(hidden_states=torch.randn(2, n, cfg.in_channels, generator=g),
                  encoder_hidden_states=torch.randn(2, text, cfg.joint_attention_dim, generator=g),
                  pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=g),
                  timestep=torch.tensor([0.5, 0.25]), guidance=torch.tensor([3.5, 3.5]),
                  img_ids=torch.randn(n, 3, generator=g), txt_ids=torch.zeros(text, 3))
    with torch.no_grad():
        got = model.transformer(**inputs).sample
        want = unfolded(**inputs).sample
    assert calls == ["tanh"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got.abs().max() > 0


def test_flux_single_blocks_keep_one_class_and_their_weights(tmp_path):
    """A blocks-scope compile makes one graph per block class: the patched single blocks share one class,
    and the patch moved no weight (the state dict is the same tensors)."""
    from workers.families.base import repeated_blocks

    model = load_model(make_tiny_flux(tmp_path / "flux"))
    before = {k: v.data_ptr() for k, v in model.transformer.state_dict().items()}
    fuse_gelu_epilogues(model.transformer)
    assert _rewrite(model, "epilogues") == len(model.transformer.single_transformer_blocks)
    singles = model.transformer.single_transformer_blocks
    assert len({type(b) for b in singles}) == 1 and type(singles[0]).__name__ == "EpilogueFluxSingleBlock"
    assert singles in [getattr(model.transformer, n) for n, _ in model.transformer.named_children()]
    assert len(repeated_blocks(model.transformer)) == len(singles) + len(model.transformer.transformer_blocks)
    assert {k: v.data_ptr() for k, v in model.transformer.state_dict().items()} == before


def _tiny_flux_fp8(tmp_path, fp8_attention: bool):
    model = _fp8(load_model(make_tiny_flux(tmp_path / "flux", head_dim=16), precision="fp8"))
    route_joint_attention(model.transformer, fp8=fp8_attention)
    return model


def _flux_call(tr, n=16, text=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = tr.config
    return dict(hidden_states=torch.randn(2, n, cfg.in_channels, generator=g),
                encoder_hidden_states=torch.randn(2, text, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=g),
                timestep=torch.tensor([0.5, 0.25]), guidance=torch.tensor([3.5, 3.5]),
                img_ids=torch.randn(n, 3, generator=g), txt_ids=torch.zeros(text, 3))


@pytest.mark.parametrize("fp8_attention", [False, True])
def test_fused_norm_flux_blocks_compute_what_their_own_forward_computes(tmp_path, fp8_attention, monkeypatch):
    """FLUX.1's FP8 double and single blocks with the norms fused and one product for each stream's q, k and v
    (and the single blocks' MLP): the transformer's output against the same FP8 blocks' own forward (float32
    on a CPU: the same arithmetic, but for the rounding order ahead of a code)."""
    model = _tiny_flux_fp8(tmp_path, fp8_attention)
    tr = model.transformer
    doubles, singles = len(tr.transformer_blocks), len(tr.single_transformer_blocks)
    calls = []
    kernel = fast.add_norm_quantize
    monkeypatch.setattr(fast, "add_norm_quantize",
                        lambda *a, **k: calls.append("text" in k) or kernel(*a, **k))
    inputs = _flux_call(tr)
    with torch.no_grad():
        want = tr(**inputs).sample
        assert fast.fuse_block_norms(tr) == doubles + singles == fast.fused_blocks(tr)
        assert fast.fuse_block_norms(tr) == doubles + singles  # again: nothing changes
        got = tr(**inputs).sample
    assert calls == [False] * 4 * doubles + [True] * singles  # two norms a stream; one of text and image together
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-4, rel  # 0 on a CPU today: the fused arithmetic is the same float32
    assert got.abs().max() > 0
    keys = set(tr.state_dict())
    fast.restore_block_norms(tr)
    assert fast.fused_blocks(tr) == 0 and set(tr.state_dict()) == keys  # the fused products are no submodules
    assert type(tr.single_transformer_blocks[0]).__name__ == "Fp8FluxSingleBlock"
    with torch.no_grad():
        again = tr(**inputs).sample
    torch.testing.assert_close(again, want)  # the parts' weights, views of the fused ones, are what they were


def test_flux_blocks_without_fp8_or_routed_attention_keep_their_forward(tmp_path, monkeypatch):
    assert fast.fuse_block_norms(load_model(make_tiny_flux(tmp_path / "bf16")).transformer) == 0
    model = _tiny_flux_fp8(tmp_path, False)
    tr = model.transformer
    assert fast.fuse_block_norms(tr) > 0
    restore_joint_attention(tr)  # diffusers' processors: the fused forward steps aside
    monkeypatch.setattr(fast, "add_norm_quantize", lambda *a, **k: pytest.fail("fused path taken"))
    with torch.no_grad():
        out = tr(**_flux_call(tr)).sample
    assert out.shape == (2, 16, tr.config.in_channels) and torch.isfinite(out).all()
