"""Stable Diffusion 3 and 3.5, the torch part (the card is in ``workers.families.sd3``); Esser et al. 2024,
"Scaling Rectified Flow Transformers", diffusers' ``SD3Transformer2DModel``, ``StableDiffusion3Pipeline``: an
MMDiT that reads a prompt through three text encoders and predicts the rectified-flow velocity (the
``flow_euler`` plan; shift 3.0 from the card's scheduler config).

The condition of a row is two tensors, made as ``StableDiffusion3Pipeline.encode_prompt`` makes them
(clip_skip None, nothing lower-cased or stripped, no attention masks anywhere):

    clip   = [CLIP-L penultimate hidden states | CLIP-bigG's]       (77, 768 + 1280), zero-padded to 4096
    embeds = [clip ; T5 last hidden states]                          (77 + max_tokens, 4096)
    pooled = [CLIP-L text projection | CLIP-bigG's]                  (2048,)

T5 is padded (and truncated) to ``max_tokens``; without T5 (no text_encoder_3/, or ``skip_t5``) its part
is zeros, as the reference with ``text_encoder_3=None``. The negative prompt is encoded the same way ("" by
default, encoded, not zeros). Every prompt has the same shape, so the step is graph-stable. Encodings are
cached per model in an LRU keyed by the text, on the host (2.7 MB a text in bf16 at 333 tokens: a device
cache of pixart's size would hold 11 GB of GPU memory); the engine uploads a request's rows at admission.

Decoding: SD3's VAE has a shift factor, ``pixels = vae.decode(latents / scaling_factor + shift_factor)``,
which the engine's ``decode`` applies (``LoadedModel.vae_shift``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from graphs import TensorSpec
from samplers import cfg_combine, model_input, sampler_step
from workers.speed import modulation
from workers.families.encoders import load_text_encoder, place_encoder
from workers.families.sd3 import SD3, builtin, fast, skips_t5  # noqa: F401 (fast: its routed attention registers on import)
from workers.families.textcache import encodings
from workers.loading import (ModelError, assemble, cast, load_component, load_vae, read_config,
                             refuse_without_safetensors)
from workers.speed.modulation import give as give_modulation

CACHE_SIZE = 1024  # texts; ~2.8 GB of host memory for SD3.5 in bf16


def _load_builtin(card, device, dtype, **overrides):
    """SD3.5 medium with random weights made on the device (``builtin.build_sd35_medium``), with the
    attributes ``load`` sets; ``overrides`` shrink its configs (tests)."""
    parts = builtin.build_sd35_medium(card.image_size, device, dtype, **overrides)
    model = assemble(card, parts.pop("transformer"), parts.pop("vae"))
    for name, part in parts.items():  # text_encoder, tokenizer, ..._2, ..._3
        setattr(model, name, place_encoder(part, device, dtype) if name.startswith("text_encoder") else part)
    return model


def _encoder(cls, path: Path, suffix: str, device, dtype):
    """text_encoder{suffix}/ by transformers' loader (shards, tied weights) and tokenizer{suffix}/, local files
    only; pickle weights refused first, with the message the transformer's get."""
    from transformers import AutoTokenizer

    folder = path / f"text_encoder{suffix}"
    refuse_without_safetensors(folder, "model.safetensors")

    encoder = load_text_encoder(cls, folder, device, dtype)  # shared when the weights are identical
    tokenizer = AutoTokenizer.from_pretrained(str(path / f"tokenizer{suffix}"), local_files_only=True)
    return encoder, tokenizer


def _check_widths(model, path: Path) -> None:
    """The encoders fit the transformer, as the pipeline assumes without checking: CLIP-L + bigG hidden
    sizes within T5's width = joint_attention_dim, the projections = pooled_projection_dim."""
    cfg, clips = model.transformer.config, (model.text_encoder.config, model.text_encoder_2.config)
    t5 = model.text_encoder_3.config.d_model if model.text_encoder_3 is not None else cfg.joint_attention_dim
    problems = []
    if t5 != cfg.joint_attention_dim:
        problems.append(f"T5's d_model {t5} != the transformer's joint_attention_dim {cfg.joint_attention_dim}")
    if sum(c.hidden_size for c in clips) > cfg.joint_attention_dim:
        problems.append(f"the CLIP hidden sizes {[c.hidden_size for c in clips]} add up to more than "
                        f"joint_attention_dim {cfg.joint_attention_dim}")
    if sum(c.projection_dim for c in clips) != cfg.pooled_projection_dim:
        problems.append(f"the CLIP projections {[c.projection_dim for c in clips]} do not add up to "
                        f"pooled_projection_dim {cfg.pooled_projection_dim}")
    if model.tokenizer.model_max_length > min(c.max_position_embeddings for c in clips):
        problems.append(f"tokenizer/ pads to {model.tokenizer.model_max_length} tokens, more than CLIP's positions")
    if problems:
        raise ModelError(f"{path}: the text encoders do not fit the transformer: {'; '.join(problems)}")


# -- the family interface -----------------------------------------------------------------------------
class SD3Runtime(SD3):
    def reference_pipeline(self, model):
        """StableDiffusion3Pipeline over the model's modules, flow Euler of its card's scheduler config."""
        import diffusers as d

        config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
        pipe = d.StableDiffusion3Pipeline(
            text_encoder=model.text_encoder, tokenizer=model.tokenizer, text_encoder_2=model.text_encoder_2,
            tokenizer_2=model.tokenizer_2, text_encoder_3=model.text_encoder_3, tokenizer_3=model.tokenizer_3,
            transformer=model.transformer, vae=model.vae,
            scheduler=d.FlowMatchEulerDiscreteScheduler.from_config(config))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_call(self, model, specs) -> dict:
        s = specs[0]
        w, h = (s.width, s.height) if s.width else model.card.native_size
        return dict(prompt=[x.prompt for x in specs], negative_prompt="", height=h, width=w,
                    num_inference_steps=s.steps, guidance_scale=s.guidance,
                    max_sequence_length=model.card.max_tokens)

    def load(self, card, device, dtype):
        """The transformer and VAE (safetensors, sharded or not), both CLIPs and T5 (transformers, local files,
        safetensors only) and their tokenizers. Beyond LoadedModel's ``text_encoder`` / ``tokenizer`` (CLIP-L),
        the model gets the attributes ``text_encoder_2`` / ``tokenizer_2`` (bigG), ``text_encoder_3`` /
        ``tokenizer_3`` (T5; None when skipped). ``assemble`` sets ``vae_shift`` from the VAE's shift_factor.
        A built-in card (``sd35-medium-1024``) gets random weights instead (``_load_builtin``)."""
        if card.builtin:
            return _load_builtin(card, device, dtype)
        from diffusers import SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        path = Path(card.path)
        transformer = load_component(SD3Transformer2DModel, path / "transformer")  # every *.safetensors: a file or all shards
        model = assemble(card, cast(transformer, device, dtype), load_vae(path / "vae", device, dtype))
        clip = CLIPTextModelWithProjection
        model.text_encoder, model.tokenizer = _encoder(clip, path, "", device, dtype)
        model.text_encoder_2, model.tokenizer_2 = _encoder(clip, path, "_2", device, dtype)
        model.text_encoder_3 = model.tokenizer_3 = None
        if not skips_t5(path, read_config(path / "model_index.json")):
            model.text_encoder_3, model.tokenizer_3 = _encoder(T5EncoderModel, path, "_3", device, dtype)
        _check_widths(model, path)
        return model

    def cond_specs(self, model) -> dict[str, TensorSpec]:
        cfg = model.transformer.config
        embeds = TensorSpec((_clip_tokens(model) + model.card.max_tokens, cfg.joint_attention_dim), model.dtype)
        pooled = TensorSpec((cfg.pooled_projection_dim,), model.dtype)
        return {"prompt_embeds": embeds, "pooled": pooled, "neg_embeds": embeds, "neg_pooled": pooled}

    def table_specs(self, model) -> dict[str, TensorSpec]:
        """The step's inputs that change every step and are known at admission: the modulation's rows of the
        step, the prompt's then the negative prompt's (``workers.modulation``, tables), where the engine hoisted it."""
        cache = modulation.temb_modulation(model.transformer)
        if cache is None:
            return {}
        return {"modulation": TensorSpec((2, cache.width), model.dtype)}

    def step_tables(self, model, plans, specs, conds) -> list[dict[str, torch.Tensor]]:
        """Each request's modulation at every step of its plan, (S, 2, width) on the model's device (the prompt's
        row, then the negative prompt's), in one product for all of ``specs`` (the engine asks only where
        ``table_specs`` is not empty)."""
        steps = [p.num_steps for p in plans]
        expand = lambda key: torch.cat([c[key][None].expand(n, -1) for c, n in zip(conds, steps)])
        rows = self.table_inputs(model, {"t": torch.cat([p.timesteps for p in plans]), "pooled": expand("pooled"),
                                    "neg_pooled": expand("neg_pooled")})
        return [{"modulation": m} for m in rows["modulation"].split(steps)]

    @torch.no_grad()
    def table_inputs(self, model, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The ``table_specs`` inputs of the step's rows ``inputs`` (its t, pooled and neg_pooled, (N, ...) each):
        (N, 2, width), the products of the embeddings of the timestep with the pooled prompt, then with the
        negative one, as the step computes them."""
        device, dtype, tr = model.device, model.dtype, model.transformer
        t = inputs["t"].to(device, torch.float32)
        pooled = torch.cat([inputs["pooled"], inputs["neg_pooled"]]).to(device, dtype)
        temb = tr.time_text_embed.forward(torch.cat([t, t]), pooled)  # the forward: the hook must not fire
        table = modulation.temb_modulation(tr).table(temb)            # (2N, width)
        return {"modulation": table.unflatten(0, (2, len(t))).transpose(0, 1)}  # (N, 2, width)

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        """Each request's prompt and negative prompt, encoded in one batch per text encoder (cache misses only)."""
        found = _encode_texts(model, sorted({t for s in specs for t in (s.prompt, s.negative_prompt)}))
        return [{"prompt_embeds": found[s.prompt][0], "pooled": found[s.prompt][1],
                 "neg_embeds": found[s.negative_prompt][0], "neg_pooled": found[s.negative_prompt][1]} for s in specs]

    def make_step(self, model, shape=None):
        """One whole denoising step: both CFG halves in one forward (prompt rows, then negative rows), guidance,
        sampler update. Nothing depends on ``shape``: the transformer crops its positional embedding to the
        latents' size itself. ``modulation``: the step's rows of the requests' modulation tables (``table_specs``)."""
        transformer, dtype = model.transformer, model.dtype

        def step(x, t, guidance, coeffs, hist, noise, prompt_embeds, pooled, neg_embeds, neg_pooled, modulation=None):
            xin = model_input(x, coeffs).to(dtype)                                        # (B, C, H, W)
            if modulation is not None:  # (B, 2, width): this step's rows of the requests' tables, as the rows below
                give_modulation(transformer, torch.cat([modulation[:, 0], modulation[:, 1]]))
            out = transformer(hidden_states=torch.cat([xin, xin]),                          # (2B, C, H, W)
                              timestep=torch.cat([t, t]),                                   # (2B,) sigma * 1000
                              encoder_hidden_states=torch.cat([prompt_embeds, neg_embeds]),  # (2B, 77 + L, 4096)
                              pooled_projections=torch.cat([pooled, neg_pooled]),           # (2B, 2048)
                              return_dict=False)[0]                                         # (2B, C, H, W) velocity
            cond, uncond = out.float().chunk(2)
            x_next, denoised = sampler_step(x, cfg_combine(cond, uncond, guidance), hist, noise, coeffs)
            return {"x_next": x_next, "hist_next": denoised}

        return step


# -- the text path ------------------------------------------------------------------------------------
def _clip_tokens(model) -> int:
    """CLIP's token count: tokenizer/'s model_max_length (77), which the pipeline uses for both CLIPs."""
    return int(model.tokenizer.model_max_length)


@torch.no_grad()
def _encode_texts(model, texts: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    def encode(missing: list[str]):  # kept on the host: 2.7 MB per prompt in bf16
        embeds, pooled = _encode_prompts(model, missing)
        return list(zip(embeds.to("cpu", model.dtype), pooled.to("cpu", model.dtype)))

    return encodings(model, texts, encode, CACHE_SIZE)


def _encode_prompts(model, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 77 + max_tokens, W) prompt embeddings and (n, P) pooled ones, as encode_prompt."""
    clip_l, pooled_l = _clip(model.text_encoder, model.tokenizer, texts, _clip_tokens(model))
    clip_g, pooled_g = _clip(model.text_encoder_2, model.tokenizer_2, texts, _clip_tokens(model))
    t5 = _t5(model, texts)                                                       # (n, L, W)
    clip = torch.cat([clip_l, clip_g], dim=-1)                                   # (n, 77, 768 + 1280)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))   # (n, 77, W)
    return torch.cat([clip, t5], dim=-2), torch.cat([pooled_l, pooled_g], dim=-1)


def _clip(encoder, tokenizer, texts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The penultimate hidden states (n, 77, D) and the text projection (n, P): _get_clip_prompt_embeds."""
    ids = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids
    out = encoder(ids.to(encoder.device), output_hidden_states=True)
    return out.hidden_states[-2], out[0]


def _t5(model, texts: list[str]) -> torch.Tensor:
    """T5's last hidden states (n, max_tokens, W), no mask (as _get_t5_prompt_embeds); zeros without T5."""
    length, encoder = model.card.max_tokens, model.text_encoder_3
    if encoder is None:
        return torch.zeros((len(texts), length, model.transformer.config.joint_attention_dim),
                           device=model.text_encoder.device, dtype=model.text_encoder.dtype)
    ids = model.tokenizer_3(texts, padding="max_length", max_length=length, truncation=True,
                            add_special_tokens=True, return_tensors="pt").input_ids
    return encoder(ids.to(encoder.device))[0]
