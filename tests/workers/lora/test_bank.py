"""The adapter bank: loads write in place (the tensors' addresses never change, so captured graphs stay valid),
ranks are zero-padded exactly, slot 0 stays empty, the least recently used slot no running row uses is the one
reloaded, and reloading a slot changes only the rows that name it."""

from __future__ import annotations

import pytest
import torch

from tests.workers.lora.cases import flux_inputs, out, random_adapter, tiny_flux
from workers.lora import LoraBank, LoraError, apply_lora


def _addresses(bank: LoraBank) -> dict[str, int]:
    return {f"{kind}:{t}": d[t].data_ptr() for kind, d in (("a", bank.a), ("b", bank.b)) for t in bank.targets}


def test_loading_and_evicting_write_in_place():
    transformer = tiny_flux()
    bank = LoraBank(transformer, slots=2, max_rank=4, per_request=2)
    before = _addresses(bank)
    first, second = random_adapter(transformer, 1), random_adapter(transformer, 2, rank=2, every=3)
    bank.load(1, "first", first)
    bank.load(2, "second", second)
    bank.evict(1)
    bank.load(1, "second-again", second)
    assert _addresses(bank) == before
    name = next(iter(second.weights))
    w = second.weights[name]
    # rank 2 of 4: the first two rows of A and columns of B, alpha / r folded into B, the rest zero
    torch.testing.assert_close(bank.a[name][1, :2], w.a)
    torch.testing.assert_close(bank.b[name][1, :, :2], w.b * w.scale)
    assert bank.a[name][1, 2:].abs().max() == 0 and bank.b[name][1, :, 2:].abs().max() == 0
    untouched = next(t for t in bank.targets if t not in second.weights)  # a linear the adapter leaves alone:
    assert bank.a[untouched][1].abs().max() == 0 and bank.b[untouched][1].abs().max() == 0  # first's part cleared
    assert all(bank.a[t][0].abs().max() == 0 and bank.b[t][0].abs().max() == 0 for t in bank.targets)  # slot 0
    assert (bank.loads, bank.evictions) == (3, 1)
    # live: the slots holding each linear's adapter (both slots hold `second`, which targets some linears only)
    assert all(bank.live[t].tolist() == ([0, 1, 1] if t in second.weights else [0, 0, 0]) for t in bank.targets)
    bank.evict(2)
    assert all(bank.live[t].tolist() == [0, int(t in second.weights), 0] for t in bank.targets)
    assert bank.nbytes == sum(3 * 4 * (fin + fout) * 4 + 3 * 4 for fin, fout in bank.shapes.values())  # fp32, int32


def test_lru_choice_skips_slots_in_use_and_prefers_free_ones():
    transformer = tiny_flux()
    bank = LoraBank(transformer, slots=3, max_rank=4, per_request=1)
    adapter = random_adapter(transformer, 1, every=4)
    assert bank.choose_slot() == 1
    for slot, name in ((1, "a"), (2, "b"), (3, "c")):
        bank.load(slot, name, adapter)
    bank.row([("a", 1.0)])  # a request used "a" after "b" and "c" were loaded: "b" is now the least recent
    assert bank.choose_slot() == 2
    assert bank.choose_slot(in_use={2}) == 3
    assert bank.choose_slot(in_use={2, 3}) == 1
    assert bank.choose_slot(in_use={1, 2, 3}) is None  # every slot runs: the request waits
    assert bank.evict(3) == "c" and bank.slot_of("c") is None
    assert bank.choose_slot(in_use={1, 2}) == 3  # a free slot first


def test_rows_name_resident_adapters_only_and_at_most_per_request():
    transformer = tiny_flux()
    bank = LoraBank(transformer, slots=2, max_rank=4, per_request=2)
    bank.load(2, "style", random_adapter(transformer, 1, every=4))
    slots, scales = bank.row([("style", 0.6)])
    assert slots.tolist() == [2, 0] and scales.tolist() == pytest.approx([0.6, 0.0])
    with pytest.raises(LoraError, match="'other' is not loaded"):
        bank.row([("other", 1.0)])
    with pytest.raises(LoraError, match="3 adapters asked; at most 2"):
        bank.row([("style", 1.0)] * 3)
    with pytest.raises(ValueError, match="slot 0 is not one of the bank's 1..2"):
        bank.load(0, "x", random_adapter(transformer, 1, every=4))


def test_reloading_a_slot_changes_only_the_rows_that_name_it():
    """Rows on slots 1 and 2 and a row on none; slot 2 reloaded with another adapter between two forwards: the
    other rows are bit-identical, the slot's row changes."""
    transformer = tiny_flux()
    bank = LoraBank(transformer, slots=2, max_rank=4, per_request=1)
    bank.load(1, "a", random_adapter(transformer, 1))
    bank.load(2, "b", random_adapter(transformer, 2))
    apply_lora(transformer, bank)
    inputs = flux_inputs(3)
    bank.row_slots, bank.row_scales = torch.tensor([[1], [2], [0]]), torch.tensor([[1.0], [1.0], [0.0]])
    try:
        before = out(transformer, inputs)
        bank.load(2, "c", random_adapter(transformer, 3))
        after = out(transformer, inputs)
    finally:
        bank.row_slots = bank.row_scales = None
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    assert (after[1] - before[1]).abs().max() > 1e-3


def test_a_load_from_the_adapters_stage_equals_one_that_stages_it_itself():
    """``stage`` (made once, at registration) holds what ``load`` writes: the same bank either way, and the stage
    is not changed by a load."""
    transformer = tiny_flux()
    adapter = random_adapter(transformer, 1, every=2)
    staged_bank, plain_bank = (LoraBank(transformer, slots=2, max_rank=4, per_request=1) for _ in range(2))
    staged = staged_bank.stage(adapter)
    before = {t: tuple(f.clone() for f in fs) for t, fs in staged[1].items() if fs is not None}
    staged_bank.load(2, "x", adapter, staged=staged)
    plain_bank.load(2, "x", adapter)
    for t in staged_bank.targets:
        assert torch.equal(staged_bank.a[t], plain_bank.a[t]) and torch.equal(staged_bank.b[t], plain_bank.b[t])
    assert torch.equal(staged_bank._live, plain_bank._live) and staged_bank._live[:, 2].sum() == len(before)
    assert all(torch.equal(staged[1][t][i], before[t][i]) for t in before for i in (0, 1))
