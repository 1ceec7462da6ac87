"""Qwen-Image, the torch part (the card is in ``workers.families.qwenimage``); Qwen team 2025, diffusers'
``QwenImageTransformer2DModel`` and ``QwenImagePipeline``: a rectified-flow MMDiT (joint attention over text
and image tokens) conditioned on Qwen2.5-VL's last hidden state of the prompt in a chat template.

Encoding follows ``QwenImagePipeline._get_qwen_prompt_embeds`` and ``encode_prompt``: each prompt as given,
formatted into ``PROMPT_TEMPLATE``, tokenised (padded to the batch's longest, truncated at 1024 + 34
tokens), the text encoder's last hidden state under the attention mask, the real tokens of each row kept
and its first ``DROP_TOKENS`` (the template's system part) dropped, the rest cut at ``max_tokens``. Where
the pipeline pads each batch to its longest prompt (and passes no mask when none is padded), every text
here is padded with zeros to ``max_tokens`` with a mask of its real tokens: the transformer keeps masked
text keys out of the joint attention, and the text's rotary positions start after the image's whatever
the text's length, so a real token's result does not depend on the padding, and the step's shapes are
fixed. Encodings are cached per model in an LRU keyed by the text, on the host.

Guidance (QwenImagePipeline's true CFG). Both halves run in one forward (prompt rows, then negative rows);
the prediction is ``neg + g (cond - neg)``, rescaled per token to the norm of ``cond`` over its 64 packed
channels (``comb * (|cond| / |comb|)``, the pipeline's norms over its last dimension, in the packed
layout). Rows with ``g <= 1`` take ``cond`` alone: the pipeline without guidance. The choice is a per-row
``where``, so one batch mixes both. The negative prompt is the request's, " " when it is empty (the
published model card's; the card's docstring says why).

Latents. The engine keeps each request's latents unpacked, (16, H/8, W/8); the step packs them 2x2 into
(H/16)(W/16) tokens of 64 and unpacks the velocity, as ``QwenImagePipeline._pack_latents`` /
``_unpack_latents``. The VAE is a video VAE with per-channel statistics: ``LatentDecoder`` gives the engine's
generic decode a (B, 16, h, w) -> (B, 3, H, W) ``decode`` that undoes the statistics and the time axis as the
pipeline's decode does (``vae_scale`` 1, ``vae_shift`` 0).

Loading. The transformer is built on the meta device and given the checkpoint's tensors; its rotary tables,
which ``__init__`` computes, are made again on the host (``builtin.rebuild_tables``), and so are the text
encoder's rotary frequencies, in float32: casting the encoder to bfloat16 would round them (transformers
makes them in float32, and the pipeline's encoder keeps them so).

Qwen-Image-Edit (a card whose ``edit`` is "reference"): its references read by the encoder and joined to the
sequence as latent tokens, each layout of reference sizes a step variant: ``workers.families.qwenimage.edit``.

Graph safety: the step runs the transformer's modules through ``transformer_forward``: its forward without
the host-to-device copy it makes at every call (not allowed while a CUDA graph captures). The rotary tables
(complex, the text's positions after the image's) depend on the shape and the token limit only: made once
per shape in ``make_step`` (``rotary_tables``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from graphs import TensorSpec
from samplers import model_input, sampler_step
from workers.families.encoders import place_encoder
from workers.families.base import NO_CFG
from workers.families.qwenimage import QwenImage, builtin, edit
from workers.families.textcache import encodings
from workers.loading import assemble, cast, load_checked_encoder, load_component, load_sharded

CACHE_SIZE = 1024  # texts; 3.7 MB each in bf16 at 512 tokens of 3584
# QwenImagePipeline.__init__: prompt_template_encode, prompt_template_encode_start_idx, tokenizer_max_length
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
DROP_TOKENS = 34
TOKENIZER_MAX_LENGTH = 1024
EMPTY_NEGATIVE = " "  # the published model card's negative prompt when there is none to give


class QwenImageRuntime(QwenImage):
    def reference_pipeline(self, model):
        """QwenImagePipeline over the model's modules (the VAE itself, not its adapter), flow Euler of its card's
        scheduler config (the pipeline sets its own sigma grid and mu)."""
        import diffusers as d

        config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
        parts = dict(scheduler=d.FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae.autoencoder,
                     text_encoder=model.text_encoder, tokenizer=model.tokenizer, transformer=model.transformer)
        if _edits(model):  # QwenImageEditPipeline or QwenImageEditPlusPipeline, with the processor
            pipe = getattr(d, model.edit.pipeline)(processor=model.processor, **parts)
        else:
            pipe = d.QwenImagePipeline(**parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_call(self, model, specs) -> dict:
        """True CFG at the request's guidance against its negative prompt (" " for an empty one, as the model
        card passes); an edit's reference image (the first request's: the edit pipelines take one request's images
        per call), or the Plus pipeline's list of them where the request sends several."""
        s = specs[0]
        w, h = (s.width, s.height) if s.width else model.card.native_size
        call = dict(prompt=[x.prompt for x in specs], negative_prompt=[x.negative_prompt or " " for x in specs],
                    true_cfg_scale=s.guidance, height=h, width=w, num_inference_steps=s.steps,
                    max_sequence_length=model.card.max_tokens)
        if _edits(model):
            from workers.request.images import decode_image

            images = [decode_image(data) for data in s.references]
            call["image"] = images if len(images) > 1 else images[0]
        return call

    def load(self, card, device, dtype):
        """The transformer and VAE (safetensors, sharded or not), the Qwen2.5-VL text encoder (transformers,
        local files, safetensors only) and the Qwen2 tokenizer, from ``card.path``; the VAE behind
        ``LatentDecoder``. A built-in card (``qwen-image-1024``) gets random weights instead (``_load_builtin``)."""
        if card.builtin:
            return _load_builtin(card, device, dtype)
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        path = Path(card.path)
        transformer = load_sharded(QwenImageTransformer2DModel, path / "transformer", device, dtype)
        builtin.rebuild_tables(transformer)  # pos_embed's tables, which the meta build leaves empty
        vae = cast(load_component(AutoencoderKLQwenImage, path / "vae"), device, dtype)
        model = assemble(card, transformer, LatentDecoder(vae))
        encoder = load_checked_encoder(Qwen2_5_VLForConditionalGeneration, path / "text_encoder", device, dtype)
        model.text_encoder = builtin.rebuild_tables(encoder)  # its rotary frequencies in float32 again
        model.tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        if _edits(model):  # its setup and the processor that reads the reference with the prompt
            edit.load_edit(model, path)
        return model

    def cond_specs(self, model) -> dict[str, TensorSpec]:
        """The prompt's and the negative prompt's embeddings and masks; an edit's are its variants' (their length
        is the reference's: ``variant_specs``)."""
        if _edits(model):
            return {}
        length, width = model.card.max_tokens, model.transformer.config.joint_attention_dim
        embeds, mask = TensorSpec((length, width), model.dtype), TensorSpec((length,), model.dtype)
        return {"prompt_embeds": embeds, "prompt_mask": mask, "neg_embeds": embeds, "neg_mask": mask}

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        """Each request's prompt and negative prompt (" " for an empty one), encoded in one batch (cache misses
        only); an edit's with its reference, and its reference's tokens (``edit.encode``)."""
        if _edits(model):
            return edit.encode(model, specs)
        negatives = [s.negative_prompt or EMPTY_NEGATIVE for s in specs]
        found = _encode_texts(model, sorted({*(s.prompt for s in specs), *negatives}))
        return [{"prompt_embeds": found[s.prompt][0], "prompt_mask": found[s.prompt][1],
                 "neg_embeds": found[n][0], "neg_mask": found[n][1]} for s, n in zip(specs, negatives)]

    def plan_kwargs(self, model, shape: tuple[int, int, int]) -> dict:
        """The resolution-dependent shift: ``mu`` from the packed sequence length (h/2)(w/2), as
        QwenImagePipeline's ``calculate_shift(latents.shape[1], ...)`` from the scheduler's config."""
        if not model.card.scheduler.get("use_dynamic_shifting", False):
            return {}
        from samplers import flow_mu

        _, h, w = shape
        return {"mu": flow_mu((h // 2) * (w // 2), model.card.scheduler)}

    def step_variants(self, model) -> tuple[str, ...]:
        """Its step, and ``NO_CFG``: the step of rows whose scale is at most 1, which the pipeline runs
        without the negative forward (one forward per image instead of two). An edit's: those of a square
        reference (others are captured when one first comes)."""
        if _edits(model):
            return edit.square_variants(model)
        return ("", NO_CFG)

    def variant_of(self, model, spec) -> str:
        """``NO_CFG`` at a scale of at most 1; an edit's: its reference's size and vision tokens too."""
        if _edits(model):
            return edit.variant_of(model, spec)
        return NO_CFG if spec.guidance <= 1 else ""

    def variant_specs(self, model, shape, variant: str) -> dict[str, TensorSpec]:
        """An edit variant's text inputs (as long as ``edit.text_length``: its vision tokens, the template's, the
        prompt's ``max_tokens``) and reference tokens."""
        found = edit.parse_variant(variant)
        return {} if found is None else edit.variant_specs(model, found)

    def encode_image(self, model, pixels, generators=None):
        """The video VAE's posterior of one frame, sampled with each row's generator, normalised by the config's
        per-channel statistics: ``LatentDecoder.encode_latents``, as QwenImageImg2ImgPipeline's
        ``_encode_vae_image``."""
        return model.vae.encode_latents(pixels, generators).float()

    def make_step(self, model, shape=None, variant: str = ""):
        """One whole denoising step for latents of ``shape`` (16, h, w; the native one by default): pack, both
        CFG halves through the transformer in one forward (``transformer_forward``) at timestep t / 1000 (the
        pipeline divides by 1000; the model multiplies back) with the text masks, the true-CFG rescale
        (``true_cfg``), unpack, sampler update. The rotary tables depend on the shape and the token limit only:
        made here, outside capture. An edit variant's step (``edit``) runs [latent tokens, reference tokens] and
        keeps the latent tokens' output; its rotary tables and text length are its references'."""
        transformer, dtype, device = model.transformer, model.dtype, model.device
        _, h, w = shape or model.latent_shape
        n = (h // 2) * (w // 2)
        found = edit.parse_variant(variant)
        guided = variant != NO_CFG and (found is None or found.cfg)
        if found is None:
            rotary, modulate = rotary_tables(transformer, h // 2, w // 2, model.card.max_tokens, device), None
        else:
            rotary = rotary_tables(transformer, h // 2, w // 2, edit.text_length(model, found), device,
                                   references=found.grids)
            modulate = edit.modulation_index(transformer, n, found.tokens, device)

        def forward(tokens, text, mask, timestep):
            out = transformer_forward(transformer, tokens, text, mask, timestep, rotary, modulate)
            return out if found is None else out[:, :n]  # the latent tokens' output, as the pipelines' [:, :n]

        def step(x, t, guidance, coeffs, hist, noise, prompt_embeds, prompt_mask, neg_embeds=None, neg_mask=None,
                 reference=None):
            tokens = pack(model_input(x, coeffs).to(dtype))                                 # (B, N, 64)
            if reference is not None:  # an edit: [latent tokens, each reference's tokens]
                tokens = torch.cat([tokens, reference], dim=1)                              # (B, N + n_ref, 64)
            timestep = t.to(dtype) / 1000
            if not guided:  # rows at a scale of at most 1: the prompt's forward alone, as the pipeline
                v = forward(tokens, prompt_embeds, prompt_mask, timestep)
                x_next, denoised = sampler_step(x, unpack(v.float(), h, w), hist, noise, coeffs)
                return {"x_next": x_next, "hist_next": denoised}
            out = forward(torch.cat([tokens, tokens]),                                      # (2B, N (+ n_ref), 64)
                          torch.cat([prompt_embeds, neg_embeds]),                           # (2B, L, 3584)
                          torch.cat([prompt_mask, neg_mask]),                               # (2B, L)
                          torch.cat([timestep, timestep]))                                  # (2B, N, 64)
            cond, uncond = out.float().chunk(2)
            v = unpack(true_cfg(cond, uncond, guidance), h, w)                              # (B, 16, h, w)
            x_next, denoised = sampler_step(x, v, hist, noise, coeffs)
            return {"x_next": x_next, "hist_next": denoised}

        return step


def transformer_forward(transformer, tokens: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor,
                        timestep: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                        modulate: torch.Tensor | None = None) -> torch.Tensor:
    """QwenImageTransformer2DModel.forward as the Qwen-Image pipelines call it (no guidance embedding, additional
    t condition or controlnet: the card refuses transformers with them), through the same modules, with ``rotary``
    (``rotary_tables``) given, and ``zero_cond_t``'s modulation index (``edit.modulation_index``, (1, N), where the
    transformer sets it; it then also embeds timestep 0 for the reference's tokens). Not its own forward: that
    makes a device tensor from a host integer at every call (``compute_text_seq_len_from_mask``'s
    ``torch.as_tensor``, for a length it does not use: a synchronous host-to-device copy, which a stream may not
    make while a CUDA graph captures it; and zero_cond_t's index from img_shapes) and looks its rotary tables up
    again. (B, N, 64) tokens, (B, L, D) text, (B, L) mask (nonzero: a token), (B,) timesteps in [0, 1] ->
    (B, N, 64)."""
    hidden = transformer.img_in(tokens)
    timestep = timestep.to(hidden.dtype)
    index = None
    if modulate is not None:  # zero_cond_t: rows [t, 0], the reference's tokens modulated by the second
        timestep = torch.cat([timestep, timestep * 0])                                     # (2B,)
        index = modulate.expand(tokens.shape[0], -1)                                       # (B, N)
    text = transformer.txt_in(transformer.txt_norm(text))
    mask = text_mask.to(torch.bool)
    temb = transformer.time_text_embed(timestep, hidden)
    for block in transformer.transformer_blocks:
        text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                             temb=temb, image_rotary_emb=rotary, modulate_index=index)
    if modulate is not None:
        temb = temb.chunk(2, dim=0)[0]
    return transformer.proj_out(transformer.norm_out(hidden, temb))


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, guidance: torch.Tensor) -> torch.Tensor:
    """QwenImagePipeline's guided prediction of packed (B, N, 64) predictions, ``guidance`` (B,): where g > 1,
    ``comb = uncond + g (cond - uncond)`` rescaled to the norm of ``cond`` over the last dimension; elsewhere
    ``cond`` (the pipeline runs no CFG at g <= 1)."""
    g = guidance.view(-1, 1, 1)
    comb = uncond + g * (cond - uncond)
    rescaled = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    return torch.where(g > 1, rescaled, cond)


class LatentDecoder(torch.nn.Module):
    """AutoencoderKLQwenImage (``autoencoder``) as the engine's decode reads a VAE: ``decode(z).sample`` of
    latents in the sampler's space (B, 16, h, w) is the (B, 3, H, W) image in [-1, 1], as QwenImagePipeline
    decodes: ``z / (1 / std) + mean`` with the config's per-channel statistics in the VAE's dtype, a time axis
    of one frame added and removed. ``config.out_channels``: the image's channels; ``dtype``: the VAE's."""

    def __init__(self, autoencoder: torch.nn.Module) -> None:
        super().__init__()
        self.autoencoder = autoencoder
        cfg = autoencoder.config
        # scaling 1, no shift: ``assemble`` reads these, and the engine's decode passes the latents as they are
        self.config = SimpleNamespace(out_channels=cfg.input_channels, z_dim=cfg.z_dim, scaling_factor=1.0,
                                      shift_factor=0.0)
        stats = lambda values: torch.tensor(values).view(1, cfg.z_dim, 1, 1, 1)
        self.register_buffer("mean", stats(cfg.latents_mean).to(self.dtype), persistent=False)
        self.register_buffer("std", stats(cfg.latents_std).to(self.dtype), persistent=False)
        self.to(next(autoencoder.parameters()).device).eval()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.autoencoder.parameters()).dtype

    def encode_latents(self, pixels: torch.Tensor, generators=None) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] -> latents in the sampler's space (B, 16, h, w), ``decode``'s inverse as
        the img2img and inpaint pipelines encode: a time axis of one frame, the posterior (sampled with one
        generator per row, else its mode: ``workers.edits.posterior``), ``(z - mean) * (1 / std)``."""
        from workers.edits import posterior

        z = posterior(self.autoencoder.encode(pixels.to(self.dtype)[:, :, None]).latent_dist, generators)
        return ((z - self.mean.to(z.dtype)) * (1.0 / self.std.to(z.dtype)))[:, :, 0]              # (B, 16, h, w)

    def decode(self, z: torch.Tensor, return_dict: bool = True):
        from diffusers.models.autoencoders.vae import DecoderOutput

        z = z.to(self.dtype)[:, :, None]                                                   # (B, 16, 1, h, w)
        z = z / (1.0 / self.std.to(z.dtype)) + self.mean.to(z.dtype)
        image = self.autoencoder.decode(z, return_dict=False)[0][:, :, 0]                 # (B, 3, H, W)
        return DecoderOutput(sample=image) if return_dict else (image,)

    def to(self, *args, **kwargs):
        """nn.Module.to without a memory format: the video VAE's 3-D convolution weights have no channels-last
        layout (the engine's compiled decode asks for one), so its weights keep theirs."""
        kwargs.pop("memory_format", None)
        return super().to(*args, **kwargs)


@torch.no_grad()
def _encode_texts(model, texts: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    def encode(missing: list[str]):  # kept on the host: 3.7 MB a text in bf16
        embeds, mask = encode_prompts(model, missing)
        return list(zip(embeds.to("cpu", model.dtype), mask.to("cpu", model.dtype)))

    return encodings(model, texts, encode, CACHE_SIZE)


def encode_prompts(model, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, max_tokens, D) prompt embeddings, zero past each text's tokens, and the (n, max_tokens) mask of its
    tokens: QwenImagePipeline._get_qwen_prompt_embeds, then encode_prompt's cut at max_sequence_length."""
    limit, encoder = model.card.max_tokens, model.text_encoder
    device = next(encoder.parameters()).device
    tok = model.tokenizer([PROMPT_TEMPLATE.format(t) for t in texts], max_length=TOKENIZER_MAX_LENGTH + DROP_TOKENS,
                          padding=True, truncation=True, return_tensors="pt")
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
    # the last hidden state (logits_to_keep=1: the LM head's logits, unused, for one token instead of all)
    hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                     logits_to_keep=1).hidden_states[-1]                                     # (n, l, D)
    embeds = hidden.new_zeros(len(texts), limit, hidden.shape[-1])
    real = hidden.new_zeros(len(texts), limit)
    for i, row in enumerate(hidden):
        kept = row[mask[i].bool()][DROP_TOKENS:][:limit]  # the real tokens after the template's first 34
        embeds[i, :len(kept)] = kept
        real[i, :len(kept)] = 1
    return embeds, real


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, (H/2)(W/2), 4C): 2x2 cells as tokens, as QwenImagePipeline._pack_latents."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # (B, H/2, W/2, C, 2, 2)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(z: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, (h/2)(w/2), 4C) -> (B, C, h, w), as QwenImagePipeline._unpack_latents (without its time axis)."""
    b, _, d = z.shape
    z = z.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # (B, C, h/2, 2, w/2, 2)
    return z.reshape(b, d // 4, h, w)


def rotary_tables(transformer, h: int, w: int, text_tokens: int, device,
                  references: tuple[tuple[int, int], ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's (image, text) rotary tables for an h x w token grid and ``text_tokens`` text tokens
    (complex; the text's positions follow the largest grid's), as its forward makes them from the pipeline's
    ``img_shapes``; an edit's ``references`` grids (rows, cols) follow the image's (frame indices 1, 2, ...), as the
    edit pipelines' img_shapes [latents, reference 1, reference 2, ...]."""
    shapes = [(1, h, w)] + [(1, *grid) for grid in references]
    with torch.no_grad():
        return transformer.pos_embed([shapes], device=torch.device(device), max_txt_seq_len=text_tokens)


def _edits(model) -> bool:
    """Whether ``model`` is an instruction edit (its card's ``edit`` "reference": Qwen-Image-Edit)."""
    return model.card is not None and model.card.edit == "reference"


# -- loading -----------------------------------------------------------------------------------------------


def _load_builtin(card, device, dtype, **overrides):
    """Qwen-Image with random weights made on the device (``builtin.build_qwen_image``), with the attributes
    ``load`` sets; ``overrides`` shrink its configs (tests)."""
    parts = builtin.build_qwen_image(card.image_size, device, dtype, **overrides)
    model = assemble(card, parts["transformer"], LatentDecoder(parts["vae"]))
    model.text_encoder = builtin.rebuild_tables(place_encoder(parts["text_encoder"], device, dtype))
    model.tokenizer = parts["tokenizer"]
    return model
