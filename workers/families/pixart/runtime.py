"""PixArt-α and PixArt-Σ, the torch part (the card, in ``workers.families.pixart``): the condition
is a prompt, encoded by T5 into ``max_tokens`` embeddings with an attention mask; classifier-free
guidance pairs each row with the negative prompt's encoding ("" by default: the unconditional one).

Encoding follows ``PixArtSigmaPipeline.encode_prompt`` with ``clean_caption=False``: the text is
lower-cased and stripped, tokenised to exactly ``max_tokens`` (padded, truncated), and encoded with
its mask. Every prompt is padded to ``max_tokens``, so the cross-attention's shapes do not depend on
the prompt and the step stays graph-stable (the mask keeps padding out of the result). Encodings are
cached per model in an LRU keyed by the processed text (10,000 images of one prompt encode once).
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphs import TensorSpec
from samplers import cfg_combine, model_input, sampler_step
from workers.families.encoders import load_text_encoder, padded_length, place_encoder
from workers.families.pixart import PixArt
from workers.families.pixart.builtin import build_pixart_sigma
from workers.families.textcache import encodings
from workers.kernels.varlen import kernel_name
from workers.loading import LoadedModel, assemble, cast, load_component, load_vae, refuse_without_safetensors
from workers.speed.varlen import VarlenCrossAttention, restore_cross_attention, varlen_cross_attention

CACHE_SIZE = 4096


class PixArtRuntime(PixArt):
    def reference_pipeline(self, model):
        """PixArtSigmaPipeline over the model's modules, DPM-Solver++ of its card's scheduler config."""
        import diffusers as d

        pipe = d.PixArtSigmaPipeline(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                                     transformer=model.transformer,
                                     scheduler=d.DPMSolverMultistepScheduler.from_config(dict(model.card.scheduler)))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_call(self, model, specs) -> dict:
        s = specs[0]
        w, h = (s.width, s.height) if s.width else model.card.native_size
        return dict(prompt=[x.prompt for x in specs], negative_prompt="", height=h, width=w,
                    num_inference_steps=s.steps, guidance_scale=s.guidance, clean_caption=False,
                    use_resolution_binning=False, max_sequence_length=model.card.max_tokens)

    def load(self, card, device, dtype) -> LoadedModel:
        """A pipeline directory (``_load_pixart``; its vae/ loaded first, when it has one), or PixArt-Σ with
        random weights (a built-in card)."""
        if card.builtin:
            return _builtin_pixart(card, device, dtype)
        path = Path(card.path)
        vae = load_vae(path / "vae", device, dtype) if (path / "vae" / "config.json").is_file() else None
        return _load_pixart(card, path, vae, device, dtype)

    def cond_specs(self, model) -> dict[str, TensorSpec]:
        length, width = model.card.max_tokens, model.text_encoder.config.d_model
        embeds, mask = TensorSpec((length, width), model.dtype), TensorSpec((length,), model.dtype)
        return {"prompt_embeds": embeds, "prompt_mask": mask, "neg_embeds": embeds, "neg_mask": mask}

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        """Each request's prompt and negative prompt, encoded in one text-encoder batch (cache misses only)."""
        texts = [(s.prompt.lower().strip(), s.negative_prompt.lower().strip()) for s in specs]
        found = _encode_texts(model, sorted({t for pair in texts for t in pair}))
        return [{"prompt_embeds": found[p][0], "prompt_mask": found[p][1],
                 "neg_embeds": found[n][0], "neg_mask": found[n][1]} for p, n in texts]

    def set_cross_attention(self, model, mode: str) -> None:
        """``padded``: diffusers' cross-attention over all ``max_tokens`` keys with the mask (graph-stable);
        ``varlen``: each row attends to its real tokens only, in an eager break (workers.speed.varlen); ``auto``:
        the measured default."""
        mode = DEFAULT_CROSS_ATTENTION if mode == "auto" else mode
        if mode not in ("padded", "varlen"):
            raise ValueError(f"cross_attention must be 'auto', 'padded' or 'varlen', got {mode!r}")
        (varlen_cross_attention if mode == "varlen" else restore_cross_attention)(model.transformer)

    def needs_breaks(self, model) -> bool:
        """Whether this model's step has eager breaks: varlen cross-attention (its kernel plans from each row's
        real prompt length) is one; padded cross-attention captures whole."""
        blocks = model.transformer.transformer_blocks
        return bool(blocks) and isinstance(getattr(blocks[0].attn2, "processor", None), VarlenCrossAttention)

    def attention_kernel(self, model) -> str:
        """The cross-attention kernel this model's steps run (reported by the engine at start-up)."""
        if self.needs_breaks(model):
            return "cross-attention: " + kernel_name(model.device, model.dtype, model.transformer.config.attention_head_dim)
        return "cross-attention: padded to the token limit, masked (SDPA)"

    def make_step(self, model, shape=None):
        """One whole denoising step for latents of ``shape`` (C, H, W; the native one by default): both CFG
        halves in one forward (prompt rows, then negative rows), guidance, sampler update. A learned-sigma
        output keeps its first half, as the pipeline does. The transformer's positional embedding follows
        the latents' size. PixArt-α at 1024 px also conditions on the image's resolution and aspect ratio:
        fixed per shape, so they are device tensors made here, outside capture, and broadcast over the batch."""
        transformer, c, dtype = model.transformer, model.latent_shape[0], model.dtype
        _, lh, lw = shape or model.latent_shape
        factor = model.card.image_size // model.card.latent_size
        height, width = float(lh * factor), float(lw * factor)
        sizes = None
        if getattr(transformer, "use_additional_conditions", False):  # as PixArtAlphaPipeline at sample_size 128
            sizes = (torch.tensor([[height, width]], dtype=dtype, device=model.device),  # (1, 2)
                     torch.tensor([[height / width]], dtype=dtype, device=model.device))  # (1, 1) aspect ratio

        # the cross-attention mode set when the step is made (the engine sets it once, at start): read here, not
        # in the step, which dynamo traces (torch 2.11's could not trace the check: the step ran uncompiled)
        heads = None if self.needs_breaks(model) else transformer.transformer_blocks[0].attn2.heads

        def step(x, t, guidance, coeffs, hist, noise, prompt_embeds, prompt_mask, neg_embeds, neg_mask):
            xin = model_input(x, coeffs).to(dtype)                                  # (B, C, H, W)
            rows = 2 * x.shape[0]
            extra = {"resolution": None, "aspect_ratio": None} if sizes is None else {
                "resolution": sizes[0].expand(rows, 2), "aspect_ratio": sizes[1].expand(rows, 1)}
            mask = torch.cat([prompt_mask, neg_mask])                              # (2B, L)
            if heads is not None:  # padded: the per-head bias made here, as diffusers makes it (see head_bias)
                mask = head_bias(mask, heads, dtype)
            out = transformer(torch.cat([xin, xin]), encoder_hidden_states=torch.cat([prompt_embeds, neg_embeds]),
                              encoder_attention_mask=mask,
                              timestep=torch.cat([t, t]), added_cond_kwargs=extra).sample  # (2B, C_out, H, W)
            cond, uncond = out[:, :c].float().chunk(2)
            x_next, denoised = sampler_step(x, cfg_combine(cond, uncond, guidance), hist, noise, coeffs)
            return {"x_next": x_next, "hist_next": denoised}

        return step


@torch.no_grad()
def _encode_texts(model, texts: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each text's (max_tokens, D) embeddings and (max_tokens,) mask, as the pipeline's ``encode_prompt``
    pads them, but encoded over the batch's longest real length only (see ``real_length_encode``)."""
    def encode(missing: list[str]):
        embeds, mask = real_length_encode(model, missing)
        return list(zip(embeds.to(model.dtype), mask.to(model.dtype)))

    return encodings(model, texts, encode, CACHE_SIZE)


def real_length_encode(model, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """T5 over the batch's real token count (rounded up to a few lengths), then zeros to ``max_tokens``:
    (n, max_tokens, D) embeddings and (n, max_tokens) mask.

    The pipeline encodes every prompt padded to ``max_tokens`` (300 for PixArt-Σ). The padding changes no
    real token's embedding (the encoder's attention mask keeps padding out, and T5's position bias is
    relative) and no image (every consumer of the embeddings masks the padding: the padded cross-attention
    by the mask, the varlen one by leaving it out). So the padding positions are left at zero rather than
    encoded, and a prompt of 20 tokens costs T5 64 positions, not 300. The length is rounded up to a
    multiple of 64 (``workers.families.encoders.padded_length``) so that an engine's encoder graphs
    (``model.text_graphs``) meet a few shapes; without them the encoder runs as it is."""
    limit = model.card.max_tokens
    tok = model.tokenizer(texts, padding="longest", max_length=limit, truncation=True, add_special_tokens=True,
                          return_tensors="pt")
    ids, mask = tok.input_ids, tok.attention_mask                                        # (n, l)
    length = padded_length(ids.shape[1], limit)
    ids, mask = (torch.nn.functional.pad(t, (0, length - t.shape[1])) for t in (ids, mask))  # pad id 0, masked
    device = model.text_encoder.device
    ids, mask = ids.to(device), mask.to(device)
    if model.text_graphs is not None:
        hidden = model.text_graphs(ids, mask)                                            # (n, length, D)
    else:
        hidden = model.text_encoder(ids, attention_mask=mask)[0]
    n, _, width = hidden.shape
    embeds = hidden.new_zeros(n, limit, width)
    embeds[:, :length] = hidden * mask[..., None].to(hidden.dtype)                       # padding: zeros
    full = mask.new_zeros(n, limit)
    full[:, :length] = mask
    return embeds, full


DEFAULT_CROSS_ATTENTION = "varlen"  # measured on an H200 (docs/benchmarks/pixart.md): as fast or faster at
                                   # every batch from 2 up, at 512 and 1024 px; within 3% at one 512 px image


def head_bias(mask: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """A (R, L) key mask as the (R * heads, 1, L) additive bias diffusers' padded cross-attention builds from
    it (PixArtTransformer2DModel: ``(1 - mask) * -10000``, unsqueezed; AttnProcessor2_0:
    ``repeat_interleave`` per head), the same values in the same order. Made here by expanding instead:
    under torch.compile diffusers' ``repeat_interleave(..., output_size=...)`` pinned the batch to the
    size it was traced at on CUDA (every bucket would recompile, so the step ran uncompiled). A 3-D mask
    passes through the transformer's own conversion, and is already as long as the processor wants."""
    bias = (1 - mask.to(dtype)) * -10000.0                                     # (R, L)
    return bias[:, None, None].expand(-1, heads, 1, -1).reshape(-1, 1, mask.shape[-1])  # (R * heads, 1, L)


def _load_pixart(card, path: Path, vae, device, dtype) -> LoadedModel:
    """PixArtTransformer2DModel, the T5 encoder (transformers) and its tokenizer, from local files only."""
    from diffusers import PixArtTransformer2DModel
    from transformers import AutoTokenizer, T5EncoderModel

    transformer = load_component(PixArtTransformer2DModel, path / "transformer")
    refuse_without_safetensors(path / "text_encoder", "model.safetensors")
    # transformers' loader: sharded checkpoints and tied embeddings; use_safetensors refuses pickles; one
    # copy per process for identical weights (workers.families.encoders)
    encoder = load_text_encoder(T5EncoderModel, path / "text_encoder", device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
    model = assemble(card, cast(transformer, device, dtype), vae)
    model.text_encoder, model.tokenizer = encoder, tokenizer
    return model


def _builtin_pixart(card, device, dtype) -> LoadedModel:
    """PixArt-Σ-XL/2 with a T5-XXL-sized encoder and the SDXL VAE, random weights made on the device
    (``builtin``: never materialised on the host)."""
    transformer, encoder, tokenizer, vae = build_pixart_sigma(card.image_size, device, dtype)
    model = assemble(card, transformer, vae)
    model.text_encoder, model.tokenizer = place_encoder(encoder, device, dtype), tokenizer
    return model
