"""Per-request LoRA inside the captured step: rows of one batch with different adapters and scales.

    formats   adapter files (safetensors only) in the formats people publish -> ``Adapter`` {module: (A, B, scale)}
    validate  an adapter against the transformer (targets, shapes, rank): ``LoraError`` naming the first mismatch
    bank      ``LoraBank``: fixed-shape device tensors per targeted linear, adapters loaded into slots in place
    linear    ``LoraLinear`` (a linear plus the per-row term), ``apply_lora``, and the step's inputs
              (``lora_specs``, ``with_lora``)

How a worker uses it, per model: make a ``LoraBank(transformer, lora_slots, lora_max_rank, lora_per_request)``
after the speed layer, ``apply_lora(model, bank)``, and build each step as ``with_lora(step, bank)`` with the
step's inputs plus ``lora_specs(lora_per_request)``; at admission a request's ``bank.row(loras)`` is its row of
those inputs. Loading an adapter (``bank.load``) writes into the bank in place: no recapture, no recompile.
"""

from workers.lora.bank import LoraBank
from workers.lora.formats import Adapter, LoraError, LoraWeights, from_state_dict, read_adapter
from workers.lora.linear import (LoraLinear, apply_lora, lora_delta, lora_rows, lora_specs, remove_lora, unreached,
                                 with_lora)
from workers.lora.validate import linear_shapes, reached, validate

__all__ = ["Adapter", "LoraBank", "LoraError", "LoraLinear", "LoraWeights", "apply_lora", "from_state_dict",
           "linear_shapes", "lora_delta", "lora_rows", "lora_specs", "reached", "read_adapter", "remove_lora",
           "unreached", "validate", "with_lora"]
