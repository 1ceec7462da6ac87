"""SD3's and FLUX.1's attention routed through the kernel per shape (``workers.speed.joint_attention``; the
routed processors are the families', registered with ``workers.speed.routing``): on a CPU the
routed processors compute what diffusers' compute (tiny random transformers, float32), every attention call
goes through the chooser, a masked call keeps diffusers' path, and restoring brings diffusers' processors back."""

from __future__ import annotations

import torch

from workers.config import WorkerConfig
from workers.kernels import attention as sdpa
from workers.families.flux.attention import RoutedFluxAttention
from workers.families.sd3.fast import RoutedJointAttention
from workers.speed.routing import restore_joint_attention, route_joint_attention


def _tiny_flux(head=8):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                  attention_head_dim=head, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=16, guidance_embeds=True,
                                  axes_dims_rope=(head // 4, head // 4, head // 2)).eval()


def _flux_inputs(b=2, tokens=16, text=5):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
    return dict(hidden_states=torch.randn(b, tokens, 16, generator=g),
                encoder_hidden_states=torch.randn(b, text, 32, generator=g),
                pooled_projections=torch.randn(b, 16, generator=g), timestep=torch.tensor([0.3, 0.7][:b]),
                guidance=torch.full((b,), 3.5), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text, 3))


def _tiny_sd3(head=8, qk_norm="rms_norm"):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=head,
                                 num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=2 * head,
                                 pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8,
                                 qk_norm=qk_norm).eval()


def _sd3_inputs(b=2, text=5):
    g = torch.Generator().manual_seed(2)
    return dict(hidden_states=torch.randn(b, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(b, text, 32, generator=g),
                pooled_projections=torch.randn(b, 16, generator=g), timestep=torch.tensor([300.0, 700.0][:b]))


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def test_routed_flux_and_sd3_compute_what_diffusers_computes_through_the_chooser(monkeypatch):
    seen = []
    real = sdpa.CHOOSER.kernel
    monkeypatch.setattr(sdpa.CHOOSER, "kernel", lambda q, k, v: seen.append(tuple(q.shape)) or real(q, k, v))
    for make, inputs, routed, calls in ((_tiny_flux, _flux_inputs(), RoutedFluxAttention, 3),
                                        (_tiny_sd3, _sd3_inputs(), RoutedJointAttention, 2)):
        model = make()
        ref = _run(model, inputs)
        seen.clear()
        assert route_joint_attention(model) == calls  # FLUX: 1 double + 2 single blocks; SD3: 2 joint blocks
        assert all(type(m.processor) is routed for m in model.modules() if hasattr(m, "processor"))
        torch.testing.assert_close(_run(model, inputs), ref, rtol=1e-6, atol=1e-6)
        assert len(seen) == calls and all(shape[1] == 2 for shape in seen)  # (B, heads, T, d), once a block
        restore_joint_attention(model)
        assert not any(type(m.processor) is routed for m in model.modules() if hasattr(m, "processor"))


def test_a_masked_call_keeps_diffusers_path(monkeypatch):
    model = _tiny_sd3()
    route_joint_attention(model)
    attn = model.transformer_blocks[0].attn
    monkeypatch.setattr(sdpa.CHOOSER, "kernel", lambda q, k, v: (_ for _ in ()).throw(AssertionError("routed")))
    x, ctx = torch.randn(1, 16, 16), torch.randn(1, 5, 16)
    with torch.no_grad():  # JointAttnProcessor2_0 ignores a mask; the routed copy hands such a call back to it
        out, ctx_out = attn.processor(attn, x, ctx, attention_mask=torch.ones(1, 21, 21, dtype=torch.bool))
    assert out.shape == x.shape and ctx_out.shape == ctx.shape


def test_the_engine_routes_joint_attention_under_the_graph_backends_only(tmp_path):
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux

    model = load_model(str(make_tiny_flux(tmp_path / "flux")), device="cpu", dtype=torch.float32)
    Engine(model, WorkerConfig(backend="eager"))
    assert not any(isinstance(m.processor, RoutedFluxAttention) for m in model.transformer.modules()
                   if hasattr(m, "processor"))
    Engine(model, WorkerConfig(backend="breakable"))
    assert any(isinstance(m.processor, RoutedFluxAttention) for m in model.transformer.modules()
               if hasattr(m, "processor"))
