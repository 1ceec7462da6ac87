"""The batch engine on a CPU: a request's image does not depend on its batch, bucket, join time or
neighbours; join / leave / cancel bookkeeping; progress."""

from collections import defaultdict

import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.request.spec import ItemSpec
from workers.loading import load_model

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return load_model("digits")


def engine(model, max_batch=8):
    return Engine(model, WorkerConfig(backend="eager", max_batch=max_batch))


def req(i, **kw):
    base = dict(id=f"r{i}", label=i % 10, seed=100 + i, sampler="ddim", steps=6, guidance=2.0)
    return ItemSpec(**{**base, **kw})


def alone(model, r):
    return engine(model).generate([r])[0].latents


def close(a, b):
    return (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


def test_thirteen_requests_are_8_4_1_replays_and_match_alone(model):
    e = engine(model, max_batch=8)
    reqs = [req(i) for i in range(13)]
    results = e.generate(reqs)
    stats = next(iter(e.stats()["groups"].values()))
    per_bucket = {b: s["replays"] + s["eager_fallbacks"] for b, s in stats["buckets"].items()}
    assert per_bucket == {8: 6, 4: 6, 2: 0, 1: 6}  # 6 steps, each 8 + 4 + 1
    for r in (results[0], results[9], results[12]):
        assert close(r.latents, alone(model, r.request))


def test_mixed_samplers_steps_and_guidance_share_a_batch(model):
    reqs = [req(0, sampler="ddim", steps=5), req(1, sampler="euler", steps=7, guidance=1.0),
            req(2, sampler="dpmpp_2m", steps=4, guidance=3.0), req(3, sampler="euler_a", steps=6),
            req(4, sampler="ddpm", steps=3, guidance=0.0), req(5, sampler="ddim", steps=5, eta=1.0)]
    results = engine(model).generate(reqs)
    assert [r.request.id for r in results] == [r.id for r in reqs]
    for r in results:
        assert close(r.latents, alone(model, r.request)), r.request


def test_joining_mid_flight_gives_the_same_image(model):
    e = engine(model)
    early, late = req(0, steps=8), req(1, steps=6)
    e.add(early)
    for _ in range(3):
        assert e.step() == []
    e.add(late)  # joins at a step boundary while `early` is at step 3
    done = {}
    while e.num_active:
        done.update({r.request.id: r for r in e.step()})
    assert close(done["r0"].latents, alone(model, early))
    assert close(done["r1"].latents, alone(model, late))


def test_padding_rows_do_not_change_real_rows(model):
    """Three requests replayed in a bucket of 4 (one padding row) equal the same run unpadded."""
    e = engine(model, max_batch=4)
    e.groups[next(iter(e.groups))].runner.replay_ms = {1: 10.0, 2: 10.0, 4: 1.0}  # padding to 4 wins
    results = e.generate([req(i) for i in range(3)])
    stats = next(iter(e.stats()["groups"].values()))["buckets"]
    assert stats[4]["replays"] + stats[4]["eager_fallbacks"] == 6 and stats[2]["eager_fallbacks"] == 0
    for r in results:
        assert close(r.latents, alone(model, r.request))


def test_progress_counts_each_step_once_and_cancel_leaves_at_the_boundary(model):
    e = engine(model)
    seen = defaultdict(list)
    for i in range(3):
        e.add(req(i, steps=5))
    e.step(lambda rid, s, n: seen[rid].append((s, n)))
    e.step(lambda rid, s, n: seen[rid].append((s, n)))
    assert e.cancel("r1") and not e.cancel("r1") and not e.cancel("nope")
    assert e.progress() == {"r0": (2, 5), "r2": (2, 5)}
    finished = []
    while e.num_active:
        finished += e.step(lambda rid, s, n: seen[rid].append((s, n)))
    assert sorted(r.request.id for r in finished) == ["r0", "r2"]
    assert seen["r0"] == [(s, 5) for s in range(1, 6)] and seen["r1"] == [(1, 5), (2, 5)]


def test_unknown_model_in_request(model):
    with pytest.raises(KeyError, match="not loaded"):
        engine(model).add(req(0, model="other"))


def test_images_are_uint8_at_native_resolution(model):
    (r,) = engine(model).generate([req(3, steps=4)])
    assert r.image.shape == (8, 8) and r.image.dtype.name == "uint8"
    assert torch.isfinite(r.latents).all()


def _run_with_previews(model, reqs):
    eng, finished, previews = engine(model), {}, []
    eng.add_many(reqs)
    while eng.num_active:
        for r in eng.step():
            finished[r.request.id] = r
        previews += [(p.request_id, p.step, p.image) for p in eng.take_previews()]
    return finished, previews + [(p.request_id, p.step, p.image) for p in eng.take_previews(wait=True)]


def test_previews_at_every_nth_step_only_for_requests_that_asked(model):
    # steps 7, every 2: previews after steps 2, 4, 6 (never the last); every 3 of 6 steps: 3 only (6 is the last)
    reqs = [req(0, steps=7, preview_every=2), req(1, steps=6, preview_every=3), req(2, steps=7)]
    _, previews = _run_with_previews(model, reqs)
    steps = defaultdict(list)
    for rid, step, img in previews:
        steps[rid].append(step)
        assert img.dtype.name == "uint8" and img.shape == (8, 8)  # digits: 1-channel pixels, 8 x 8
    assert dict(steps) == {"r0": [2, 4, 6], "r1": [3]}
    _, none = _run_with_previews(model, [req(3), req(4, preview_every=0)])
    assert none == []


def test_previews_never_change_the_images(model):
    reqs = [req(i, steps=6, sampler=s) for i, s in enumerate(("ddim", "euler_a", "dpmpp_2m"))]
    with_previews, _ = _run_with_previews(model, [ItemSpec(**{**r.__dict__, "preview_every": 1}) for r in reqs])
    without, _ = _run_with_previews(model, reqs)
    for r in reqs:
        assert torch.equal(with_previews[r.id].latents, without[r.id].latents)
        assert (with_previews[r.id].image == without[r.id].image).all()


def test_a_preview_is_the_denoised_estimate(model):
    # digits is pixel space: the preview at step k is hist (the denoised estimate) as uint8
    eng = engine(model)
    eng.add(req(0, steps=4, preview_every=1))
    eng.step()
    hist = eng.groups[next(iter(eng.groups))].active[0].hist
    (p,) = eng.take_previews(wait=True)
    expected = ((hist[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    assert p.step == 1 and (p.image == expected).all()


def test_a_models_own_speed_overrides_the_workers(model):
    """``model_speed`` gives one model compiled steps ("fast") while another runs the worker-wide speed, and
    the other way round; an unknown speed is refused."""
    text = load_model("digits-text")
    for default, own in (("default", "fast"), ("fast", "default")):
        cfg = WorkerConfig(backend="eager", max_batch=4, speed=default, model_speed={"digits-text": own})
        eng = Engine([model, text], cfg)  # compiles lazily: nothing is compiled until a step runs
        compiled = {g.model.name: g.compiled is not None for g in eng.groups.values()}
        assert compiled == {"digits": default == "fast", "digits-text": own == "fast"}
    with pytest.raises(ValueError, match="model_speed"):
        WorkerConfig(model_speed={"digits": "fastest-ever"})


def test_the_graphs_backend_captures_a_step_without_breaks_whole_and_keeps_breaks_where_a_family_has_them(model):
    """backend "graphs": a class-conditional DiT's step is one whole-step graph (full); PixArt with varlen
    cross-attention (an eager break per layer) keeps breakable graphs, padded cross-attention goes whole.
    The workers' and ``generate``'s "auto" is "graphs" on CUDA and eager on a CPU."""
    from workers.engine import auto_backend, backend_for
    from workers.families import family_named

    pixart = family_named("pixart")

    assert backend_for("graphs", model) == "full"
    assert backend_for("breakable", model) == "breakable"
    text = load_model("digits-text")
    pixart.set_cross_attention(text, "varlen")
    assert backend_for("graphs", text) == "breakable"
    pixart.set_cross_attention(text, "padded")
    assert backend_for("graphs", text) == "full"
    assert auto_backend("cuda:1") == "graphs" and auto_backend("cpu") == "eager"
    # on a CPU the runner runs the step eagerly, whatever the backend: the images are the eager engine's
    r, own = req(3), load_model("digits")  # its own copy: the graph backends patch the model they run
    got = Engine(own, WorkerConfig(backend="graphs", max_batch=4)).generate([r])[0].latents
    assert close(got, alone(model, r))


def test_the_shapes_in_flight_are_the_active_requests_admission_keys(model):
    from workers.request.admission import spec_shape

    e = engine(model)
    assert e.in_flight_shapes() == set()
    a, b = req(0, model="digits"), req(1, steps=1)
    e.add_many([a, b])
    assert e.in_flight_shapes() == {spec_shape(a), spec_shape(b)} == {("digits", 0, 0), ("", 0, 0)}
    e.step()  # b finishes after its one step
    assert e.in_flight_shapes() == {spec_shape(a)}


def test_warm_up_runs_on_a_requests_inputs_not_zeros(model):
    """The buckets are warmed (and, on a GPU, timed for the splitter) on one row as a request makes it,
    tiled: the class model's label, its default sampler's coefficients at the middle step, seeded noise."""
    e = engine(model, max_batch=4)
    group = next(iter(e.groups.values()))
    example = e.warmup_example(model, group.shape)
    assert set(example) == set(group.runner._in)
    assert all(v.shape[0] == 1 for v in example.values())
    assert example["x"].abs().sum() > 0 and example["coeffs"].abs().sum() > 0
    assert float(example["guidance"]) == model.card.defaults["guidance"]
    e.warmup()
    x = group.runner.arena.tensor("in:x")  # every bucket's static rows hold the example, tiled
    assert torch.equal(x, example["x"].expand_as(x))


def test_a_text_models_warm_up_example_is_a_real_prompt_and_the_empty_negative(tmp_path):
    from workers.engine import WARMUP_PROMPT
    from workers.models.tiny_pixart import make_tiny_pixart

    text = load_model(make_tiny_pixart(tmp_path / "pixart"))
    e = engine(text, max_batch=2)
    group = next(iter(e.groups.values()))
    example = e.warmup_example(text, group.shape)
    kept, neg = int(example["prompt_mask"].sum()), int(example["neg_mask"].sum())
    tokens = len(text.tokenizer(WARMUP_PROMPT.lower()).input_ids)
    assert kept == min(tokens, text.card.max_tokens) and 1 <= neg < kept  # zeros would keep no key at all
    e.warmup()
    r = ItemSpec(id="a", prompt="a cat", seed=3, sampler="dpmpp_2m", steps=3, guidance=4.5)
    assert torch.isfinite(e.generate([r])[0].latents).all()


def test_a_failed_warm_up_example_leaves_warm_up_on_zeros(model, monkeypatch, caplog):
    from workers import engine as engine_mod

    e = engine(model, max_batch=2)
    monkeypatch.setattr(engine_mod.Engine, "_example", staticmethod(lambda *a: 1 / 0))
    with caplog.at_level("WARNING", logger=engine_mod.log.name):
        assert e.warmup_example(model, next(iter(e.groups.values())).shape) is None
        e.warmup()
    assert "warm-up runs on zeros" in caplog.text
    assert e.generate([req(1)])[0].image.shape[:2] == (model.card.image_size,) * 2




def test_a_removed_model_leaves_with_its_groups_and_only_once_its_requests_have(model):
    """``remove_model``: the model's groups (graphs, arenas) go and its requests are refused after; while one of
    its requests runs it stays (cancel them first); the other model keeps serving, and can come back."""
    text = load_model("digits-text")
    e = Engine([model, text], WorkerConfig(backend="eager", max_batch=4))
    e.warmup()
    e.add(req(0, model="digits-text", prompt="a three"))
    with pytest.raises(ValueError, match="still runs 1 request"):
        e.remove_model("digits-text")
    e.cancel("r0")
    assert e.remove_model("digits-text") is text
    assert set(e.models) == {"digits"} and {k.model for k in e.groups} == {"digits"} and "digits-text" not in e.speed
    with pytest.raises(KeyError, match="not loaded here"):
        e.add(req(1, model="digits-text", prompt="a three"))
    with pytest.raises(KeyError, match="not loaded here"):
        e.remove_model("digits-text")
    assert e.generate([req(2, model="digits")])[0].image.shape == (8, 8)
    e.add_model(text)
    assert e.generate([req(3, model="digits-text", prompt="a three")])[0].image.shape == (8, 8)
