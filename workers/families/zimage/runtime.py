"""Z-Image, the torch part (the card is in ``workers.families.zimage``); Tongyi-MAI 2025, diffusers'
``ZImageTransformer2DModel`` and ``ZImagePipeline``: a single-stream DiT over one sequence of image patches
and caption tokens (Qwen3-4B's second-to-last hidden states), with 3-axis rotary positions.

Encoding follows ``ZImagePipeline._encode_prompt`` exactly: each prompt as given, wrapped by the tokenizer's
chat template (one user turn, ``add_generation_prompt=True``, ``enable_thinking=True``), tokenised and
truncated to ``max_tokens``, encoded with the attention mask, and ``hidden_states[-2]`` kept for the real
tokens only. The pipeline hands the transformer that list of variable-length tensors; a request here carries
its real tokens first, then zeros to ``max_tokens`` (``prompt_embeds``), and a mask of the real ones
(``prompt_mask``), so every shape is fixed. The pipeline pads every prompt to ``max_tokens`` for the encoder;
Qwen3 is causal, so tokens after a real one change nothing of it, and the encoder runs over the batch's
longest prompt (rounded up to a multiple of 64) instead, where the tokenizer pads on the right (Qwen's
does; one that pads on the left is run at the full length, as the pipeline runs it). The negative prompt
("" by default) is encoded the same way. Encodings are cached per model in an LRU keyed by the text, on the host.

The step (``make_step``) runs the transformer's own modules over fixed shapes (``forward``), where the
module's forward takes lists and pads each sample itself: the caption to a multiple of 32 tokens with its
``cap_pad_token`` (these take part in attention), the image to a multiple of 32 patches with its
``x_pad_token``, positions (1 + k, 0, 0) for caption token k and (L + 1, row, column) for the image, L being
the padded caption length, and one sequence [image; caption] per sample, masked to its own length. Here the
caption has ``max_tokens`` slots: those past its padded length are masked out of every attention, so each row
is the module's own sample; the rotary tables are made once per shape and the image's first axis, which
depends on the caption's padded length, is looked up per row on the device. The result equals the module's
forward (tested).

Guidance, per row, as ``ZImagePipeline.__call__``: scale s > 0 is CFG against the negative prompt, pred =
pos + s (pos - neg), with its optional norm cap (``cfg_normalization``) and no guidance where the normalised
time is past ``cfg_truncation``; s <= 0 is the prompt's prediction alone (pos + 0 (pos - neg) = pos). Both
halves run in one forward for every row, whatever its scale, so the step never branches on values; a batch
of scale-0 rows (Turbo's default) pays for the negative half all the same. The transformer predicts the
image minus the noise, so the pipeline negates it for FlowMatchEulerDiscreteScheduler: the sampler gets
``-pred``. The transformer's time is (1000 - t) / 1000 for the scheduler's t = 1000 sigma (the pipeline's),
which it multiplies by its ``t_scale``.

Latents stay (16, H/8, W/8) in the engine; the step patchifies 2x2 and unpatchifies as the module does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from graphs import TensorSpec
from samplers import model_input, sampler_step
from workers.families.encoders import padded_length, place_encoder
from workers.families.base import NO_CFG
from workers.families.textcache import encodings
from workers.families.zimage import CAPTION_MULTIPLE, GUIDANCE_OPTIONS, ZImage, builtin, guidance_options
from workers.loading import ModelError, assemble, load_checked_encoder, load_sharded, load_vae, read_config

CACHE_SIZE = 1024  # texts; 2.6 MB each for Z-Image-Turbo in bf16 (512 x 2560), ~2.7 GB of host memory
PATCH = "2-1"      # the transformer's patch size 2, frames 1: ZImagePipeline's call


class ZImageRuntime(ZImage):
    def reference_pipeline(self, model):
        """ZImagePipeline over the model's modules, flow Euler of its card's scheduler config (the pipeline
        sets its own sigma grid)."""
        import diffusers as d

        config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
        pipe = d.ZImagePipeline(scheduler=d.FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae,
                                text_encoder=model.text_encoder, tokenizer=model.tokenizer,
                                transformer=model.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_call(self, model, specs) -> dict:
        s = specs[0]
        w, h = (s.width, s.height) if s.width else model.card.native_size
        return dict(prompt=[x.prompt for x in specs], negative_prompt=[x.negative_prompt for x in specs],
                    height=h, width=w, num_inference_steps=s.steps, guidance_scale=s.guidance,
                    max_sequence_length=model.card.max_tokens)

    def load(self, card, device, dtype):
        """The transformer and VAE (safetensors, sharded or not), the Qwen3 text encoder (transformers, local
        files only, safetensors only) and its tokenizer, from ``card.path``; the directory's guidance options
        as ``cfg_normalization`` / ``cfg_truncation`` attributes of the LoadedModel. A built-in card
        (``z-image-turbo-1024``) gets random weights instead (``_load_builtin``)."""
        if card.builtin:
            return _load_builtin(card, device, dtype)
        from diffusers import ZImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen3Model

        path = Path(card.path)
        transformer = load_sharded(ZImageTransformer2DModel, path / "transformer", device, dtype)
        model = assemble(card, transformer, load_vae(path / "vae", device, dtype))
        model.text_encoder = load_checked_encoder(Qwen3Model, path / "text_encoder", device, dtype)
        model.tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        if not getattr(model.tokenizer, "chat_template", None):
            raise ModelError(f"{path}/tokenizer has no chat template: ZImagePipeline reads every prompt through it")
        for key, value in guidance_options(read_config(path / "model_index.json"), path).items():
            setattr(model, key, value)
        return model

    def cond_specs(self, model) -> dict[str, TensorSpec]:
        slots, width = model.card.max_tokens, model.transformer.config.cap_feat_dim
        embeds, mask = TensorSpec((slots, width), model.dtype), TensorSpec((slots,), model.dtype)
        return {"prompt_embeds": embeds, "prompt_mask": mask, "neg_embeds": embeds, "neg_mask": mask}

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        """Each request's prompt and negative prompt, encoded in one text-encoder batch (cache misses only)."""
        found = _encode_texts(model, sorted({t for s in specs for t in (s.prompt, s.negative_prompt)}))
        return [{"prompt_embeds": found[s.prompt][0], "prompt_mask": found[s.prompt][1],
                 "neg_embeds": found[s.negative_prompt][0], "neg_mask": found[s.negative_prompt][1]} for s in specs]

    def plan_kwargs(self, model, shape: tuple[int, int, int]) -> dict:
        """A dynamically shifted schedule's ``mu`` from the image's patch count (h/2)(w/2), as ZImagePipeline's
        ``calculate_shift(image_seq_len, ...)``; nothing for a static shift (Turbo's 3.0: the scheduler ignores
        the mu the pipeline passes)."""
        if not model.card.scheduler.get("use_dynamic_shifting", False):
            return {}
        from samplers import flow_mu

        _, h, w = shape
        return {"mu": flow_mu((h // 2) * (w // 2), model.card.scheduler)}

    def step_variants(self, model) -> tuple[str, ...]:
        """Its step, and ``NO_CFG``: the step of rows whose scale is at most 0 (Z-Image-Turbo's default), which the pipeline runs
        without the negative forward (one forward per image instead of two)."""
        return ("", NO_CFG)

    def variant_of(self, model, spec) -> str:
        return NO_CFG if spec.guidance <= 0 else ""

    def make_step(self, model, shape=None, variant: str = ""):
        """One whole denoising step for latents of ``shape`` (16, h, w; the native one by default): both CFG
        halves in one fixed-shape forward (prompt rows, then negative rows; ``forward``), the pipeline's
        guidance per row, sampler update. The rotary tables and the sequence layout depend on the shape only:
        made here (``Layout``), outside capture; the guidance options are read here too."""
        transformer, dtype = model.transformer, model.dtype
        _, h, w = shape or model.latent_shape
        layout = Layout.make(transformer, h, w, model.card.max_tokens)
        normalization = getattr(model, "cfg_normalization", GUIDANCE_OPTIONS["cfg_normalization"])
        truncation = getattr(model, "cfg_truncation", GUIDANCE_OPTIONS["cfg_truncation"])

        def step(x, t, guidance, coeffs, hist, noise, prompt_embeds, prompt_mask, neg_embeds, neg_mask):
            xin = model_input(x, coeffs).to(dtype)                                    # (B, 16, h, w)
            time = (1000 - t) / 1000                                                  # (B,) as the pipeline's
            if variant == NO_CFG:  # rows at scale 0: the prompt's forward alone, as the pipeline
                pos = forward(transformer, layout, xin, time, prompt_embeds, prompt_mask).float()
                x_next, denoised = sampler_step(x, -pos, hist, noise, coeffs)
                return {"x_next": x_next, "hist_next": denoised}
            out = forward(transformer, layout, torch.cat([xin, xin]), torch.cat([time, time]),
                          torch.cat([prompt_embeds, neg_embeds]), torch.cat([prompt_mask, neg_mask]))
            pos, neg = out.float().chunk(2)                                           # (B, 16, h, w) each
            pred = guide(pos, neg, guidance, time, normalization, truncation)
            x_next, denoised = sampler_step(x, -pred, hist, noise, coeffs)  # the scheduler steps on -pred
            return {"x_next": x_next, "hist_next": denoised}

        return step


def guide(pos: torch.Tensor, neg: torch.Tensor, scale: torch.Tensor, time: torch.Tensor, normalization: float,
          truncation: float) -> torch.Tensor:
    """ZImagePipeline's guidance per row, without branching on values: pos + s (pos - neg), where s is the
    row's scale when it is above 0 and the row's normalised time (1000 - t) / 1000 is not past ``truncation``
    (a truncation above 1 never stops it), else 0 (the prompt's prediction alone); with ``normalization`` > 0,
    a guided row whose norm exceeds ``normalization`` times the prompt's is scaled down to it."""
    s = torch.where(scale > 0, scale, torch.zeros_like(scale))                        # (B,) float32
    if truncation <= 1:
        s = torch.where(time.double() > truncation, torch.zeros_like(s), s)
    s = s.view(-1, *(1,) * (pos.dim() - 1))
    pred = pos + s * (pos - neg)
    if normalization > 0:
        dims = tuple(range(1, pos.dim()))
        limit = torch.linalg.vector_norm(pos, dim=dims, keepdim=True) * normalization
        norm = torch.linalg.vector_norm(pred, dim=dims, keepdim=True)
        pred = torch.where((s > 0) & (norm > limit), pred * (limit / norm), pred)
    return pred


# -- the transformer over fixed shapes --------------------------------------------------------------------------
@dataclass
class Layout:
    """What a fixed-shape forward of latents (16, h, w) with ``slots`` caption slots reads, made once per shape
    on the transformer's device: the image's rotary table (rows and columns; its first axis is per row), its
    padding patches', the caption's, and the first axis's table over every caption length it can follow."""

    h: int
    w: int
    patches: int                  # (h/2)(w/2)
    image_pad: int                # patches added to make a multiple of 32, as the module pads
    slots: int                    # caption slots (max_tokens, a multiple of 32)
    first_axis: int               # complex columns of the first rotary axis
    image_freqs: torch.Tensor     # (patches, head_dim / 2) complex64: axes of (0, row, column)
    pad_freqs: torch.Tensor       # (image_pad, head_dim / 2): position (0, 0, 0)
    caption_freqs: torch.Tensor   # (slots, head_dim / 2): (1 + k, 0, 0)
    frame_freqs: torch.Tensor     # (slots + 2, first_axis): the first axis at 0 .. slots + 1
    slot_index: torch.Tensor      # (slots,) int64

    @staticmethod
    def make(transformer, h: int, w: int, slots: int) -> Layout:
        """The tables of the module's ``rope_embedder`` for positions as ``patchify_and_embed`` gives them."""
        if slots % CAPTION_MULTIPLE:
            raise ValueError(f"caption slots must be a multiple of {CAPTION_MULTIPLE}, got {slots}")
        device = next(transformer.parameters()).device
        rope, grid = transformer.rope_embedder, transformer.create_coordinate_grid
        rows, cols = h // 2, w // 2
        patches = rows * cols
        with torch.no_grad():
            image = rope(grid((1, rows, cols), (0, 0, 0), device).flatten(0, 2))             # (N, hd/2)
            pad = rope(grid((1, 1, 1), (0, 0, 0), device).flatten(0, 2))                      # (1, hd/2)
            caption = rope(grid((slots, 1, 1), (1, 0, 0), device).flatten(0, 2))              # (S, hd/2)
            frames = rope(grid((slots + 2, 1, 1), (0, 0, 0), device).flatten(0, 2))          # (S + 2, hd/2)
        first = transformer.config.axes_dims[0] // 2
        image_pad = (-patches) % CAPTION_MULTIPLE
        return Layout(h, w, patches, image_pad, slots, first, image, pad.expand(image_pad, -1).contiguous(), caption,
                      frames[:, :first].contiguous(), torch.arange(slots, device=device))


def patchify(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, (h/2)(w/2), 4C): 2x2 patches as ZImageTransformer2DModel._patchify_image orders them
    (row, column, then within the patch: row, column, channel)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1)                  # (B, h/2, w/2, 2, 2, C)
    return x.reshape(b, (h // 2) * (w // 2), 4 * c)


def unpatchify(z: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, (h/2)(w/2), 4C) -> (B, C, h, w), as ZImageTransformer2DModel.unpatchify."""
    b, _, d = z.shape
    z = z.view(b, h // 2, w // 2, 2, 2, d // 4).permute(0, 5, 1, 3, 2, 4)             # (B, C, h/2, 2, w/2, 2)
    return z.reshape(b, d // 4, h, w)


def forward(transformer, layout: Layout, x: torch.Tensor, time: torch.Tensor, captions: torch.Tensor,
            caption_mask: torch.Tensor) -> torch.Tensor:
    """ZImageTransformer2DModel's forward (its basic mode, patch size 2) over fixed shapes, with its own
    modules: x (R, 16, h, w) in its dtype, time (R,) float32 in [0, 1] (the pipeline's (1000 - t) / 1000),
    captions (R, slots, cap_feat_dim) with their real tokens first and caption_mask (R, slots) marking them.
    Returns its prediction (R, 16, h, w)."""
    tr, lay = transformer, layout
    rows, dim = x.shape[0], tr.config.dim
    adaln = tr.t_embedder(time * tr.t_scale).type_as(x)                                # (R, 256)

    real = caption_mask.float().sum(-1).long().clamp(min=1)                          # (R,) real tokens
    padded = (real + CAPTION_MULTIPLE - 1) // CAPTION_MULTIPLE * CAPTION_MULTIPLE   # (R,) with cap_pad_tokens
    keep = lay.slot_index < padded[:, None]                                          # (R, S) attended slots
    pads = lay.slot_index >= real[:, None]                                           # (R, S) cap_pad_token slots

    # the image: patches embedded, x_pad_token to a multiple of 32, positions (L + 1, row, column)
    image = tr.all_x_embedder[PATCH](patchify(x))                                    # (R, N, dim)
    first = lay.frame_freqs[padded + 1]                                              # (R, first_axis)
    image_freqs = torch.cat([first[:, None].expand(-1, lay.patches, -1),
                             lay.image_freqs[None, :, lay.first_axis:].expand(rows, -1, -1)], dim=-1)
    if lay.image_pad:
        image = torch.cat([image, tr.x_pad_token[None].expand(rows, lay.image_pad, dim)], dim=1)
        image_freqs = torch.cat([image_freqs, lay.pad_freqs[None].expand(rows, -1, -1)], dim=1)
    for layer in tr.noise_refiner:
        image = layer(image, None, image_freqs, adaln)                               # (R, Np, dim)

    # the caption: embedded, cap_pad_token past its real tokens, positions (1 + k, 0, 0), masked past its padding
    caption = tr.cap_embedder(captions)                                              # (R, S, dim)
    caption = torch.where(pads[..., None], tr.cap_pad_token, caption)
    caption_freqs = lay.caption_freqs[None].expand(rows, -1, -1)
    for layer in tr.context_refiner:
        caption = layer(caption, keep, caption_freqs)

    # one sequence [image; caption]
    unified = torch.cat([image, caption], dim=1)                                     # (R, Np + S, dim)
    freqs = torch.cat([image_freqs, caption_freqs], dim=1)
    mask = torch.cat([torch.ones_like(keep[:, :1]).expand(-1, image.shape[1]), keep], dim=1)
    for layer in tr.layers:
        unified = layer(unified, mask, freqs, adaln)
    out = tr.all_final_layer[PATCH](unified, c=adaln)[:, :lay.patches]              # (R, N, 64)
    return unpatchify(out, lay.h, lay.w)


# -- the text path ----------------------------------------------------------------------------------------------
@torch.no_grad()
def _encode_texts(model, texts: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    def encode(missing: list[str]):  # kept on the host
        embeds, mask = encode_prompts(model, missing)
        return list(zip(embeds.to("cpu", model.dtype), mask.to("cpu", model.dtype)))

    return encodings(model, texts, encode, CACHE_SIZE)


def chat_texts(tokenizer, prompts: list[str]) -> list[str]:
    """Each prompt as one user turn of the chat template, with the generation prompt, thinking on: the text
    ZImagePipeline._encode_prompt tokenises."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=True) for p in prompts]


def encode_prompts(model, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, max_tokens, D) Qwen3 second-to-last hidden states of each prompt's real tokens, first, then zeros,
    and (n, max_tokens) their mask: ZImagePipeline._encode_prompt's list, laid out at a fixed length (see the
    module docstring for the length the encoder runs at)."""
    limit, tokenizer, encoder = model.card.max_tokens, model.tokenizer, model.text_encoder
    right = tokenizer.padding_side == "right"
    tok = tokenizer(chat_texts(tokenizer, prompts), padding="longest" if right else "max_length", max_length=limit,
                    truncation=True, return_tensors="pt")
    ids, mask = tok.input_ids, tok.attention_mask.bool()                                 # (n, l)
    if right:  # up to a few lengths: the padding is masked and after every real token
        length = padded_length(ids.shape[1], limit)
        ids = torch.nn.functional.pad(ids, (0, length - ids.shape[1]), value=tokenizer.pad_token_id)
        mask = torch.nn.functional.pad(mask, (0, length - mask.shape[1]))
    device = encoder.device
    hidden = encoder(input_ids=ids.to(device), attention_mask=mask.to(device),
                     output_hidden_states=True).hidden_states[-2]                       # (n, l, D)
    embeds = hidden.new_zeros(len(prompts), limit, hidden.shape[-1])
    keep = torch.zeros(len(prompts), limit, dtype=torch.bool, device=hidden.device)
    for i, row in enumerate(mask.to(hidden.device)):
        real = hidden[i][row]                                                            # the pipeline's item i
        embeds[i, :len(real)] = real
        keep[i, :len(real)] = True
    return embeds, keep


# -- loading ----------------------------------------------------------------------------------------------------
def _load_builtin(card, device, dtype, **overrides):
    """Z-Image-Turbo with random weights made on the device (``builtin.build_zimage_turbo``), with the attributes
    ``load`` sets (the pipeline's guidance options); ``overrides`` shrink its configs (tests)."""
    parts = builtin.build_zimage_turbo(card.image_size, device, dtype, **overrides)
    model = assemble(card, parts.pop("transformer"), parts.pop("vae"))
    model.text_encoder = place_encoder(parts.pop("text_encoder"), device, dtype)
    model.tokenizer = parts.pop("tokenizer")
    for key, value in GUIDANCE_OPTIONS.items():
        setattr(model, key, value)
    return model
