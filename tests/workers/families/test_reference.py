"""Every family names its diffusers pipeline (``Family.reference_pipeline`` / ``reference_call``): the baseline
the benchmarks compare with. On each family's tiny model, the pipeline the hooks build runs the engine's request
(its prompt or label, size, steps and guidance) and makes an image of the engine's size. Whether the images are
equal from the same latents is each family's own test (test_<family>.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.families import FAMILIES, family_of
from workers.loading import load_model
from workers.request.spec import ItemSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import harness  # noqa: E402


@pytest.mark.parametrize("family", sorted(harness.SMOKE_MODELS))
def test_the_reference_pipeline_makes_the_engines_image(family, tmp_path):
    model = load_model(harness.tiny_model(family, tmp_path))
    assert family_of(model) is not None and model.card.family == family
    d = model.card.defaults
    text = model.card.conditioning == "text"
    spec = ItemSpec(id="r", model=model.name, seed=3, sampler=d["sampler"], steps=2, guidance=float(d["guidance"]),
                    label=0 if not text else None, prompt="a red cat" if text else "")
    ours = Engine(model, WorkerConfig(backend="eager")).generate([spec])[0].image
    family_obj = family_of(model)
    pipe = family_obj.reference_pipeline(model)
    theirs = pipe(**family_obj.reference_call(model, [spec]), output_type="np",
                  generator=torch.Generator().manual_seed(3)).images[0]
    theirs = np.round(np.clip(theirs, 0, 1) * 255).astype(np.uint8)
    assert theirs.squeeze().shape == ours.shape


def test_every_registered_family_has_a_smoke_model():
    assert set(FAMILIES) == set(harness.SMOKE_MODELS)


@pytest.mark.parametrize("family", ["flux2", "qwenimage", "zimage", "sana"])
def test_the_new_families_run_fp8_linears_through_the_speed_layer(family, tmp_path):
    """``fastest``'s precision on the families added with LLM encoders: their blocks' linears become FP8 products
    (not the modulation linears), on a CPU too, and the image stays near the float32 one (FP8's rounding on random
    weights: within 10% of the latents' norm)."""
    from workers.speed.apply import to_precision
    from workers.speed.fp8 import Fp8Linear

    path = harness.tiny_model(family, tmp_path)
    plain, fp8 = load_model(path), to_precision(load_model(path, precision="fp8"))
    names = [n for n, m in fp8.transformer.named_modules() if isinstance(m, Fp8Linear)]
    assert len(names) == fp8.fp8_linears > 0
    assert not any(k in n.lower() for n in names for k in ("adaln", "img_mod", "txt_mod", "norm"))
    d = plain.card.defaults
    spec = ItemSpec(id="q", model=plain.name, seed=1, sampler=d["sampler"], steps=3, guidance=float(d["guidance"]),
                    prompt="a red cat")
    a = Engine(plain, WorkerConfig(backend="eager")).generate([spec])[0].latents
    b = Engine(fp8, WorkerConfig(backend="eager")).generate([spec])[0].latents
    assert torch.isfinite(b).all() and (a - b).norm() / a.norm() < 0.1
