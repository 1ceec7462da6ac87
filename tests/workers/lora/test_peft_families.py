"""Per-request LoRA on the families added after FLUX.1 and SD3 (FLUX.2, Qwen-Image, Z-Image, Sana), end to end
through the engine: adapters made and saved by diffusers' own API (``add_adapter``, ``save_lora_adapter``), one
batch whose rows carry one adapter, two at other scales, and none, each row equal to the engine run over the
family's transformer with the same files loaded by diffusers (``load_lora_adapter``) and set for that row
(``set_adapters(..., weights=...)``; ``disable_adapters`` for the row without). Float32 on the CPU. (FLUX.1 and
SD3: ``test_peft.py``; PixArt and DiT, which diffusers gives no LoRA loader: ``test_linear.py``.)"""

from __future__ import annotations

import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.loading import load_model
from workers.request.spec import ItemSpec

pytest.importorskip("peft")

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
ROWS = [[("a", 0.8)], [("a", 0.5), ("b", 1.2)], [], [("b", -0.7)]]
TOL = dict(rtol=1e-4, atol=1e-5)


def _make(family: str, path):
    from workers.models import tiny_flux2, tiny_qwenimage, tiny_sana, tiny_zimage

    make = {"flux2": tiny_flux2.make_tiny_flux2, "qwenimage": tiny_qwenimage.make_tiny_qwenimage,
            "zimage": tiny_zimage.make_tiny_zimage, "sana": tiny_sana.make_tiny_sana}[family]
    return make(path / family)


def _req(model, i: int, loras=()) -> ItemSpec:
    d = model.card.defaults
    return ItemSpec(id=f"r{i}", seed=300 + i, sampler=d["sampler"], steps=3, guidance=float(d["guidance"]),
                    prompt=("a red fox", "a blue house", "a green tree", "a cat")[i % 4], loras=tuple(loras))


def _adapter(model_dir, tmp_path, name: str, targets: list[str], seed: int, **config):
    """An adapter file written by diffusers for the family's transformer: PEFT on ``targets``, random weights."""
    from peft import LoraConfig

    transformer = load_model(model_dir).transformer
    torch.manual_seed(seed)
    transformer.add_adapter(LoraConfig(target_modules=targets, init_lora_weights=False, **config), adapter_name=name)
    transformer.save_lora_adapter(tmp_path / name, adapter_name=name)
    return tmp_path / name / "pytorch_lora_weights.safetensors"


def served(model_dir, config: WorkerConfig):
    """An engine over ``model_dir`` with a bank of 2 slots of rank 4; its model; the bank's attention projections
    and every other one of its other linears (the two adapters' targets)."""
    engine = Engine(load_model(model_dir), config.model_copy(update=dict(lora_slots=2, lora_max_rank=4,
                                                                         lora_per_request=2)))
    model = engine.models[next(iter(engine.models))]
    held = engine.lora.banks[model.name].targets
    on_attention = [t for t in held if t.endswith(ATTENTION)]
    elsewhere = [t for t in held if not t.endswith(ATTENTION)][::2]
    assert on_attention and elsewhere
    return engine, model, on_attention, elsewhere


@pytest.mark.parametrize("family", ["flux2", "qwenimage", "zimage", "sana"])
def test_rows_equal_the_engine_over_diffusers_adapters(tmp_path, family):
    model_dir = _make(family, tmp_path)
    config = WorkerConfig(backend="eager", max_batch=4)
    engine, model, on_attention, elsewhere = served(model_dir, config)
    files = {"a": _adapter(model_dir, tmp_path, "a", on_attention, 1, r=4, lora_alpha=8),
             "b": _adapter(model_dir, tmp_path, "b", elsewhere, 2, r=2, lora_alpha=3)}
    for name, file in files.items():
        engine.add_lora(name, file.read_bytes())
    got = engine.generate([_req(model, i, row) for i, row in enumerate(ROWS)])

    reference = load_model(model_dir)  # diffusers: both files loaded, the adapters set per row
    for name, file in files.items():
        reference.transformer.load_lora_adapter(str(file), adapter_name=name, prefix=None, use_safetensors=True)
    for i, row in enumerate(ROWS):
        if row:
            reference.transformer.enable_adapters()
            reference.transformer.set_adapters([n for n, _ in row], weights=[c for _, c in row])
        else:
            reference.transformer.disable_adapters()
        want = Engine(reference, config).generate([_req(model, i)])[0].latents
        torch.testing.assert_close(got[i].latents, want, **TOL)
    assert (got[0].latents - got[2].latents).abs().max() > 1e-3  # the adapters change the image
    assert (got[3].latents - got[2].latents).abs().max() > 1e-3
