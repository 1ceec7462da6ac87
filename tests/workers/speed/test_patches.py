"""The attention break patch computes what diffusers' own attention computes."""

import torch

from workers.config import WorkerConfig
from workers.speed.apply import to_precision
from workers.speed import SpeedConfig
from workers.loading import load_model
from workers.speed.patches import break_attention, restore_attention


def _forward(m, x, t, y):
    with torch.no_grad():
        return m.transformer(x, t, y).sample


def test_patched_attention_matches_diffusers_and_shares_one_scratch():
    m = load_model("digits")
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(6, 1, 8, 8, generator=g), torch.tensor([1, 50, 300, 700, 999, 10]), torch.arange(6)
    want = _forward(m, x, t, y)
    assert break_attention(m.transformer) == 4
    procs = [blk.attn1.processor for blk in m.transformer.transformer_blocks]
    assert len({id(p.scratch) for p in procs}) == 1  # one boundary allocation for all layers
    got = _forward(m, x, t, y)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    buf = procs[0].scratch.buffer
    _forward(m, x[:2], t[:2], y[:2])  # a smaller batch reuses the same allocation
    assert procs[0].scratch.buffer is buf
    restore_attention(m.transformer)
    assert torch.equal(_forward(m, x, t, y), want)


def test_fused_qkv_matches_separate_projections_and_adds_no_weights():
    """``break_attention`` fuses each block's q, k, v projections into one product (its weights are the
    same memory as to_q, to_k, to_v); the model computes what it computes with them separate, in float32
    and with FP8 linears."""
    from workers.speed.fp8 import quantize_linears

    g = torch.Generator().manual_seed(1)
    x, t, y = torch.randn(5, 1, 8, 8, generator=g), torch.tensor([3, 90, 400, 800, 999]), torch.arange(5)
    for fp8 in (False, True):
        m = load_model("digits")
        if fp8:
            quantize_linears(m.transformer)
        break_attention(m.transformer, fuse_qkv=False)
        want = _forward(m, x, t, y)
        break_attention(m.transformer)
        procs = [blk.attn1.processor for blk in m.transformer.transformer_blocks]
        assert all(p.qkv is not None for p in procs)
        attn, qkv = m.transformer.transformer_blocks[0].attn1, procs[0].qkv
        first = (lambda mod: mod.weight) if not fp8 else (lambda mod: mod.weight_fp8)
        assert first(attn.to_q).data_ptr() == first(qkv).data_ptr()  # views of the fused weight, not copies
        assert first(attn.to_k).data_ptr() == first(qkv).data_ptr() + first(attn.to_q).nbytes
        torch.testing.assert_close(_forward(m, x, t, y), want, rtol=1e-5, atol=1e-5)


def test_patching_a_model_again_keeps_the_fused_weights_the_first_patch_made():
    """A second engine on one model patches it again: the fused q|k|v modules must be the first patch's
    (same memory), or the first engine's captured graphs would read a freed weight (seen on a GPU as NaN
    images from the engine built first). A part replaced since (FP8 after fusing) is fused afresh."""
    from workers.speed.fp8 import quantize_linears
    from workers.speed.fp8 import fuse_linears

    m = load_model("digits")
    g = torch.Generator().manual_seed(2)
    x, t, y = torch.randn(3, 1, 8, 8, generator=g), torch.tensor([5, 500, 900]), torch.arange(3)
    break_attention(m.transformer)
    first = [blk.attn1.processor.qkv for blk in m.transformer.transformer_blocks]
    ptrs = [q.weight.data_ptr() for q in first]
    want = _forward(m, x, t, y)
    restore_attention(m.transformer)
    break_attention(m.transformer)
    again = [blk.attn1.processor.qkv for blk in m.transformer.transformer_blocks]
    assert all(a is b for a, b in zip(again, first))
    assert [q.weight.data_ptr() for q in again] == ptrs
    assert torch.equal(_forward(m, x, t, y), want)
    attn = m.transformer.transformer_blocks[0].attn1
    assert "_fused_into" not in dict(attn.to_q.named_modules()) and not any(
        "fused" in k for k in m.transformer.state_dict())  # a plain reference, not a submodule
    assert fuse_linears([attn.to_k, attn.to_q, attn.to_v]) is not first[0]  # other parts (order): a new fusion
    quantize_linears(m.transformer)  # the block linears replaced: their fusion is new
    break_attention(m.transformer)
    assert m.transformer.transformer_blocks[0].attn1.processor.qkv is not first[0]


def test_graph_backends_run_the_patched_attention_and_eager_and_the_switch_keep_diffusers():
    """``full`` captures the same patched self-attention that ``breakable`` breaks at (fused q, k, v, the
    kernel per shape), and computes what eager diffusers attention computes; ``eager`` and
    ``attention_patch=False`` keep diffusers' processor."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    from workers.engine import Engine
    from workers.request.spec import ItemSpec
    from workers.speed.patches import BreakableSelfAttention

    reqs = [ItemSpec(id=f"r{i}", label=i, seed=i, sampler="ddim", steps=3, guidance=2.0) for i in range(3)]
    want = Engine(load_model("digits"), WorkerConfig(backend="eager", max_batch=4)).generate(reqs)
    for backend, patch, kind in (("full", True, BreakableSelfAttention), ("breakable", True, BreakableSelfAttention),
                                 ("full", False, AttnProcessor2_0), ("eager", True, AttnProcessor2_0)):
        m = load_model("digits")
        got = Engine(m, WorkerConfig(backend=backend, max_batch=4), speed=SpeedConfig(attention_patch=patch)).generate(reqs)
        procs = [blk.attn1.processor for blk in m.transformer.transformer_blocks]
        assert all(type(p) is kind for p in procs), (backend, patch)
        assert kind is AttnProcessor2_0 or all(p.qkv is not None for p in procs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=1e-5)


def _inputs(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    c, h, w = m.latent_shape
    x = torch.randn(n, c, h, w, generator=g)
    t = torch.randint(0, 1000, (n,), generator=g)
    y = torch.randint(0, m.num_classes + 1, (n,), generator=g)  # the null class (CFG) included
    return x, t, y


def test_hoisted_modulation_computes_what_each_block_computes_in_views_of_the_same_weights(tmp_path):
    """Every block's adaLN-Zero modulation computed at once (stacked timestep MLPs, class tables and
    modulation linears) gives the transformer's own output, for the digits model and DiT-XL/2's layout
    (tiny), with the blocks' weights as views of the stacks (no memory added); restoring brings the blocks'
    own path back; patching again reuses the stacks."""
    from workers.models.tiny_dit import write_tiny_dit
    from workers.speed.patches import hoist_modulation, restore_modulation

    write_tiny_dit(tmp_path / "tiny-dit")
    for m in (load_model("digits"), load_model(tmp_path / "tiny-dit")):
        x, t, y = _inputs(m, 5, 3)
        want = _forward(m, x, t, y)
        weights = sum(p.numel() for p in m.transformer.parameters())
        assert hoist_modulation(m.transformer)
        cache = m.transformer._hoisted_modulation
        torch.testing.assert_close(_forward(m, x, t, y), want, rtol=1e-5, atol=1e-5)
        blocks = m.transformer.transformer_blocks
        assert cache.value.shape == (len(blocks), 5, 6 * blocks[0].norm1.linear.in_features)
        for i, blk in enumerate(blocks):  # views of the stacks: the same memory
            assert blk.norm1.linear.weight.data_ptr() == cache.wm[i].data_ptr()
            assert blk.norm1.emb.timestep_embedder.linear_2.weight.data_ptr() == cache.w2[i].data_ptr()
            assert blk.norm1.emb.class_embedder.embedding_table.weight.data_ptr() == cache.tables[i].data_ptr()
        assert sum(p.numel() for p in m.transformer.parameters()) == weights
        assert not any("hoisted" in k for k in m.transformer.state_dict())
        assert hoist_modulation(m.transformer) and m.transformer._hoisted_modulation is cache
        restore_modulation(m.transformer)
        cache.value = None
        torch.testing.assert_close(_forward(m, x, t, y), want, rtol=1e-5, atol=1e-5)
        assert cache.value is None  # the blocks' own path again


def test_hoisting_leaves_other_families_alone_and_the_engine_hoists_under_graph_backends(tmp_path):
    from workers.engine import Engine
    from workers.models.tiny_pixart import make_tiny_pixart
    from workers.request.spec import ItemSpec
    from workers.speed.patches import hoist_modulation

    pixart = load_model(make_tiny_pixart(tmp_path / "tiny-pixart"))
    before = {k: v.clone() for k, v in pixart.transformer.state_dict().items()}
    assert not hoist_modulation(pixart.transformer)
    assert all(torch.equal(v, before[k]) for k, v in pixart.transformer.state_dict().items())
    reqs = [ItemSpec(id=f"r{i}", label=i, seed=i, sampler="ddim", steps=3, guidance=2.0) for i in range(3)]
    want = Engine(load_model("digits"), WorkerConfig(backend="eager", max_batch=4)).generate(reqs)
    for backend, hoist, hoisted in (("full", True, True), ("breakable", True, True), ("eager", True, False),
                                    ("breakable", False, False)):
        m = to_precision(load_model("digits", precision="fp8" if backend == "full" else "bf16"))  # FP8 leaves these linears
        got = Engine(m, WorkerConfig(backend=backend, max_batch=4), speed=SpeedConfig(hoist_modulation=hoist)).generate(reqs)
        assert ("forward" in vars(m.transformer.transformer_blocks[0].norm1)) == hoisted, (backend, hoist)
        if m.precision == "bf16":
            for a, b in zip(got, want):
                torch.testing.assert_close(a.latents, b.latents, rtol=1e-5, atol=1e-5)


def test_the_attention_output_is_divided_only_by_a_factor_other_than_one():
    from types import SimpleNamespace

    from workers.speed.patches import scaled_output

    out = torch.randn(2, 3)
    assert scaled_output(out, SimpleNamespace(rescale_output_factor=1.0)) is out  # no pass of its own
    assert torch.equal(scaled_output(out, SimpleNamespace(rescale_output_factor=2.0)), out / 2)
