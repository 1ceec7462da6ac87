"""Adapters reach the linears the speed layer computes without calling them (float32, CPU).

Each tiny model goes through the speed layer as the engine applies it under the graph backends
(``workers.speed.apply.apply(..., graphs=True)``): SD3's and FLUX.1's modulation hoisted into one product (also read
from a modulation table, as the engine's steps read it), DiT's every-block modulation hoisted, PixArt's and DiT's
q, k and v fused into one product; with ``precision="fp8"`` (``fastest`` without its compile) FLUX.1's blocks' q, k,
v (and single-block MLP) fused into FP8 products of a norm's codes, PixArt's and DiT's norms fused with their codes.
The bank is made over the linears a forward reaches (``reached``, as the engine makes it), with adapters on every
one of them. Against the same model without the speed rewrites, the adapters wrapped on its plain linears:

- a batch of rows with adapter A, none, A + B and B gives each row what the plain model gives it (bf16 paths: the
  same float32 arithmetic but for the sums' order, 1e-5; FP8 paths: the term of a fused part reads the rows the
  norm's codes stand for, where the plain model's term reads the unrounded rows, so the adapters' effect is
  compared, within e4m3's rounding of the term's input, 2^-4 relative at most: 5% of the effect);
- each row of that batch is what it is alone, and both CFG copies of a row get its adapters;
- no wrapped linear goes unreached.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.workers.lora.cases import random_adapter
from workers.families import family_of
from workers.loading import load_model
from workers.lora import LoraBank, apply_lora, reached, unreached
from workers.speed import SpeedConfig
from workers.speed.apply import apply

ROWS = [[(0, 0.8)], [], [(0, 0.5), (1, 1.2)], [(1, -0.7)]]  # (adapter, scale) pairs of each row
CASES = [("flux", ""), ("flux", "fp8"), ("sd3", ""), ("pixart", ""), ("pixart", "fp8"), ("dit", ""), ("dit", "fp8")]
TOL = dict(rtol=1e-5, atol=1e-5)


@functools.cache
def _folder(kind: str, root: str):
    from pathlib import Path

    from workers.models.tiny_dit import write_tiny_dit
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_pixart import make_tiny_pixart
    from workers.models.tiny_sd3 import make_tiny_sd3

    path = Path(root) / kind
    if kind == "dit":
        write_tiny_dit(path)
        return path
    make = {"flux": make_tiny_flux, "sd3": lambda p: make_tiny_sd3(p, t5=False), "pixart": make_tiny_pixart}[kind]
    return make(path)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reach"))


def _model(kind: str, root: str, precision: str, graphs: bool):
    """The tiny model through the speed layer (``graphs``: as under the graph backends; else the plain model, in
    FP8 linears alone where ``precision`` asks)."""
    model = load_model(_folder(kind, root), precision=precision or "bf16")
    if graphs:
        apply(model, family_of(model), SpeedConfig(precision=precision), graphs=True)
    elif precision:
        from workers.speed.apply import to_precision

        to_precision(model, precision)
    return model


def _inputs(kind: str, tr, n: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    cfg = tr.config
    if kind == "flux":
        ids = torch.zeros(16, 3)
        ids[:, 1], ids[:, 2] = torch.arange(16) // 4, torch.arange(16) % 4
        return dict(hidden_states=torch.randn(n, 16, cfg.in_channels, generator=g),     # (B, 4x4 tokens, C)
                    encoder_hidden_states=torch.randn(n, 5, cfg.joint_attention_dim, generator=g),
                    pooled_projections=torch.randn(n, cfg.pooled_projection_dim, generator=g),
                    timestep=torch.rand(n, generator=g), guidance=torch.full((n,), 3.5), img_ids=ids,
                    txt_ids=torch.zeros(5, 3))
    if kind == "sd3":
        return dict(hidden_states=torch.randn(n, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g),
                    encoder_hidden_states=torch.randn(n, 7, cfg.joint_attention_dim, generator=g),
                    pooled_projections=torch.randn(n, cfg.pooled_projection_dim, generator=g),
                    timestep=torch.rand(n, generator=g) * 1000)
    if kind == "pixart":
        return dict(hidden_states=torch.randn(n, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g),
                    encoder_hidden_states=torch.randn(n, 6, cfg.caption_channels, generator=g),
                    timestep=torch.randint(0, 1000, (n,), generator=g),
                    added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    return dict(hidden_states=torch.randn(n, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g),
                timestep=torch.randint(0, 1000, (n,), generator=g),
                class_labels=torch.randint(0, cfg.num_embeds_ada_norm + 1, (n,), generator=g))


def _rows(inputs: dict, idx) -> dict:
    """The rows ``idx`` of a batch's inputs (per-sample tensors indexed, shared ones kept)."""
    n = inputs["hidden_states"].shape[0]
    return {k: v[idx] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n and k not in ("img_ids", "txt_ids")
            else v for k, v in inputs.items()}


def _twice(inputs: dict) -> dict:
    """CFG's batch: the rows, then the same rows again."""
    n = inputs["hidden_states"].shape[0]
    return {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n
            and k not in ("img_ids", "txt_ids") else v for k, v in inputs.items()}


def _out(tr, inputs: dict, bank=None, slots=None, scales=None, table=None) -> torch.Tensor:
    """The transformer's output for ``inputs``, with the rows' adapters (``slots``, ``scales``) where given, its
    modulation read from ``table`` rows where given (``workers.speed.modulation.give``)."""
    from workers.speed.modulation import give

    if bank is not None:
        bank.row_slots, bank.row_scales = slots, scales
    try:
        with torch.no_grad():
            if table is not None:
                give(tr, table)
            return tr(**inputs, return_dict=False)[0]
    finally:
        if bank is not None:
            bank.row_slots = bank.row_scales = None


def _banked(model, targets, adapters):
    bank = LoraBank(model.transformer, slots=2, max_rank=4, per_request=2, targets=targets)
    for i, adapter in enumerate(adapters):
        bank.load(i + 1, f"a{i}", adapter)
    apply_lora(model, bank)
    return bank


@functools.cache
def _served(kind: str, precision: str, root: str):
    """The sped-up model and the plain one, each with adapters A and B in slots 1 and 2 over the linears the
    sped-up forward reaches, and the rows' slots and scales."""
    fast, plain = _model(kind, root, precision, True), _model(kind, root, precision, False)
    inputs = _inputs(kind, fast.transformer, len(ROWS))
    targets = reached(fast.transformer, lambda: _out(fast.transformer, inputs))
    adapters = [random_adapter(fast.transformer, 10, names=targets),
                random_adapter(fast.transformer, 11, rank=3, names=targets)]
    banks = _banked(fast, targets, adapters), _banked(plain, targets, adapters)
    rows = [banks[0].row([(f"a{i}", c) for i, c in row]) for row in ROWS]
    slots, scales = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])  # (B, P) each
    return fast, plain, banks, inputs, slots, scales


def _sped_up(kind: str, precision: str, tr) -> None:
    """The rewrites this case is about took the model."""
    from workers.families.flux import fast as flux_fast
    from workers.speed import modulation, norm_fusion

    if kind in ("flux", "sd3"):
        assert modulation.hoisted(tr) > 0
    if kind == "dit":
        assert "forward" in vars(tr.transformer_blocks[0].norm1)  # every block's modulation at once
    if kind in ("pixart", "dit"):
        assert all(b.attn1.processor.qkv is not None for b in tr.transformer_blocks)
        assert norm_fusion.fused_blocks(tr) == (len(tr.transformer_blocks) if precision else 0)
    if kind == "flux" and precision:
        assert flux_fast.fused_blocks(tr) == len(tr.transformer_blocks) + len(tr.single_transformer_blocks)


def _close(got, want, base, precision: str) -> None:
    """``got`` against ``want`` (module docstring): bf16 paths to float32's rounding; FP8 paths by the adapters'
    effect ``want - base``."""
    if not precision:
        torch.testing.assert_close(got, want, **TOL)
        return
    effect = (want - base).norm()
    assert effect > 1e-2 * base.norm()  # the adapters change the output: the comparison can fail
    assert (got - want).norm() <= 0.05 * effect, float((got - want).norm() / effect)


@pytest.mark.parametrize("kind, precision", CASES)
def test_rows_get_their_adapters_on_the_hoisted_and_fused_linears(kind, precision, root):
    fast, plain, (bank, plain_bank), inputs, slots, scales = _served(kind, precision, root)
    tr = fast.transformer
    _sped_up(kind, precision, tr)
    wanted = {"flux": ["norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear", "attn.to_q",
                       "attn.to_k", "attn.to_v", "attn.add_q_proj", "proj_mlp", "proj_out"],
              "sd3": ["norm1.linear", "norm1_context.linear", "norm_out.linear", "attn.to_q", "attn.to_k", "attn.to_v"],
              "pixart": ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "attn2.to_k", "ff.net.0.proj"],
              "dit": ["norm1.linear", "timestep_embedder.linear_1", "attn1.to_q", "attn1.to_v", "ff.net.0.proj"]}
    for part in wanted[kind]:  # every linear of the blocks is in the bank, these among them
        assert any(t.endswith(part) for t in bank.targets), part
    got = _out(tr, inputs, bank, slots, scales)
    want = _out(plain.transformer, inputs, plain_bank, slots, scales)
    base = _out(plain.transformer, inputs)
    for i, row in enumerate(ROWS):
        if row or not precision:  # FP8: the effect of the row's adapters (none: the next check)
            _close(got[i], want[i], base[i], precision)
    torch.testing.assert_close(got[1], _out(tr, inputs)[1], rtol=0, atol=0)  # no adapter: the sped-up model's own
    assert unreached(tr, lambda: _out(tr, inputs, bank, slots, scales)) == []


@pytest.mark.parametrize("kind, precision", CASES)
def test_each_row_of_a_mixed_batch_is_what_it_is_alone(kind, precision, root):
    fast, _, (bank, _), inputs, slots, scales = _served(kind, precision, root)
    tr = fast.transformer
    got = _out(tr, inputs, bank, slots, scales)
    for i in range(len(ROWS)):
        alone = _out(tr, _rows(inputs, slice(i, i + 1)), bank, slots[i:i + 1], scales[i:i + 1])
        torch.testing.assert_close(got[i:i + 1], alone, **TOL)


@pytest.mark.parametrize("kind, precision", [c for c in CASES if c[0] != "flux"])
def test_both_cfg_copies_of_a_row_get_its_adapters(kind, precision, root):
    """The step's B rows' slots serve the transformer's 2B rows (SD3's hoisted modulation reads (2B, D))."""
    fast, _, (bank, _), inputs, slots, scales = _served(kind, precision, root)
    tr = fast.transformer
    got = _out(tr, _twice(inputs), bank, slots, scales)
    once = _out(tr, inputs, bank, slots, scales)
    torch.testing.assert_close(got[:len(ROWS)], once, **TOL)
    torch.testing.assert_close(got[len(ROWS):], once, **TOL)


@pytest.mark.parametrize("kind, precision", [("flux", ""), ("flux", "fp8"), ("sd3", "")])
def test_a_modulation_table_gives_the_hoisted_linears_terms_their_true_input(kind, precision, root):
    """The engine's steps read the hoisted product from each request's table (``give``) and run no embedding; the
    table's embedding is what the norms' linears' terms read: the same output as the forward that computes it."""
    from workers.speed.modulation import temb_modulation

    fast, _, (bank, _), inputs, slots, scales = _served(kind, precision, root)
    tr = fast.transformer
    cache, embeds = temb_modulation(tr), []
    hook = tr.time_text_embed.register_forward_hook(lambda mod, a, out: embeds.append(out))
    try:
        want = _out(tr, inputs, bank, slots, scales)
    finally:
        hook.remove()
    (temb,) = embeds
    table = cache.table(temb)                                                          # (B, sum kD + D)
    got = _out(tr, inputs, bank, slots, scales, table=table)
    torch.testing.assert_close(got, want, **TOL)
    stand_in = _out(tr, inputs, bank, slots, scales, table=torch.cat([table[:, :sum(cache.widths)],
                                                                      torch.zeros_like(temb)], dim=1))
    assert (stand_in - want).abs().max() > 1e-4  # the terms read the table's embedding: the check can fail


@pytest.mark.parametrize("kind, precision",
                         [("flux", ""), ("flux", "fp8"), ("sd3", ""), ("dit", ""), ("pixart", "fp8")])
def test_dynamo_traces_the_terms_of_hoisted_and_fused_linears_whole(kind, precision, root):
    """The forward with the rows' adapters set, traced by dynamo as a compiled step is (``fullgraph``: no break;
    the attention breaks opaque, as the speed layer registers them for compiled steps): the terms' lookups on the
    linears are resolved while tracing, and the result is the eager forward's."""
    from workers.speed.apply import prepare_compile

    prepare_compile("")
    fast, _, (bank, _), inputs, slots, scales = _served(kind, precision, root)
    tr = fast.transformer
    want = _out(tr, inputs, bank, slots, scales)

    def forward(slots, scales, inputs):
        bank.row_slots, bank.row_scales = slots, scales
        try:
            return tr(**inputs, return_dict=False)[0]
        finally:
            bank.row_slots = bank.row_scales = None

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        got = torch.compile(forward, backend="eager", fullgraph=True)(slots, scales, inputs)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got, want, **TOL)
