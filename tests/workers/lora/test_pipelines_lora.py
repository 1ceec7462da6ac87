"""Per-request LoRA against diffusers' pipelines themselves, for every family diffusers gives a LoRA loader (FLUX.1,
SD3, FLUX.2, Qwen-Image, Z-Image, Sana; PixArt and DiT have none: ``test_linear.py``): two adapter files as
published (the pipeline class's ``save_lora_weights``: ``transformer.``-prefixed PEFT keys with their config), and
one batch through our engine whose rows carry one adapter, two at other scales, none, and the other alone. Each row
equals the family's pipeline with both files loaded by ``load_lora_weights`` and that row's adapters set by
``set_adapters(..., adapter_weights=...)`` (``disable_lora`` for the row without), from the same initial latents:
float32 on the CPU, within each family's pipeline tolerance (1e-4 of the largest value)."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.workers.lora.test_peft_families import served
from workers.config import WorkerConfig
from workers.loading import load_model
from workers.request.spec import ItemSpec

pytest.importorskip("peft")

ROWS = [[("a", 0.8)], [("a", 0.5), ("b", 1.2)], [], [("b", -0.7)]]
PROMPTS = ("a red fox", "a blue house", "a green tree", "a cat")


def _family(name: str):
    """(tests module of the family, its tiny maker, the pipeline class, a pipeline over a loaded model)."""
    from diffusers import (Flux2KleinPipeline, FluxPipeline, QwenImagePipeline, SanaPipeline, StableDiffusion3Pipeline,
                           ZImagePipeline)

    from workers.models import tiny_flux, tiny_flux2, tiny_qwenimage, tiny_sana, tiny_sd3, tiny_zimage

    tests = importlib.import_module(f"tests.workers.families.test_{name}")
    if name == "flux":
        def pipeline(model):
            return FluxPipeline(scheduler=tests._scheduler(model), vae=model.vae, text_encoder=model.text_encoder,
                                tokenizer=model.tokenizer, text_encoder_2=model.text_encoder_2,
                                tokenizer_2=model.tokenizer_2, transformer=model.transformer)
    elif name == "qwenimage":
        def pipeline(model):
            from diffusers import FlowMatchEulerDiscreteScheduler

            config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
            pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config),
                                     vae=model.vae.autoencoder, text_encoder=model.text_encoder,
                                     tokenizer=model.tokenizer, transformer=model.transformer)
            pipe.set_progress_bar_config(disable=True)
            return pipe
    else:
        pipeline = tests._pipe if name == "sana" else tests._pipeline
    make, cls = {"flux": (tiny_flux.make_tiny_flux, FluxPipeline),
                 "sd3": (tiny_sd3.make_tiny_sd3, StableDiffusion3Pipeline),
                 "flux2": (tiny_flux2.make_tiny_flux2, Flux2KleinPipeline),
                 "qwenimage": (tiny_qwenimage.make_tiny_qwenimage, QwenImagePipeline),
                 "zimage": (tiny_zimage.make_tiny_zimage, ZImagePipeline),
                 "sana": (tiny_sana.make_tiny_sana, SanaPipeline)}[name]
    return tests, make, cls, pipeline


def _published(cls, model_dir, folder, name: str, targets: list[str], seed: int, **config):
    """An adapter file as a diffusers training script publishes it: PEFT on ``targets`` (random weights, lora_B too),
    saved by the pipeline class's ``save_lora_weights``."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = load_model(model_dir).transformer
    torch.manual_seed(seed)
    lora = LoraConfig(target_modules=targets, init_lora_weights=False, **config)
    transformer.add_adapter(lora, adapter_name=name)
    layers = get_peft_model_state_dict(transformer, adapter_name=name)
    cls.save_lora_weights(folder / name, transformer_lora_layers=layers,
                          transformer_lora_adapter_metadata=lora.to_dict())
    return folder / name / "pytorch_lora_weights.safetensors"


@pytest.mark.parametrize("family", ["flux", "sd3", "flux2", "qwenimage", "zimage", "sana"])
def test_each_row_equals_the_pipeline_with_its_adapters_set(tmp_path, family):
    tests, make, cls, pipeline = _family(family)
    model_dir = make(tmp_path / family)
    engine, model, on_attention, elsewhere = served(model_dir, WorkerConfig(backend="eager", max_batch=4))
    files = {"a": _published(cls, model_dir, tmp_path, "a", on_attention, 1, r=4, lora_alpha=8),
             "b": _published(cls, model_dir, tmp_path, "b", elsewhere, 2, r=2, lora_alpha=3)}
    for name, file in files.items():
        engine.add_lora(name, file.read_bytes())
    d = model.card.defaults
    specs = [ItemSpec(id=f"r{i}", seed=300 + i, sampler=d["sampler"], steps=3, guidance=float(d["guidance"]),
                      prompt=PROMPTS[i], loras=tuple(row)) for i, row in enumerate(ROWS)]
    got = engine.generate(specs)  # one batch: the four rows together

    reference = load_model(model_dir)  # the pipeline's: both files loaded as a user loads them
    loader = pipeline(reference)
    for name, file in files.items():
        loader.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=name)
    for spec, result, row in zip(specs, got, ROWS):
        if row:
            loader.enable_lora()
            loader.set_adapters([n for n, _ in row], adapter_weights=[s for _, s in row])
        else:
            loader.disable_lora()
        if family == "qwenimage":  # the pipeline reads neither the spec's adapters nor its own: the loaded ones
            tests._assert_equal_to_pipeline(reference, loader, [spec], [result])
        else:
            tests._assert_equal_to_pipeline(reference, [spec], [result])
    assert (got[0].latents - got[2].latents).abs().max() > 1e-3  # the adapters change the image
    assert (got[3].latents - got[2].latents).abs().max() > 1e-3
