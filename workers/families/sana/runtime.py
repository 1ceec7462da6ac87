"""Sana, the torch part (the card is in ``workers.families.sana``); Xie et al. 2024, diffusers'
``SanaTransformer2DModel`` (a linear-attention DiT with cross-attention to the prompt and Mix-FFN blocks) and
``SanaPipeline``: a rectified-flow model over the 32-channel latents of a 32x deep-compression autoencoder
(AutoencoderDC), conditioned on Gemma-2's last hidden states.

Encoding follows ``SanaPipeline.encode_prompt`` / ``_get_gemma_prompt_embeds`` exactly (``clean_caption`` off):

    text     lower-cased and stripped (``_text_preprocessing``), prompt and negative prompt alike
    prompt   the complex human instruction (its lines joined by "\\n") + the text, tokenised to
             n_chi + max_tokens - 2 tokens (n_chi: the instruction's own token count, <bos> included), padded
             on the right ("max_length"), truncated; Gemma-2 with the attention mask; then the tokens
             [0] + the last max_tokens - 1 of the embeddings and of the mask kept (``select_index``)
    negative the text alone ("" by default), tokenised to max_tokens, padded on the right, encoded the same
             way, nothing dropped (the pipeline passes complex_human_instruction=False for it)

so both are (max_tokens, D) with a (max_tokens,) mask, a fixed shape: the mask reaches the transformer's
cross-attention (``encoder_attention_mask``), where it keeps the padding out. The tokenizer pads on the right
whatever it was saved with, as the pipeline sets ``padding_side``. Encodings are cached per model in an LRU keyed
by the role and the processed text, on the host (1.4 MB a text in bf16 at 300 tokens of Gemma-2-2B's 2304), and
uploaded with a request at admission.

The step runs both CFG halves in one forward (prompt rows, then negative rows) at the scheduler's timestep times
the transformer's ``timestep_scale`` (1.0: the model sees the timestep as given, integers for flow_dpmpp_2m),
and combines them as the pipeline: uncond + g (cond - uncond) where g > 1; where g <= 1 the pipeline skips
classifier-free guidance and uses the prompt's prediction alone, and so does each such row here (a select on the
row's scale, no branch). The model predicts the flow velocity; the sampler update is ``samplers.sampler_step``.

Sana Sprint (a card whose guidance is embedded, ``is_sprint``) encodes the prompt alone, the same way, and runs its
own step (``sprint``: the TrigFlow angle as the flow time, the scale embedded, one forward per image).

Decoding: AutoencoderDC's ``decode(latents / scaling_factor).sample``, as the pipeline; its config has no
``out_channels``, so the LoadedModel's VAE is ``DCAE``, a thin adapter that says so. The 4K model's (a
transformer of sample_size 128) decodes in tiles of 1024 px with a stride of 896, as the model's own
instructions enable (``enable_tiling``): whole, a 4096 px decode needs tens of GiB.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from graphs import TensorSpec
from samplers import cfg_combine, model_input, sampler_step
from workers.families.encoders import place_encoder
from workers.families.base import NO_CFG
from workers.families.sana import COMPLEX_HUMAN_INSTRUCTION, Sana, builtin, is_sprint, sprint
from workers.families.textcache import encodings
from workers.loading import (LoadedModel, ModelError, assemble, cast, instantiate, load_checked_encoder, load_sharded,
                             read_config, weight_files)

CACHE_SIZE = 1024  # texts; ~1.4 GB of host memory for Gemma-2-2B in bf16
TILED_SAMPLE_SIZE = 128  # the 4K model's transformer: its VAE decodes in tiles (DCAE)
TILES = dict(tile_sample_min_height=1024, tile_sample_min_width=1024, tile_sample_stride_height=896,
             tile_sample_stride_width=896)  # the 4K model's instructions (Sana's model zoo)


class DCAE(torch.nn.Module):
    """AutoencoderDC as the engine decodes latents (``workers.decode``): ``decode(z).sample`` (B, 3, H, W), a
    ``config`` with ``out_channels`` and ``scaling_factor``, ``dtype``. ``vae``: the AutoencoderDC itself."""

    def __init__(self, vae: torch.nn.Module, tiled: bool = False):
        super().__init__()
        self.vae = vae
        self.config = SimpleNamespace(out_channels=int(vae.config.in_channels),
                                      scaling_factor=float(vae.config.scaling_factor))
        if tiled:
            vae.enable_tiling(**TILES)

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    def decode(self, z: torch.Tensor):
        return self.vae.decode(z)

    def encode_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] -> latents (B, 32, H/32, W/32) in the sampler's space: the DC-AE's latent
        (deterministic: no posterior) times its scaling factor, as SanaSprintImg2ImgPipeline encodes (without its
        SCM ``sigma_data``)."""
        return self.vae.encode(pixels.to(self.dtype)).latent * self.config.scaling_factor


class SanaRuntime(Sana):
    def reference_pipeline(self, model):
        """SanaPipeline over the model's modules (the DC-AE itself, not its adapter) with its card's scheduler:
        DPM-Solver++ on flow sigmas, or flow Euler for a directory saved with one; Sana Sprint's SanaSprintPipeline."""
        if is_sprint(model.card):
            return sprint.reference_pipeline(model)
        import diffusers as d

        cfg = model.card.scheduler
        scheduler = (d.FlowMatchEulerDiscreteScheduler(shift=cfg["flow_shift"])
                     if model.card.defaults["sampler"] == "flow_euler"
                     else d.DPMSolverMultistepScheduler.from_config(cfg))
        pipe = d.SanaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae.vae,
                              transformer=model.transformer, scheduler=scheduler)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_call(self, model, specs) -> dict:
        if is_sprint(model.card):
            return sprint.reference_call(model, specs)
        s = specs[0]
        w, h = (s.width, s.height) if s.width else model.card.native_size
        return dict(prompt=[x.prompt for x in specs], negative_prompt=[x.negative_prompt for x in specs],
                    height=h, width=w, num_inference_steps=s.steps, guidance_scale=s.guidance,
                    max_sequence_length=model.card.max_tokens, use_resolution_binning=False,
                    clean_caption=False)

    def load(self, card, device, dtype) -> LoadedModel:
        """The transformer and the DC-AE (safetensors, sharded or not), Gemma-2 (transformers, local files,
        safetensors only) and its tokenizer, from ``card.path``; the complex human instruction is the pipeline's
        unless model_index.json's ``dit_serve.complex_human_instruction`` replaces it. A built-in card
        (``sana-1600m-1024``, ``sana-sprint-1600m-1024``) gets random weights instead (``_load_builtin``)."""
        if card.builtin:
            return _load_builtin(card, device, dtype)
        from diffusers import AutoencoderDC
        from transformers import AutoTokenizer, Gemma2Model

        path = Path(card.path)
        transformer = _load_transformer(path / "transformer", device, dtype)
        vae = load_sharded(AutoencoderDC, path / "vae", device, dtype)
        model = assemble(card, transformer, DCAE(vae, tiled=transformer.config.sample_size == TILED_SAMPLE_SIZE))
        model.text_encoder = load_checked_encoder(Gemma2Model, path / "text_encoder", device, dtype)
        model.tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        extra = read_config(path / "model_index.json").get("dit_serve", {})
        _set_instruction(model, extra.get("complex_human_instruction", COMPLEX_HUMAN_INSTRUCTION))
        return model

    def cond_specs(self, model) -> dict[str, TensorSpec]:
        length, width = model.card.max_tokens, model.text_encoder.config.hidden_size
        embeds, mask = TensorSpec((length, width), model.dtype), TensorSpec((length,), model.dtype)
        if is_sprint(model.card):  # no negative prompt
            return {"prompt_embeds": embeds, "prompt_mask": mask}
        return {"prompt_embeds": embeds, "prompt_mask": mask, "neg_embeds": embeds, "neg_mask": mask}

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        """Each request's prompt (with the instruction) and negative prompt (without; Sana Sprint's: none), cache
        misses encoded in one batch per role."""
        texts = [(s.prompt.lower().strip(), s.negative_prompt.lower().strip()) for s in specs]
        prompts = encodings(model, sorted({("prompt", p) for p, _ in texts}), lambda k: _encode(model, k), CACHE_SIZE)
        if is_sprint(model.card):
            return [dict(zip(("prompt_embeds", "prompt_mask"), prompts["prompt", p])) for p, _ in texts]
        negatives = encodings(model, sorted({("negative", n) for _, n in texts}), lambda k: _encode(model, k),
                              CACHE_SIZE)
        return [{"prompt_embeds": prompts["prompt", p][0], "prompt_mask": prompts["prompt", p][1],
                 "neg_embeds": negatives["negative", n][0], "neg_mask": negatives["negative", n][1]}
                for p, n in texts]

    def step_variants(self, model) -> tuple[str, ...]:
        """Its step, and ``NO_CFG``: the step of rows whose scale is at most 1, which the pipeline runs
        without the negative forward (one forward per image instead of two). Sana Sprint's one step has one forward
        per image at any scale."""
        return ("",) if is_sprint(model.card) else ("", NO_CFG)

    def variant_of(self, model, spec) -> str:
        return NO_CFG if spec.guidance <= 1 and not is_sprint(model.card) else ""

    def encode_image(self, model, pixels, generators=None):
        """The DC-AE's latent times its scaling factor (``DCAE.encode_latents``): deterministic, no generator drawn."""
        return model.vae.encode_latents(pixels).float()

    def make_step(self, model, shape=None, variant: str = ""):
        """One whole denoising step for latents of ``shape`` (32, h, w; nothing in it depends on the shape: the
        transformer embeds any grid, the 2K and 4K ones' sin-cos table made for it): both CFG halves in one
        forward (prompt rows, then negative rows) with the text masks as the per-head bias diffusers makes of
        them (``head_bias``), guidance where the row's scale is above 1, sampler update. Sana Sprint's:
        ``sprint.make_sprint_step``."""
        if is_sprint(model.card):
            return sprint.make_sprint_step(model, head_bias)
        transformer, dtype = model.transformer, model.dtype
        c = model.latent_shape[0]
        heads = transformer.transformer_blocks[0].attn2.heads
        scale = float(transformer.config.timestep_scale)  # SanaPipeline: timestep * timestep_scale

        def step(x, t, guidance, coeffs, hist, noise, prompt_embeds, prompt_mask, neg_embeds, neg_mask):
            xin = model_input(x, coeffs).to(dtype)                                          # (B, 32, h, w)
            if variant == NO_CFG:  # rows at a scale of at most 1: the prompt's forward alone, as the pipeline
                out = transformer(xin, encoder_hidden_states=prompt_embeds,
                                  encoder_attention_mask=head_bias(prompt_mask, heads, dtype), timestep=t * scale,
                                  return_dict=False)[0]
                x_next, denoised = sampler_step(x, out[:, :c].float(), hist, noise, coeffs)
                return {"x_next": x_next, "hist_next": denoised}
            bias = head_bias(torch.cat([prompt_mask, neg_mask]), heads, dtype)             # (2B heads, 1, L)
            out = transformer(torch.cat([xin, xin]), encoder_hidden_states=torch.cat([prompt_embeds, neg_embeds]),
                              encoder_attention_mask=bias, timestep=torch.cat([t, t]) * scale,
                              return_dict=False)[0]                                        # (2B, C_out, h, w)
            cond, uncond = out[:, :c].float().chunk(2)
            g = guidance.view(-1, *(1,) * (cond.dim() - 1))
            v = torch.where(g > 1, cfg_combine(cond, uncond, guidance), cond)  # the pipeline: CFG only above 1
            x_next, denoised = sampler_step(x, v, hist, noise, coeffs)
            return {"x_next": x_next, "hist_next": denoised}

        return step


# -- the text path ------------------------------------------------------------------------------------
def _set_instruction(model, lines) -> None:
    """The complex human instruction the prompts are prefixed with (``model.instruction``, its lines joined by
    "\\n"; "" for none) and its token count with <bos> (``model.instruction_tokens``), as _get_gemma_prompt_embeds
    counts it. Lines must be text."""
    if not isinstance(lines, (list, tuple)) or not all(isinstance(x, str) for x in lines):
        raise ModelError(f"dit_serve.complex_human_instruction must be a list of strings, got {lines!r}")
    model.instruction = "\n".join(lines)
    model.instruction_tokens = len(model.tokenizer.encode(model.instruction)) if lines else 0


@torch.no_grad()
def _encode(model, keys: list[tuple[str, str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(role, text) -> ((max_tokens, D) embeddings, (max_tokens,) mask) on the host in the model's dtype, all of
    one role (``encode`` asks per role): SanaPipeline.encode_prompt's recipe (the module docstring)."""
    (role,) = {r for r, _ in keys}
    limit, tokenizer, encoder = model.card.max_tokens, model.tokenizer, model.text_encoder
    texts = [t for _, t in keys]
    length = limit
    if role == "prompt" and model.instruction:
        texts = [model.instruction + t for t in texts]
        length = model.instruction_tokens + limit - 2
    tok = tokenizer(texts, padding="max_length", max_length=length, truncation=True, add_special_tokens=True,
                    padding_side="right", return_tensors="pt")
    mask = tok.attention_mask.to(encoder.device)
    embeds = encoder(tok.input_ids.to(encoder.device), attention_mask=mask)[0]            # (n, length, D)
    if role == "prompt":  # select_index: the first token and the last limit - 1
        keep = [0, *range(length - limit + 1, length)]
        embeds, mask = embeds[:, keep], mask[:, keep]
    return list(zip(embeds.to("cpu", model.dtype), mask.to("cpu", model.dtype)))


def head_bias(mask: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """A (R, L) key mask as the (R * heads, 1, L) additive bias diffusers builds from it (SanaTransformer2DModel:
    ``(1 - mask) * -10000``, unsqueezed; SanaAttnProcessor2_0's ``prepare_attention_mask``: ``repeat_interleave``
    per head), the same values in the same order, made by expanding: under torch.compile the
    ``repeat_interleave(..., output_size=...)`` pins the batch (PixArt's cross-attention met it first). A 3-D mask
    passes the transformer's conversion untouched and is already as long as the processor wants."""
    bias = (1 - mask.to(dtype)) * -10000.0                                                # (R, L)
    return bias[:, None, None].expand(-1, heads, 1, -1).reshape(-1, 1, mask.shape[-1])


# -- loading ------------------------------------------------------------------------------------------
def _load_transformer(path: Path, device, dtype) -> torch.nn.Module:
    """SanaTransformer2DModel from sharded or single safetensors (``workers.loading.weight_files``: a missing
    shard or pickles refused), built on the meta device and given the checkpoint's tensors, as
    ``workers.loading.load_sharded``; then the sin-cos positional table of the 2K and 4K transformers
    (``interpolation_scale``), a buffer the checkpoint does not hold, made as PatchEmbed's ``__init__`` makes it."""
    from diffusers import SanaTransformer2DModel
    from diffusers.models.embeddings import get_2d_sincos_pos_embed
    from safetensors.torch import load_file

    files = weight_files(path, "diffusion_pytorch_model")
    with torch.device("meta"):
        model = instantiate(SanaTransformer2DModel, read_config(path / "config.json"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=str(torch.device(device))))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ModelError(f"weights in {path} do not match its config.json: {len(missing)} missing "
                         f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})")
    pe = model.patch_embed
    if pe.pos_embed is not None:  # (1, h w, D) float32, made on the host as a normal build makes it
        table = get_2d_sincos_pos_embed(pe.proj.out_channels, int((pe.height * pe.width) ** 0.5),
                                        base_size=pe.base_size, interpolation_scale=pe.interpolation_scale,
                                        output_type="pt")
        pe.register_buffer("pos_embed", table.float().unsqueeze(0).to(device), persistent=False)
    return cast(model, device, dtype)


def _load_builtin(card, device, dtype, **overrides) -> LoadedModel:
    """Sana 1600M with random weights made on the device (``builtin.build_sana_1600m``; Sana Sprint 1.6B's
    transformer for a Sprint card), with the attributes ``load`` sets; ``overrides`` shrink its configs (tests)."""
    parts = builtin.build_sana_1600m(card.image_size, device, dtype, sprint=is_sprint(card), **overrides)
    transformer = parts["transformer"]
    model = assemble(card, transformer, DCAE(parts["vae"], tiled=transformer.config.sample_size == TILED_SAMPLE_SIZE))
    model.text_encoder, model.tokenizer = place_encoder(parts["text_encoder"], device, dtype), parts["tokenizer"]
    _set_instruction(model, COMPLEX_HUMAN_INSTRUCTION)
    return model
