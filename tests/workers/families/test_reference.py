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
