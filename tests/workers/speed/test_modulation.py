"""SD3's and FLUX.1's modulation linears hoisted into one product of the step's embedding
(``workers.speed.modulation``): the transformer computes what it computed, each norm reads its slice of the one
product, the weights are views of one stack, and the engine hoists under the graph backends only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.config import WorkerConfig
from workers.speed import SpeedConfig
from workers.speed import fp8, modulation

from tests.workers.families.test_flux_fast import _flux_call


@pytest.fixture
def tiny_flux(tmp_path):
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux

    return load_model(make_tiny_flux(tmp_path / "flux"))


def _sd3_call(tr, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = tr.config
    return dict(hidden_states=torch.randn(2, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g),
                encoder_hidden_states=torch.randn(2, 7, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=g),
                timestep=torch.tensor([500.0, 20.0]))


def _watch(linears):
    """Whether each linear was called with its hoisted slice in place (forward hooks, eager calls)."""
    seen = []
    handles = [lin.register_forward_hook(lambda mod, a, out: seen.append(mod._hoisted is not None and out is mod._hoisted))
               for lin in linears]
    return seen, handles


def test_flux_norms_read_their_slices_of_one_product_and_the_output_is_the_same(tiny_flux, monkeypatch):
    tr = tiny_flux.transformer
    inputs = _flux_call(tr)
    keys = set(tr.state_dict())
    with torch.no_grad():
        want = tr(**inputs).sample
        assert modulation.hoist_temb_modulation(tr)
        cache = tr._temb_modulation
        # a double block's two norms, the single block's, the output norm's
        assert modulation.hoisted(tr) == len(cache.linears) == 2 * len(tr.transformer_blocks) + \
            len(tr.single_transformer_blocks) + 1
        computed = []
        real = cache.compute
        monkeypatch.setattr(cache, "compute", lambda temb: computed.append(temb.shape) or real(temb))
        seen, handles = _watch(cache.linears)
        got = tr(**inputs).sample
    for h in handles:
        h.remove()
    assert computed == [(2, tr.config.num_attention_heads * tr.config.attention_head_dim)]  # once a forward
    assert seen == [True] * len(cache.linears)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(lin._hoisted is None for lin in cache.linears)  # taken back after the forward
    assert set(tr.state_dict()) == keys
    ptr = cache.weight.untyped_storage().data_ptr()
    assert all(lin.weight.untyped_storage().data_ptr() == ptr for lin in cache.linears)
    assert cache.weight.shape == (sum(cache.widths), cache.linears[0].in_features)


def test_hoisting_again_keeps_the_stack_and_restoring_gives_plain_linears(tiny_flux):
    tr = tiny_flux.transformer
    inputs = _flux_call(tr, seed=1)
    with torch.no_grad():
        want = tr(**inputs).sample
        assert modulation.hoist_temb_modulation(tr)
        cache = tr._temb_modulation
        assert modulation.hoist_temb_modulation(tr) and tr._temb_modulation is cache  # the same stacked weights
        assert len(tr.time_text_embed._forward_hooks) == 1 and len(tr._forward_hooks) == 1  # not hooked twice
        modulation.restore_temb_modulation(tr)
        assert modulation.hoisted(tr) == 0 and all(type(lin) is nn.Linear for lin in cache.linears)
        assert not tr.time_text_embed._forward_hooks and not tr._forward_hooks
        torch.testing.assert_close(tr(**inputs).sample, want, rtol=1e-5, atol=1e-6)
        assert modulation.hoist_temb_modulation(tr) and tr._temb_modulation is cache


def test_a_block_called_outside_a_transformer_forward_multiplies_its_own(tiny_flux):
    tr = tiny_flux.transformer
    block = tr.single_transformer_blocks[0]
    g = torch.Generator().manual_seed(2)
    d = block.norm.linear.in_features
    args = dict(hidden_states=torch.randn(2, 6, d, generator=g), encoder_hidden_states=torch.randn(2, 3, d, generator=g),
                temb=torch.randn(2, d, generator=g))
    with torch.no_grad():
        want = block(**args)
        modulation.hoist_temb_modulation(tr)
        tr(**_flux_call(tr))  # leaves nothing behind
        got = block(**args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sd3_and_sd35_norms_are_hoisted_too(tmp_path):
    from workers.loading import load_model
    from workers.models.tiny_sd3 import make_tiny_sd3

    tr = load_model(make_tiny_sd3(tmp_path / "sd3")).transformer
    inputs = _sd3_call(tr)
    with torch.no_grad():
        want = tr(**inputs).sample
        assert modulation.hoist_temb_modulation(tr)
        kinds = {type(m).__name__ for m in tr.modules() if getattr(m, "linear", None) in tr._temb_modulation.linears}
        # SD3.5's dual-attention norm and the last block's continuous one (FLUX.1's single-block norm is not SD3's)
        assert kinds == set(modulation.NORM_TYPES) - {"AdaLayerNormZeroSingle"}
        got = tr(**inputs).sample
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fp8_flux_with_fused_norms_reads_the_hoisted_modulation(tmp_path):
    from workers.speed import norm_fusion

    from tests.workers.families.test_flux_fast import _tiny_flux_fp8

    tr = _tiny_flux_fp8(tmp_path, fp8_attention=True).transformer
    norm_fusion.fuse_block_norms(tr)
    inputs = _flux_call(tr)
    with torch.no_grad():
        want = tr(**inputs).sample
        assert modulation.hoist_temb_modulation(tr)
        seen, handles = _watch(tr._temb_modulation.linears)
        got = tr(**inputs).sample
    for h in handles:
        h.remove()
    assert seen and all(seen)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_compiled_transformer_hoists_in_one_graph(tiny_flux):
    tr = tiny_flux.transformer
    inputs = _flux_call(tr, seed=3)
    with torch.no_grad():
        want = tr(**inputs).sample
        modulation.hoist_temb_modulation(tr)
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        got = torch.compile(tr, backend="eager", fullgraph=True)(**inputs).sample
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_other_models_are_left_alone(tmp_path):
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_pixart import make_tiny_pixart

    assert not modulation.hoist_temb_modulation(load_model(make_tiny_pixart(tmp_path / "p")).transformer)
    tr = load_model(make_tiny_flux(tmp_path / "f")).transformer
    assert modulation.hoisted(tr) == 0


def test_the_engine_hoists_under_the_graph_backends_only(tiny_flux):
    from workers.engine import Engine

    tr = tiny_flux.transformer
    Engine(tiny_flux, WorkerConfig(backend="graphs", max_batch=2))
    assert modulation.hoisted(tr) == len(tr._temb_modulation.linears) > 0
    Engine(tiny_flux, WorkerConfig(backend="eager", max_batch=2))
    assert modulation.hoisted(tr) == 0
    Engine(tiny_flux, WorkerConfig(backend="graphs", max_batch=2), speed=SpeedConfig(hoist_modulation=False))
    assert modulation.hoisted(tr) == 0


@pytest.mark.slow
def test_hoisted_sd3_blocks_compile_once_for_every_bucket_and_make_the_eager_latents(tmp_path):
    """The tiny SD3.5 layout through the engine's blocks-scope compile (Inductor on a CPU) with the modulation
    hoisted: the views' rows dynamic as the blocks' arguments are, so nothing falls back and no block recompiles
    across buckets; the latents those of the eager engine."""
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.models.tiny_sd3 import make_tiny_sd3
    from workers.request.spec import ItemSpec

    model = load_model(make_tiny_sd3(tmp_path / "sd3"))
    specs = [ItemSpec(id=str(i), seed=i, sampler="flow_euler", steps=2, guidance=4.0,
                      prompt=("a red cat", "a blue house", "a dog")[i % 3]) for i in range(7)]
    want = Engine(model, WorkerConfig(backend="eager", max_batch=4)).generate(specs)
    engine = Engine(model, WorkerConfig(backend="graphs", max_batch=4), speed=SpeedConfig(compile="inductor", compile_scope="blocks"))
    assert modulation.hoisted(model.transformer) == len(model.transformer._temb_modulation.linears) > 0
    got = engine.generate(specs)
    (stats,) = engine.stats()["groups"].values()
    assert stats["compile"]["compiled"] and stats["compile"]["fallback_reason"] is None, stats["compile"]
    assert stats["compile"]["graphs"] == 1, stats["compile"]  # one batch-dynamic compile for buckets 2 and 4
    for g, w in zip(got, want):
        torch.testing.assert_close(g.latents, w.latents, rtol=1e-4, atol=1e-4)


def test_without_room_for_two_copies_the_stack_goes_through_host_memory(tiny_flux, monkeypatch):
    tr = tiny_flux.transformer
    inputs = _flux_call(tr, seed=4)
    with torch.no_grad():
        want = tr(**inputs).sample
        staged = []
        real_cpu = torch.Tensor.cpu
        monkeypatch.setattr(fp8, "_free_bytes", lambda device: 0)
        monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: staged.append(self.shape) or real_cpu(self, *a, **k))
        assert modulation.hoist_temb_modulation(tr)
        monkeypatch.undo()
        got = tr(**inputs).sample
    cache = tr._temb_modulation
    assert len(staged) == 2 * len(cache.linears)  # every weight and bias, once
    ptr = cache.weight.untyped_storage().data_ptr()
    assert all(lin.weight.untyped_storage().data_ptr() == ptr for lin in cache.linears)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _tiny(kind, tmp_path):
    from workers.loading import load_model
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_sd3 import make_tiny_sd3

    make = make_tiny_flux if kind == "flux" else make_tiny_sd3
    return load_model(make(tmp_path / kind))


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_each_requests_modulation_table_gives_the_steps_what_their_own_product_gives(kind, tmp_path, monkeypatch):
    """With tables (the default), the engine computes a request's modulation for all of its steps at admission:
    one product per admitted batch, none in a step, and the embedding's own layers run only for the tables;
    the latents are those of the engine that multiplies every step (tables off) and of the eager engine."""
    from workers.engine import Engine, step_specs
    from workers.request.spec import ItemSpec

    model = _tiny(kind, tmp_path)
    tr = model.transformer
    d = model.card.defaults
    specs = [ItemSpec(id=str(i), seed=i, sampler=d["sampler"], steps=3 + i, guidance=(3.5, 5.0, 7.0)[i],
                      prompt=("a red cat", "a blue house", "a dog")[i]) for i in range(3)]
    want = Engine(model, WorkerConfig(backend="eager", max_batch=2)).generate(specs)
    engine = Engine(model, WorkerConfig(backend="graphs", max_batch=2))
    cache = tr._temb_modulation
    rows = 2 if kind == "sd3" else 1
    assert tuple(step_specs(model)[0]["modulation"].shape_per_sample) == ((2, cache.width) if rows == 2 else (cache.width,))
    products, embeds = [], []
    cache.product.register_forward_hook(lambda mod, a, out: products.append(out.shape[0]))
    tr.time_text_embed.timestep_embedder.register_forward_hook(lambda mod, a, out: embeds.append(out.shape[0]))
    engine.add_many(specs)  # admitted together: one product for the three requests' steps
    done = {}
    while engine.num_active:
        done.update({r.request.id: r for r in engine.step()})
    got = [done[s.id] for s in specs]
    steps = sum(s.steps for s in specs)
    assert products == [rows * steps] and embeds == [rows * steps]  # and none in the 6 steps
    assert cache.given is None and all(lin._hoisted is None for lin in cache.linears)  # nothing left behind
    for g, w in zip(got, want):
        torch.testing.assert_close(g.latents, w.latents, rtol=1e-4, atol=1e-4)


def test_a_table_row_is_the_product_and_embedding_the_forward_computes_at_that_step(tiny_flux):
    """``step_tables``' rows against what the hoisted forward itself multiplies at the same timestep, guidance
    and pooled prompt (the step's inputs as the engine gives them), then the embedding it multiplies (which the
    embedding's stand-in returns where the table is given: what a wrapped linear's term reads)."""
    from samplers import make_plan
    from workers.engine import Engine
    from workers.families import family_named
    from workers.request.spec import ItemSpec

    model, flux = tiny_flux, family_named("flux")
    Engine(model, WorkerConfig(backend="graphs", max_batch=2))
    d = model.card.defaults
    spec = ItemSpec(id="a", seed=0, sampler=d["sampler"], steps=4, guidance=4.5, prompt="a red cat")
    plan = make_plan(spec.sampler, spec.steps, model.schedule, **flux.plan_kwargs(model, tuple(model.latent_shape)))
    cond = flux.encode(model, [spec])[0]
    (table,) = flux.step_tables(model, [plan], [spec], [cond])
    cache = model.transformer._temb_modulation
    seen, embeds = [], []
    cache.product.register_forward_hook(lambda mod, a, out: seen.append(out))
    model.transformer.time_text_embed.register_forward_hook(lambda mod, a, out: embeds.append(out))
    step = flux.make_step(model)
    c, h, w = model.latent_shape
    args = lambda i: (torch.randn(1, c, h, w), plan.timesteps[i:i + 1], torch.tensor([spec.guidance]),
                      plan.coeffs[i:i + 1], torch.zeros(1, c, h, w), torch.zeros(1, c, h, w),
                      cond["prompt_embeds"][None], cond["pooled"][None])
    width = sum(cache.widths)
    assert table["modulation"].shape == (plan.num_steps, width + cache.linears[0].in_features) \
        and cache.width == width + cache.linears[0].in_features
    for i in range(plan.num_steps):
        seen.clear()
        embeds.clear()
        with torch.no_grad():
            step(*args(i))
            (product,), (temb,) = seen, embeds
            torch.testing.assert_close(table["modulation"][i, :width], product[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(table["modulation"][i, width:], temb[0], rtol=1e-5, atol=1e-6)
            step(*args(i), modulation=table["modulation"][i:i + 1])  # the stand-in returns the table's embedding
        assert len(seen) == 1 and torch.equal(embeds[-1], table["modulation"][i:i + 1, width:])


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_a_step_reading_its_table_traces_in_one_graph(kind, tmp_path):
    """A compiled step (the engine's "step" scope) traces the table's hand-over, the embedding's stand-in and
    FLUX.1's rotary tables without a break, and computes what the step computes uncompiled."""
    from workers.engine import Engine
    from workers.families import family_of

    model = _tiny(kind, tmp_path)
    Engine(model, WorkerConfig(backend="graphs", max_batch=2))  # hoists the modulation
    example = Engine._example(model, tuple(model.latent_shape))
    assert "modulation" in example
    step = family_of(model).make_step(model)
    with torch.no_grad():
        want = step(**example)
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        got = torch.compile(step, backend="eager", fullgraph=True)(**example)
    assert counters["stats"]["unique_graphs"] == 1
    assert model.transformer._temb_modulation.given is None
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
