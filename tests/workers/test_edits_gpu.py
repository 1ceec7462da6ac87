"""Image-to-image and inpainting through graphs (GPU).

Tiny random SD3.5 and FLUX.1-dev in the real layouts (workers.models.tiny_sd3 / tiny_flux), float32 on CUDA. Text,
image-to-image and inpainting rows of one model in one engine, admitted together: the ``full`` and ``breakable``
graphs give every request the final latents eager gives, within 1e-5 of the largest value. Text and image-to-image
rows share the family step's graphs (13 rows: buckets 8 + 4 + 1, or padded where the tiny model's timings say so);
the inpainting rows run the engine's ``inpaint`` variant, its group made and captured on first use after warm-up
(7 rows: 4 + 2 + 1); no step falls back to eager. And per bucket: the inpainting step's runner (the family's step
and the blend, ``workers.edits.inpainting``) replays, at every bucket of 1 to 8 rows of different masks, images,
steps and strengths, what the same runner computes eagerly.
"""

from __future__ import annotations

import pytest
import torch

from workers.config import WorkerConfig

pytestmark = pytest.mark.gpu

PROMPTS = ("a red cat", "the big blue house", "a dog", "small green tree drawn", "a photo of a cat")
STRENGTHS = (0.3, 0.6, 1.0, 0.45)
BOXES = ((0.5, 0, 1, 1), (0, 0, 0.5, 1), (0.25, 0.25, 0.75, 0.75), (0, 0.5, 1, 1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"sd3": model, "flux": model}: tiny random directories made offline, float32 on CUDA."""
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_sd3 import make_tiny_sd3

    sd3 = make_tiny_sd3(tmp_path_factory.mktemp("sd3") / "tiny-sd3")
    flux = make_tiny_flux(tmp_path_factory.mktemp("flux") / "tiny-flux-dev")
    return {k: load_model(p, device="cuda", dtype=torch.float32) for k, p in (("sd3", sd3), ("flux", flux))}


def _specs(plain: int, inpaint: int):
    """``plain`` text and image-to-image requests (every third a text one), then ``inpaint`` inpainting ones: mixed
    prompts, negative prompts (SD3's CFG; FLUX ignores them), guidance, steps, strengths, images and masks."""
    from .families import edit_cases
    from workers.request.spec import ItemSpec

    out = []
    for i in range(plain + inpaint):
        edit = {} if i < plain and i % 3 == 0 else dict(image=edit_cases.image_bytes(seed=i),
                                                        strength=STRENGTHS[i % 4])
        if i >= plain:
            edit["mask"] = edit_cases.mask_bytes(box=BOXES[i % 4])
        out.append(ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=6 + i % 5, guidance=1.5 + i % 4,
                            prompt=PROMPTS[i % 5], negative_prompt="small" if i % 2 else "", **edit))
    return out


def _fallbacks(group_stats: dict) -> int:
    return sum(s["eager_fallbacks"] + s["capture_failures"] for s in group_stats["buckets"].values())


@pytest.mark.parametrize("backend", ["full", "breakable"])
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_text_image_to_image_and_inpainting_rows_replay_what_eager_computes(tiny, family, backend):
    from workers.engine import Engine

    model, specs = tiny[family], _specs(13, 7)
    graphs = Engine(model, WorkerConfig(backend=backend, max_batch=8))
    graphs.warmup()  # the family's step; the inpainting variant is captured when its first rows arrive
    got = graphs.generate(specs)
    want = Engine(model, WorkerConfig(backend="eager", max_batch=8)).generate(specs)
    for g, w in zip(got, want):
        assert g.latents.shape == w.latents.shape
        err = ((g.latents - w.latents).abs().max() / w.latents.abs().max()).item()
        assert err <= 1e-5, (g.request.id, err)
    groups = graphs.stats()["groups"]
    assert len(groups) == 2 and sum(k.endswith(":inpaint") for k in groups) == 1
    for key, stats in groups.items():
        assert stats["backend"] == backend and _fallbacks(stats) == 0, (key, stats)
        assert all(s["captures"] == 1 for s in stats["buckets"].values()), (key, stats)
        replayed = {b for b, s in stats["buckets"].items() if s["replays"]}
        if key.endswith(":inpaint"):  # 7 = 4 + 2 + 1 while all are active (or padded: 8, 4 + 4)
            assert replayed & {4, 8}, replayed
        else:  # 13 = 8 + 4 + 1
            assert 8 in replayed and replayed - {8}, replayed


def _inpainting_rows(model, b: int) -> dict[str, torch.Tensor]:
    """The inpainting step's inputs for b rows as admission makes them: each its own prompt, image, mask, strength
    and step of its cut plan (a second row per prompt at another step)."""
    from workers.edits import EDIT_INPUTS
    from workers.engine import Engine, table_inputs

    engine = Engine(model, WorkerConfig(backend="eager", max_batch=8))
    specs = _specs(0, b)
    engine.add_many(specs)
    (group,) = [g for k, g in engine.groups.items() if k.variant == "inpaint"]
    active = group.active
    for i, a in enumerate(active):
        a.step = i % a.plan.num_steps
    rows = torch.stack([a.rows[a.step] for a in active])
    live = dict(x=torch.stack([a.x for a in active]), t=rows[:, 0], coeffs=rows[:, 1:],
                guidance=torch.stack([a.guidance for a in active]), hist=torch.stack([a.hist for a in active]) + 0.1,
                noise=torch.zeros((b, *group.shape), device=model.device),
                **{k: torch.stack([a.cond[k] for a in active]) for k in active[0].cond},
                **{k: torch.stack([a.edit[k] for a in active]) for k in EDIT_INPUTS if k != "blend"},
                blend=torch.stack([a.edit["blend"][a.step] for a in active]))
    return table_inputs(model, live)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_each_inpainting_bucket_replays_what_eager_computes(tiny, family):
    from graphs import GraphRunner
    from workers.edits import inpainting
    from workers.engine import step_specs
    from workers.families import family_of

    model = tiny[family]
    shape = tuple(model.latent_shape)
    buckets = (1, 2, 4, 8)
    live = {b: _inpainting_rows(model, b) for b in buckets}
    outs = {}
    for backend in ("eager", "full"):
        inputs, outputs = step_specs(model, shape, "inpaint")
        runner = GraphRunner(inpainting(family_of(model).make_step(model, shape)), inputs, outputs, max_batch=8,
                             backend=backend, device=model.device)
        runner.warmup(example=live[8])
        runner.replay_ms = {}  # greedy plans: b rows in bucket b, the shape eager runs
        for b in buckets:
            assert runner.plan(b) == (b,)
            outs.update({(backend, b, k): v.float().cpu() for k, v in runner.run(**live[b]).items()})
        if backend == "full":
            totals = runner.stats()["totals"]
            assert totals["captures"] == len(buckets) and totals["eager_fallbacks"] == 0
    for b in buckets:
        for key in ("x_next", "hist_next"):
            want, got = outs["eager", b, key], outs["full", b, key]
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert torch.isfinite(got).all() and err <= 1e-5, (family, b, key, err)
