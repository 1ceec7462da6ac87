"""Adapters made and applied by diffusers' own API (PEFT backend: ``add_adapter``, ``save_lora_adapter``,
``load_lora_adapter``, ``set_adapters``) against the engine's reading and per-row term: a batch whose rows carry
one adapter, two at other scales, and none, row by row equal to the diffusers transformer with those adapters
active at those weights. Skipped where PEFT is not installed (diffusers' LoRA loading needs it)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.lora.cases import flux_inputs, out, rows_of, sd3_inputs, tiny_flux, tiny_sd3
from workers.lora import LoraBank, apply_lora, read_adapter, validate

pytest.importorskip("peft")

TOL = dict(rtol=1e-4, atol=1e-5)
CASES = {"flux": (tiny_flux, flux_inputs, ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "norm1.linear"],
                  ["ff.net.0.proj", "ff.net.2", "proj_out", "add_k_proj"]),
         "sd3": (tiny_sd3, sd3_inputs, ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "norm1_context.linear"],
                 ["ff.net.0.proj", "ff.net.2", "ff_context.net.2", "to_add_out", "proj_out"])}


def _make(tmp_path, make, name, targets, seed, **config):
    """An adapter file written by diffusers: a PEFT adapter on ``targets`` with random weights (lora_B too)."""
    from peft import LoraConfig

    torch.manual_seed(seed)
    transformer = make()
    transformer.add_adapter(LoraConfig(target_modules=targets, init_lora_weights=False, **config), adapter_name=name)
    transformer.save_lora_adapter(tmp_path / name, adapter_name=name)
    return tmp_path / name / "pytorch_lora_weights.safetensors"


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_rows_equal_diffusers_with_the_same_adapters_loaded(tmp_path, family):
    make, inputs_of, targets_a, targets_b = CASES[family]
    file_a = _make(tmp_path, make, "a", targets_a, 1, r=4, lora_alpha=8)
    file_b = _make(tmp_path, make, "b", targets_b, 2, r=2, lora_alpha=2, alpha_pattern={"ff.net.2": 5.0})
    rows = [[("a", 0.8)], [("a", 0.5), ("b", 1.2)], [], [("b", -0.7)]]
    inputs = inputs_of(len(rows))

    reference = make()  # diffusers: both files loaded, the adapters set per row as a pipeline user sets them
    for name, file in (("a", file_a), ("b", file_b)):  # use_safetensors, as the pipelines' load_lora_weights pass
        # it: without it diffusers 0.42 reads the file without its metadata, so lora_alpha falls back to r
        reference.load_lora_adapter(str(file), adapter_name=name, prefix=None, use_safetensors=True)
    want = []
    for i, row in enumerate(rows):
        if row:
            reference.enable_adapters()
            reference.set_adapters([n for n, _ in row], weights=[c for _, c in row])
        else:
            reference.disable_adapters()
        want.append(out(reference, rows_of(inputs, i)))

    transformer = make()  # ours: the same base weights (the same seed), both adapters in a bank, one batch
    adapters = {"a": read_adapter(file_a), "b": read_adapter(file_b)}
    bank = LoraBank(transformer, slots=2, max_rank=4, per_request=2)
    for slot, (name, adapter) in enumerate(adapters.items(), start=1):
        validate(adapter, transformer, max_rank=4)
        bank.load(slot, name, adapter)
    apply_lora(transformer, bank)
    made = [bank.row(row) for row in rows]
    bank.row_slots, bank.row_scales = torch.stack([m[0] for m in made]), torch.stack([m[1] for m in made])
    try:
        got = out(transformer, inputs)
    finally:
        bank.row_slots = bank.row_scales = None
    for i in range(len(rows)):
        torch.testing.assert_close(got[i:i + 1], want[i], **TOL)
    assert (want[0] - want[2]).abs().max() > 1e-3 and (want[3] - want[2]).abs().max() > 1e-3
