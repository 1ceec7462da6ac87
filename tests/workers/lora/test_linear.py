"""The per-row LoRA term on tiny FLUX.1, SD3.5 and PixArt-Σ transformers (float32, CPU): a batch whose rows carry
different adapters (one, none, two at other scales, a negative scale) gives each row what the transformer with
that row's adapters merged into its weights gives it alone; both CFG copies of a row get its adapters; FP8 bases
keep their codes and the term its dtype; the graph runner feeds the rows' slots and scales as step inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphs import GraphRunner, TensorSpec
from tests.workers.lora.cases import FAMILIES, merged, out, random_adapter, rows_of
from workers.lora import LoraBank, LoraLinear, apply_lora, lora_delta, lora_specs, unreached, with_lora
from workers.speed.fp8 import Fp8Linear, quantize_linears

TOL = dict(rtol=1e-4, atol=1e-5)
# the rows of the batch: (adapter index, scale) pairs each; adapters 0 and 1
ROWS = [[(0, 0.8)], [], [(0, 0.5), (1, 1.2)], [(1, -0.7)]]


def _batch(family: str, references: bool = True):
    """A wrapped transformer with adapters 0 and 1 in slots 1 and 2, the batch's inputs, the rows' slots and
    scales, and the merged reference of each row (``references``)."""
    make, inputs_of = FAMILIES[family]
    transformer = make()
    adapters = [random_adapter(transformer, 10), random_adapter(transformer, 11, rank=3, every=2)]
    refs = [merged(transformer, [(adapters[i], c) for i, c in row]) for row in ROWS] if references else []
    bank = LoraBank(transformer, slots=3, max_rank=4, per_request=2)
    for i, adapter in enumerate(adapters):
        bank.load(i + 1, f"a{i}", adapter)
    assert len(apply_lora(transformer, bank)) == len(bank.targets)
    rows = [bank.row([(f"a{i}", c) for i, c in row]) for row in ROWS]
    slots, scales = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])  # (B, P) each
    return transformer, bank, inputs_of(len(ROWS)), slots, scales, refs


def _run(transformer, bank, inputs, slots, scales):
    bank.row_slots, bank.row_scales = slots, scales
    try:
        return out(transformer, inputs)
    finally:
        bank.row_slots = bank.row_scales = None


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart"])
def test_rows_with_different_adapters_equal_each_row_merged_alone(family):
    transformer, bank, inputs, slots, scales, refs = _batch(family)
    got = _run(transformer, bank, inputs, slots, scales)
    plain = out(transformer, inputs)  # no per-row inputs set: the base alone
    for i, ref in enumerate(refs):
        want = out(ref, rows_of(inputs, i))
        torch.testing.assert_close(got[i:i + 1], want, **TOL)
        if ROWS[i]:
            assert (want - plain[i:i + 1]).abs().max() > 1e-3  # the adapters change the row: the test can fail
    torch.testing.assert_close(got[1], plain[1], rtol=0, atol=0)  # the row without adapters: the base exactly


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_both_cfg_copies_of_a_row_get_its_adapters(family):
    """CFG runs the step's rows twice (cat([rows, rows])): the slots of B rows serve a batch of 2 B."""
    transformer, bank, inputs, slots, scales, _ = _batch(family, references=False)
    doubled = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.shape[:1] == (len(ROWS),) else v
               for k, v in inputs.items()}
    got = _run(transformer, bank, doubled, slots, scales)
    single = _run(transformer, bank, inputs, slots, scales)
    torch.testing.assert_close(got[: len(ROWS)], single, **TOL)
    torch.testing.assert_close(got[len(ROWS):], single, **TOL)


def test_the_term_is_the_sum_over_a_rows_slots():
    """lora_delta against the formula written out: row 0 slot 1 at 0.5 and slot 2 at 2; row 1 nothing."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 6, generator=g), torch.randn(3, 5, 4, generator=g)  # (S, R, in), (S, out, R)
    a[0], b[0] = 0, 0
    x = torch.randn(2, 7, 6, generator=g)                                       # (N, T, in)
    slots, scales = torch.tensor([[1, 2], [0, 0]]), torch.tensor([[0.5, 2.0], [0.0, 0.0]])
    got = lora_delta(x, a, b, slots, scales)
    want0 = 0.5 * x[0] @ a[1].T @ b[1].T + 2.0 * x[0] @ a[2].T @ b[2].T          # (T, out)
    torch.testing.assert_close(got[0], want0)
    assert got[1].abs().max() == 0
    with pytest.raises(ValueError, match="multiple"):
        lora_delta(torch.randn(3, 7, 6), a, b, slots, scales)


def test_an_fp8_base_stays_fp8_and_the_term_adds_in_the_activations_dtype():
    g = torch.Generator().manual_seed(0)
    layer = nn.Sequential(nn.Linear(32, 48))
    bank_owner = nn.Module()
    bank_owner.proj = Fp8Linear(layer[0])
    bank = LoraBank(bank_owner, slots=1, max_rank=2, per_request=1)
    assert bank.a["proj"].dtype == torch.float32  # the activations' dtype, not the FP8 codes'
    from workers.lora import Adapter, LoraWeights

    w = LoraWeights(torch.randn(2, 32, generator=g), torch.randn(48, 2, generator=g), 0.5)
    bank.load(1, "a", Adapter({"proj": w}, "peft"))
    base = bank_owner.proj
    apply_lora(bank_owner, bank)
    assert isinstance(bank_owner.proj, LoraLinear) and bank_owner.proj.base is base
    assert base.weight_fp8.dtype == torch.float8_e4m3fn
    x = torch.randn(3, 5, 32, generator=g)
    bank.row_slots, bank.row_scales = torch.tensor([[1], [0], [1]]), torch.tensor([[1.0], [0.0], [-2.0]])
    for gelu in ("none", "tanh"):  # a GELU folded into the base (fold_gelus) applies to the term's input too
        base.gelu = gelu
        act = x if gelu == "none" else torch.nn.functional.gelu(x, approximate="tanh")
        delta = 0.5 * act @ w.a.T @ w.b.T                                          # (3, 5, 48)
        want = base(x) + torch.stack([delta[0], 0 * delta[1], -2 * delta[2]])
        torch.testing.assert_close(bank_owner.proj(x), want, **TOL)
    bank.row_slots = bank.row_scales = None


def test_a_quantized_transformer_takes_adapters_on_its_fp8_linears():
    from tests.workers.lora.cases import flux_inputs, tiny_flux

    transformer = tiny_flux()
    fp8 = set(quantize_linears(transformer))
    bank = LoraBank(transformer, slots=1, max_rank=4, per_request=1)
    bank.load(1, "a", random_adapter(transformer, 3))
    apply_lora(transformer, bank)
    assert fp8 and all(isinstance(transformer.get_submodule(n).base, Fp8Linear) for n in fp8)
    inputs = flux_inputs(2)
    plain = out(transformer, inputs)
    got = _run(transformer, bank, inputs, torch.tensor([[1], [0]]), torch.tensor([[1.0], [0.0]]))
    torch.testing.assert_close(got[1], plain[1], rtol=0, atol=0)
    assert (got[0] - plain[0]).abs().max() > 1e-3
    assert unreached(transformer, lambda: out(transformer, inputs)) == []


def test_a_fused_product_adds_its_parts_terms_and_one_that_asks_none_is_unreached():
    """q and k fused into one product (``fuse_linears``): a forward that adds the parts' terms
    (``workers.speed.terms.add_part_terms``) gives what the wrapped q and k give called one by one, and reaches
    both; one that multiplies the fused weights alone leaves both unreached (their adapters would be skipped)."""
    from workers.lora import Adapter, LoraWeights
    from workers.lora.validate import reached
    from workers.speed.fp8 import fuse_linears
    from workers.speed.terms import add_part_terms

    g = torch.Generator().manual_seed(0)
    owner = nn.Module()
    owner.q, owner.k = nn.Linear(8, 6), nn.Linear(8, 4)
    x = torch.randn(3, 5, 8, generator=g)                                          # (N, T, in)
    want_plain = torch.cat([owner.q(x), owner.k(x)], -1).detach()
    fused = fuse_linears([owner.q, owner.k])

    def fast():  # the rewrite: one product, then the parts' terms
        y = fused(x)                                                               # (N, T, 6 + 4)
        add_part_terms(fused.parts, x, y)
        return y

    assert reached(owner, fast) == ["q", "k"]
    assert reached(owner, lambda: fused(x)) == []
    bank = LoraBank(owner, slots=2, max_rank=2, per_request=1)
    bank.load(1, "a", Adapter({n: LoraWeights(torch.randn(2, 8, generator=g), torch.randn(o, 2, generator=g), 0.5)
                               for n, o in (("q", 6), ("k", 4))}, "peft"))
    apply_lora(owner, bank)
    bank.row_slots, bank.row_scales = torch.tensor([[1], [0], [1]]), torch.tensor([[1.0], [0.0], [-2.0]])
    try:
        with torch.no_grad():
            got, want = fast(), torch.cat([owner.q(x), owner.k(x)], -1)            # the wraps, called
            assert unreached(owner, fast) == []
            assert unreached(owner, lambda: fused(x)) == ["q", "k"]
    finally:
        bank.row_slots = bank.row_scales = None
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got[1], want_plain[1], **TOL)  # the row without adapters: the product alone
    assert (got[0] - want_plain[0]).abs().max() > 1e-2


def test_the_graph_runner_feeds_the_rows_slots_and_scales():
    """A step made with with_lora under the runner (eager on a CPU, same static buffers): 3 rows at max batch 4
    (a bucket of 2 and one of 1, or one padded bucket), rows as when stepped alone."""
    transformer, bank, inputs, slots, scales, refs = _batch("pixart")

    def step(x, t, cond):  # the transformer at one timestep per row, its output as the step's
        return {"y": transformer(hidden_states=x, encoder_hidden_states=cond, timestep=t,
                                 added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]}

    specs = {"x": TensorSpec((4, 8, 8), torch.float32), "t": TensorSpec((), torch.int64),
             "cond": TensorSpec((10, 32), torch.float32), **lora_specs(2)}
    runner = GraphRunner(with_lora(step, bank), specs, {"y": TensorSpec((8, 8, 8), torch.float32)}, max_batch=4,
                         backend="eager", device="cpu")
    runner.warmup()
    live = {"x": inputs["hidden_states"][:3], "t": inputs["timestep"][:3], "cond": inputs["encoder_hidden_states"][:3]}
    with torch.no_grad():
        got = runner.run(**live, lora_slots=slots[:3], lora_scales=scales[:3])["y"]
    for i in range(3):
        torch.testing.assert_close(got[i:i + 1], out(refs[i], rows_of(inputs, i)), **TOL)
    assert bank.row_slots is None  # set for the step's forward only


def test_dynamo_traces_a_lora_step_whole_with_one_graph_for_every_batch():
    """The step with its per-row inputs set on the bank, traced by dynamo without a graph break (fullgraph) with
    its inputs' batch marked dynamic as ``graphs.compiled.CompiledStep`` marks it (3, 5, 6 rows: one graph), CFG's
    doubled batch inside; equal to the step run eagerly. Slots of -1 read as none."""
    from torch._dynamo.utils import counters

    from workers.lora import Adapter, LoraWeights

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    bank = LoraBank(model, slots=2, max_rank=2, per_request=2)
    bank.load(1, "a", Adapter({"0": LoraWeights(torch.randn(2, 8, generator=g), torch.randn(16, 2, generator=g), 1.0),
                               "2": LoraWeights(torch.randn(1, 16, generator=g), torch.randn(8, 1, generator=g), 2.0)},
                              "peft"))
    apply_lora(model, bank)
    step = with_lora(lambda x: {"y": model(torch.cat([x, x]))}, bank)  # (2B, T, 8): both CFG halves
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    with torch.no_grad():
        for n in (3, 5, 6):
            x, scales = torch.randn(n, 4, 8, generator=g), torch.rand(n, 2, generator=g)
            slots = torch.randint(-1, 3, (n, 2), generator=g)
            for t in (x, slots, scales):
                torch._dynamo.mark_dynamic(t, 0)
            torch.testing.assert_close(compiled(lora_slots=slots, lora_scales=scales, x=x)["y"],
                                       step(lora_slots=slots, lora_scales=scales, x=x)["y"])
    assert counters["stats"]["unique_graphs"] == 1
    assert bank.row_slots is None


def test_removing_the_wrap_gives_back_the_plain_linears():
    from workers.lora import remove_lora
    from workers.speed.terms import row_term

    transformer, bank, inputs, slots, scales, _ = _batch("flux", references=False)
    with_adapters = _run(transformer, bank, inputs, slots, scales)
    wrapped = [n for n, m in transformer.named_modules() if isinstance(m, LoraLinear)]
    assert sorted(remove_lora(transformer)) == sorted(wrapped) and wrapped
    assert not any(isinstance(m, LoraLinear) for m in transformer.modules())
    assert all(row_term(transformer.get_submodule(n)) is None for n in wrapped)
    plain = _run(transformer, bank, inputs, slots, scales)  # the rows' slots are set, and nothing reads them
    assert not torch.allclose(plain, with_adapters)
    assert len(apply_lora(transformer, bank)) == len(wrapped)  # wrapped again, as before
    torch.testing.assert_close(_run(transformer, bank, inputs, slots, scales), with_adapters)


def test_the_term_added_in_place_equals_the_term_added_after():
    """``lora_add`` (the wrapped linear's path: the sum inside ``baddbmm_``, or into a view of one product's columns)
    leaves ``y`` plus the term, for token and plain inputs and CFG's repeated rows; nothing else of the product
    changes."""
    from workers.lora.linear import lora_add

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 5, 16, generator=g), torch.randn(4, 24, 5, generator=g)
    slots, scales = torch.tensor([[1, 0], [2, 3], [0, 0]]), torch.randn(3, 2, generator=g)
    for x in (torch.randn(3, 7, 16, generator=g), torch.randn(3, 16, generator=g), torch.randn(6, 7, 16, generator=g)):
        y = torch.randn(*x.shape[:-1], 24, generator=g)
        want = y + lora_delta(x, a, b, slots, scales)
        lora_add(x, a, b, slots, scales, y)
        torch.testing.assert_close(y, want)
        fused = torch.randn(*x.shape[:-1], 60, generator=g)  # a part's columns 10..34 of one product
        before = fused.clone()
        lora_add(x, a, b, slots, scales, fused[..., 10:34])
        torch.testing.assert_close(fused[..., 10:34], before[..., 10:34] + lora_delta(x, a, b, slots, scales))
        assert torch.equal(fused[..., :10], before[..., :10]) and torch.equal(fused[..., 34:], before[..., 34:])