"""FLUX.2 with random weights, for benchmarks: ``flux2-klein-1024`` (``black-forest-labs/FLUX.2-klein-4B``'s
architecture: transformer 3.88B, Qwen3-4B) and ``flux2-dev-1024`` (``black-forest-labs/FLUX.2-dev``'s: transformer
32.2B, Mistral-Small-3.2-24B with its Pixtral vision tower), both with the FLUX.2 VAE; built on the meta device
and materialised on the target one (``workers.families.builtins``). The tokenizers are made here: a byte-level BPE
with letter pairs (about two tokens a word), Qwen's special tokens and chat template, or for [dev] Mistral's
control tokens and chat template; every id inside the encoders' vocabularies.

Buffers ``builtins.materialise`` has no rule for (it refuses any it does not know) are set aside while it runs and
made here as a normal build makes them: the VAE's batch-norm statistics (mean 0, variance 1, count 0) and the
encoders' rotary frequencies (float32, as transformers builds them).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.families.builtins import check_overrides, materialise_all

# transformer/config.json of FLUX.2-klein-4B and of FLUX.2-dev (diffusers' scripts/convert_flux2_to_diffusers.py)
KLEIN_4B = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False)
DEV = dict(KLEIN_4B, num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
           guidance_embeds=True)
# vae/config.json of both: AutoencoderKLFlux2's defaults (32 channels at /8, quant convs, batch norm of 128)
FLUX2_VAE = dict(block_out_channels=(128, 256, 512, 512), latent_channels=32, layers_per_block=2, norm_num_groups=32,
                 use_quant_conv=True, use_post_quant_conv=True, batch_norm_eps=1e-4, batch_norm_momentum=0.1)
# text_encoder/config.json of FLUX.2-klein-4B: Qwen/Qwen3-4B (embeddings tied to the LM head)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
# text_encoder/config.json of FLUX.2-dev: mistralai/Mistral-Small-3.2-24B-Instruct-2506 (LM head untied)
MISTRAL_SMALL_3 = dict(
    text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072, rope_theta=1000000000.0, rms_norm_eps=1e-5, sliding_window=None,
                     tie_word_embeddings=False),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, num_channels=3,
                       rope_theta=10000.0, hidden_act="silu"),
    image_token_index=10, multimodal_projector_bias=False, projector_hidden_act="gelu", spatial_merge_size=2,
    tie_word_embeddings=False)


def build(name: str, image_size: int, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
          **overrides: dict) -> dict:
    """The built-in ``name`` ("flux2-klein-1024" or "flux2-dev-1024") with random weights made on ``device`` in
    ``dtype``, named as the pipeline's components: transformer, vae (AutoencoderKLFlux2), text_encoder, tokenizer.
    ``image_size`` is the VAE's sample_size only (the transformer takes any size); ``overrides`` (per module, a
    dict of config keys; ``text_encoder``'s may hold ``text_config``/``vision_config`` dicts) shrink it (tests)."""
    modules = on_meta(name, image_size, **overrides)
    aside = _set_aside(modules.values())
    made = materialise_all(modules, device, dtype, seed)
    _restore(aside, device, dtype)
    klein = "klein" in name
    return {**made, "tokenizer": qwen_tokenizer() if klein else mistral_tokenizer()}


def on_meta(name: str, image_size: int, **overrides: dict) -> dict[str, nn.Module]:
    """The modules of ``build`` on the meta device: shapes, no storage."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    o = check_overrides(overrides, ("transformer", "vae", "text_encoder"))
    klein = "klein" in name
    with torch.device("meta"):
        return {"transformer": Flux2Transformer2DModel(**{**(KLEIN_4B if klein else DEV), **o["transformer"]}),
                "vae": AutoencoderKLFlux2(**{**FLUX2_VAE, "sample_size": image_size, **o["vae"]}),
                "text_encoder": _qwen3(o["text_encoder"]) if klein else _mistral3(o["text_encoder"])}


def _qwen3(override: dict) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**{**QWEN3_4B, **override}))


def _mistral3(override: dict) -> nn.Module:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    cfg = {**MISTRAL_SMALL_3, **override}
    for part in ("text_config", "vision_config"):
        cfg[part] = {**MISTRAL_SMALL_3[part], **override.get(part, {})}
    return Mistral3ForConditionalGeneration(Mistral3Config(**cfg))


def qwen_tokenizer():
    """tiny_flux2's Qwen tokenizer (Qwen3's specials and chat template) over letter pairs as well: about two
    tokens a word."""
    from workers.models.tiny_flux2 import qwen_tokenizer as make

    return make(pairs=True)


def mistral_tokenizer():
    """tiny_flux2's Tekken-like tokenizer (Mistral's control tokens) over letter pairs as well, with Mistral Small 3's
    chat template (what [dev]'s encode reads of its PixtralProcessor)."""
    from workers.models.tiny_flux2 import MISTRAL_CHAT_TEMPLATE
    from workers.models.tiny_flux2 import mistral_tokenizer as make

    tok = make(pairs=True)
    tok.chat_template = MISTRAL_CHAT_TEMPLATE
    return tok


def _set_aside(modules) -> list[tuple[nn.Module, dict[str, torch.Tensor]]]:
    """The batch norms' and rotary embeddings' buffers, taken out of their modules (``_restore`` puts them back)."""
    out = []
    for model in modules:
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d) or _is_rotary(mod):
                out.append((mod, dict(mod._buffers)))
                mod._buffers.clear()
    return out


def _is_rotary(mod: nn.Module) -> bool:
    return type(mod).__name__.endswith("RotaryEmbedding") and "inv_freq" in mod._buffers


@torch.no_grad()
def _restore(aside, device, dtype) -> None:
    for mod, buffers in aside:
        if isinstance(mod, nn.BatchNorm2d):  # as reset_running_stats
            c = mod.num_features
            mod._buffers.update(running_mean=torch.zeros(c, device=device, dtype=dtype),
                                running_var=torch.ones(c, device=device, dtype=dtype),
                                num_batches_tracked=torch.tensor(0, dtype=torch.long, device=device))
        else:  # a fresh one's frequencies (a few numbers, made on the host from the config, as __init__ does)
            fresh = type(mod)(mod.config)
            mod._buffers.update({k: getattr(fresh, k).to(device) for k in buffers})
