"""The GELU-epilogue patch (``workers.speed.epilogues``) computes what diffusers' blocks compute, for every family.

On a CPU the patched feed-forwards run diffusers' own arithmetic (the epilogue is CUDA's), so they are
bit-equal; FLUX's single blocks sum ``proj_out`` over the concatenation's two parts as two products, a
different float32 summation order: within 1e-5 relative. The CUDA epilogue itself is tested on the GPU
(``test_epilogues_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.config import WorkerConfig
from workers.loading import load_model
from workers.speed import SpeedConfig
from workers.families.flux import fast as flux_fast
from workers.speed.epilogues import GeluEpilogue, epilogue_ok, fuse_gelu_epilogues


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_pixart import make_tiny_pixart
    from workers.models.tiny_sd3 import make_tiny_sd3

    root = tmp_path_factory.mktemp("epilogues")
    return {"pixart": make_tiny_pixart(root / "pixart"), "sd3": make_tiny_sd3(root / "sd3"),
            "flux": make_tiny_flux(root / "flux")}


def _fuse_all(transformer) -> int:
    """The GELU epilogues the speed layer makes: every family's feed-forwards and FLUX.1's single blocks (its
    family's "epilogues" rewrite)."""
    return fuse_gelu_epilogues(transformer) + flux_fast.fuse_gelu_epilogues(transformer)


def _gelus(transformer) -> int:
    from diffusers.models.activations import GELU

    return sum(type(m) is GELU and m.approximate == "tanh" for m in transformer.modules())


def _forward(model, family: str, seed: int = 0) -> torch.Tensor:
    """One transformer call on random inputs of the model's native shape, two rows, on its device."""
    g = torch.Generator().manual_seed(seed)
    t, dev, dt = model.transformer, model.device, model.dtype
    c, h, w = model.latent_shape
    x = torch.randn(2, c, h, w, generator=g).to(dev, dt)
    with torch.no_grad():
        if family == "dit":
            return t(x, torch.tensor([10, 700], device=dev), torch.tensor([1, 2], device=dev)).sample
        from workers.families import family_of

        conds = family_of(model).encode(model, _specs(model))
        cond = {k: torch.stack([c[k] for c in conds]).to(dev) for k in conds[0]}
        if family == "flux":
            from workers.families.flux.runtime import image_ids, pack

            guidance = torch.tensor([3.5, 2.0], device=dev) if model.card.guidance_mode == "embedded" else None
            return t(pack(x), encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"],
                     timestep=torch.tensor([0.3, 0.9], device=dev, dtype=dt), guidance=guidance,
                     img_ids=image_ids(h // 2, w // 2, dev), txt_ids=torch.zeros(model.card.max_tokens, 3, device=dev),
                     return_dict=False)[0]
        if family == "sd3":
            return t(x, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"],
                     timestep=torch.tensor([100.0, 900.0], device=dev, dtype=dt), return_dict=False)[0]
        return t(x, encoder_hidden_states=cond["prompt_embeds"], encoder_attention_mask=cond["prompt_mask"],
                 timestep=torch.tensor([100, 900], device=dev), added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                 return_dict=False)[0]


def _specs(model):
    from workers.request.spec import ItemSpec

    return [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=2, guidance=3.5, prompt=p,
                     negative_prompt="")
            for i, p in enumerate(("a red cat", "the big blue house"))]


@pytest.mark.parametrize("family", ["dit", "pixart", "sd3", "flux"])
def test_patched_blocks_compute_what_diffusers_computes(family, tiny_dirs):
    model = load_model("digits") if family == "dit" else load_model(tiny_dirs[family])
    want, gelus = _forward(model, family), _gelus(model.transformer)
    singles = len(getattr(model.transformer, "single_transformer_blocks", []))
    assert gelus > 0
    assert _fuse_all(model.transformer) == gelus + singles
    assert _gelus(model.transformer) == 0
    assert sum(type(m) is GeluEpilogue for m in model.transformer.modules()) == gelus
    got = _forward(model, family)
    if singles:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        assert torch.equal(got, want)  # off CUDA the patched module runs diffusers' arithmetic
    assert _fuse_all(model.transformer) == 0  # patching again changes nothing
    assert torch.equal(_forward(model, family), got)


def test_fp8_linears_are_left_to_fp8():
    """FP8 feed-forwards fold their GELU into the next linear's quantization (workers.speed.fp8): not patched."""
    from workers.speed.fp8 import quantize_linears

    model = load_model("digits")
    quantize_linears(model.transformer)
    assert _fuse_all(model.transformer) == 0


def test_no_epilogue_off_cuda():
    assert not epilogue_ok("cpu")
    lin = nn.Linear(8, 16)
    x = torch.randn(3, 5, 8)
    assert torch.equal(GeluEpilogue(lin, epilogue=True)(x), torch.nn.functional.gelu(lin(x), approximate="tanh"))


@pytest.mark.parametrize("backend,switch,patched", [("full", True, True), ("breakable", True, True),
                                                     ("eager", True, False), ("full", False, False)])
def test_the_engine_patches_under_graph_backends_when_asked(backend, switch, patched):
    from workers.engine import Engine
    from workers.request.spec import ItemSpec

    model = load_model("digits")
    reqs = [ItemSpec(id=f"r{i}", label=i, seed=i, sampler="ddim", steps=2, guidance=2.0) for i in range(3)]
    want = Engine(load_model("digits"), WorkerConfig(backend="eager", max_batch=4)).generate(reqs)
    got = Engine(model, WorkerConfig(backend=backend, max_batch=4), speed=SpeedConfig(gelu_epilogue=switch)).generate(reqs)
    assert any(type(m) is GeluEpilogue for m in model.transformer.modules()) == patched
    for a, b in zip(got, want):
        torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=1e-5)
