"""FLUX.2 [klein] and [dev], the torch part (the card is in ``workers.families.flux2``); Black Forest Labs 2025-26,
diffusers' ``Flux2Transformer2DModel``, ``Flux2KleinPipeline`` and ``Flux2Pipeline``: a rectified-flow MMDiT over
image tokens of 128 channels (the VAE's 32, patchified 2x2) and a prompt read by a decoder-only language model,
three of its hidden layers side by side (``prompt_embeds``, max_tokens x 3 x its width).

Text, as ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` / ``Flux2Pipeline._get_mistral_3_small_prompt_embeds``:
[klein] puts the prompt as given in the tokenizer's chat template (one user turn, the generation prompt, thinking
off), [dev] in Mistral's (its system message, then the user turn; "[IMG]" removed from the prompt, as
``format_input``); both pad to ``max_tokens`` ("max_length", truncating), run the encoder with that attention
mask, and stack hidden states (9, 18, 27) (Qwen3) or (10, 20, 30) (Mistral), concatenated per token. The encoder's
language model is run without its LM head (the pipelines compute logits they never read: the hidden states are
the same). The transformer takes no text mask (neither pipeline passes one): padding tokens take part, as in the
reference, and the text length is fixed per model. Encodings are cached per model by prompt on the host.

Guidance. [klein] step-distilled: one forward per image, the scale ignored. [klein] base: both CFG halves in one
forward (prompt rows, then negative-prompt rows), and the pipeline's rule per row: ``neg + g (cond - neg)`` where
g > 1, the prompt's velocity alone otherwise (``do_classifier_free_guidance``); the pipeline's negative prompt is
"", the request's when it has one (the pipeline takes its embeddings as ``negative_prompt_embeds``). [dev]: the
scale is a network input, one row per image.

Latents. The engine keeps each request's latents as the pipeline's before packing, (128, H/16, W/16), normalised
by the VAE's batch-norm statistics; the step flattens the cells into tokens (``_pack_latents``) and back, and the
update is elementwise. ``Flux2VAE`` wraps the VAE for the engine's generic decode: its ``decode`` undoes the
normalisation and the patchify (``latents * std + mean``, ``_unpatchify_latents``), as the pipelines do before
``vae.decode``.

Schedule: ``plan_kwargs`` gives make_plan the pipelines' ``compute_empirical_mu`` of the packed sequence length,
a function of the step count (samplers.make_plan calls it with the request's).

Graph safety: the 4-axis position ids (image (0, row, column, 0); text (0, 0, 0, token)) and the rotary tables
the transformer would make of them at each call are made once per shape in ``make_step``; the step has no host
synchronisation and no branch on tensor values.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import torch

from graphs import TensorSpec
from samplers import cfg_combine, model_input, sampler_step
from workers.families.encoders import place_encoder
from workers.families.base import NO_CFG
from workers.families.flux2 import DEV, ENCODER_LAYERS, KLEIN, Flux2
from workers.families.textcache import encodings
from workers.loading import ModelError, assemble, cast, load_checked_encoder, load_component, load_sharded, read_config

CACHE_SIZE = 256  # prompts per model: 7.5 MiB each for [klein] 4B in bf16, 15 MiB for [dev]


class Flux2Runtime(Flux2):
    def cond_specs(self, model) -> dict[str, TensorSpec]:
        spec = TensorSpec((model.card.max_tokens, model.transformer.config.joint_attention_dim), model.dtype)
        return {"prompt_embeds": spec, **({"neg_embeds": spec} if model.card.guidance_mode == "cfg" else {})}

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        """Each request's prompt (and, under CFG, negative prompt), encoded in one batch (cache misses only)."""
        cfg = model.card.guidance_mode == "cfg"
        found = _encode_texts(model, sorted({t for s in specs for t in ((s.prompt, s.negative_prompt) if cfg
                                                                         else (s.prompt,))}))
        return [{"prompt_embeds": found[s.prompt][0], **({"neg_embeds": found[s.negative_prompt][0]} if cfg else {})}
                for s in specs]

    def plan_kwargs(self, model, shape: tuple[int, int, int]) -> dict:
        """The pipelines' shift: ``mu = compute_empirical_mu(image_seq_len, num_steps)`` with the packed sequence
        length h w, handed to make_plan as a function of the step count; nothing for a static shift (the
        scheduler ignores mu then)."""
        if not model.card.scheduler.get("use_dynamic_shifting", False):
            return {}
        _, h, w = shape
        return {"mu": functools.partial(empirical_mu, h * w)}

    def step_variants(self, model) -> tuple[str, ...]:
        """Its step, and ``NO_CFG``: the step of rows whose scale is at most 1 ([klein] base), which the pipeline runs
        without the negative forward (one forward per image instead of two)."""
        return ("", NO_CFG) if model.card.guidance_mode == "cfg" else ("",)

    def variant_of(self, model, spec) -> str:
        return NO_CFG if model.card.guidance_mode == "cfg" and spec.guidance <= 1 else ""

    def encode_image(self, model, pixels, generators=None):
        """The VAE's mode (every FLUX.2 pipeline encodes with ``sample_mode="argmax"``: no generator is drawn from),
        patchified and normalised by its batch-norm statistics: ``Flux2VAE.encode_latents``."""
        return model.vae.encode_latents(pixels).float()

    def mask_latents(self, model, mask, shape):
        """Bilinear onto the packed grid (one cell per 16 px), as Flux2KleinInpaintPipeline's ``prepare_mask_latents``
        (a binarised mask, so its edges come out fractional)."""
        return torch.nn.functional.interpolate(mask, size=tuple(shape[1:]), mode="bilinear")

    def make_step(self, model, shape=None, variant: str = ""):
        """One whole denoising step for latents of ``shape`` (128, h, w; the native one by default): pack, the
        transformer at timestep t / 1000 (the pipelines divide by 1000; the model multiplies back), CFG or the
        embedded scale as the card says, unpack, sampler update. Position ids and their rotary tables depend on
        the shape only: made here, outside capture."""
        transformer, dtype, device = model.transformer, model.dtype, model.device
        _, h, w = shape or model.latent_shape
        img_ids, txt_ids = image_ids(h, w, device), text_ids(model.card.max_tokens, device)
        rotary = rotary_tables(transformer, img_ids, txt_ids)
        pos = transformer.pos_embed
        cfg = model.card.guidance_mode == "cfg" and variant != NO_CFG  # NO_CFG: the prompt's rows alone
        embedded = model.card.guidance_mode == "embedded"

        def step(x, t, guidance, coeffs, hist, noise, prompt_embeds, neg_embeds=None):
            tokens = pack(model_input(x, coeffs).to(dtype))                  # (B, N, 128)
            timestep = t.to(dtype) / 1000
            text = prompt_embeds                                             # (B, L, D)
            if cfg:  # prompt rows, then negative-prompt rows
                tokens, timestep = torch.cat([tokens, tokens]), torch.cat([timestep, timestep])
                text = torch.cat([prompt_embeds, neg_embeds])
            if rotary is not None:  # taken by this forward's two calls of pos_embed
                object.__setattr__(pos, "_given_rotary", rotary)
            v = transformer(hidden_states=tokens, encoder_hidden_states=text, timestep=timestep,
                            img_ids=img_ids, txt_ids=txt_ids,
                            guidance=guidance if embedded else None,         # (B,) float32, as Flux2Pipeline's
                            return_dict=False)[0].float()                     # (B or 2B, N, 128)
            if cfg:  # do_classifier_free_guidance per row: a scale above 1
                cond, uncond = v.chunk(2)
                v = torch.where((guidance > 1).view(-1, 1, 1), cfg_combine(cond, uncond, guidance), cond)
            x_next, denoised = sampler_step(x, unpack(v, h, w), hist, noise, coeffs)  # (B, 128, h, w)
            return {"x_next": x_next, "hist_next": denoised}

        return step

    def reference_pipeline(self, model):
        """Flux2KleinPipeline or Flux2Pipeline (the directory's) over the model's modules (the VAE itself, not
        its adapter), flow Euler of its card's scheduler config (the pipeline sets its own sigma grid)."""
        import diffusers as d

        config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
        parts = dict(scheduler=d.FlowMatchEulerDiscreteScheduler.from_config(config), vae=model.vae.vae,
                     text_encoder=model.text_encoder, tokenizer=model.tokenizer, transformer=model.transformer)
        pipe = (d.Flux2KleinPipeline(**parts, is_distilled=model.card.guidance_mode == "none")
                if model.pipeline == KLEIN else d.Flux2Pipeline(**parts))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_call(self, model, specs) -> dict:
        s = specs[0]
        w, h = (s.width, s.height) if s.width else model.card.native_size
        return dict(prompt=[x.prompt for x in specs], height=h, width=w, num_inference_steps=s.steps,
                    guidance_scale=s.guidance, max_sequence_length=model.card.max_tokens)

    def load(self, card, device, dtype):
        """The transformer (sharded safetensors), the VAE (wrapped: ``Flux2VAE``), the text encoder (transformers,
        local files only, safetensors only) and its tokenizer (for [dev], the tokenizer of its PixtralProcessor with
        the processor's chat template: ``processor_tokenizer``), from ``card.path``. A built-in card gets random
        weights instead (``_load_builtin``)."""
        if card.builtin:
            return _load_builtin(card, device, dtype)
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

        path = Path(card.path)
        pipeline = read_config(path / "model_index.json").get("_class_name")
        transformer = load_sharded(Flux2Transformer2DModel, path / "transformer", device, dtype)
        vae = Flux2VAE(cast(load_component(AutoencoderKLFlux2, path / "vae"), device, dtype))
        model = _assemble(card, transformer, vae, pipeline)
        if pipeline == KLEIN:
            from transformers import AutoTokenizer, Qwen3ForCausalLM

            model.text_encoder = load_checked_encoder(Qwen3ForCausalLM, path / "text_encoder", device, dtype)
            model.tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        else:
            from transformers import Mistral3ForConditionalGeneration

            model.text_encoder = load_checked_encoder(Mistral3ForConditionalGeneration, path / "text_encoder",
                                                      device, dtype)
            model.tokenizer = processor_tokenizer(path / "tokenizer")
        rotary_in_float32(model.text_encoder)
        check_widths(model, path)
        return model


# -- the text path ------------------------------------------------------------------------------------
@torch.no_grad()
def _encode_texts(model, texts: list[str]) -> dict[str, tuple[torch.Tensor]]:
    def encode(missing: list[str]):  # kept on the host: 7.5 MiB per prompt for [klein] 4B in bf16
        return [(e,) for e in prompt_embeds(model, missing).to("cpu", model.dtype)]

    return encodings(model, texts, encode, CACHE_SIZE)


def prompt_ids(model, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, max_tokens) token ids and attention mask of ``texts`` in the pipeline's chat template."""
    length = model.card.max_tokens
    if model.pipeline == KLEIN:  # _get_qwen3_prompt_embeds: one user turn, generation prompt, thinking off
        chats = [model.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                     add_generation_prompt=True, enable_thinking=False) for t in texts]
        out = model.tokenizer(chats, return_tensors="pt", padding="max_length", truncation=True, max_length=length)
    else:  # _get_mistral_3_small_prompt_embeds: format_input's conversations, no generation prompt (as the processor)
        out = model.tokenizer.apply_chat_template(mistral_messages(texts), add_generation_prompt=False, tokenize=True,
                                                  return_dict=True, return_tensors="pt", padding="max_length",
                                                  truncation=True, max_length=length)
    return out["input_ids"], out["attention_mask"]


def processor_tokenizer(path: Path):
    """The tokenizer of a PixtralProcessor directory (FLUX.2 [dev]'s ``tokenizer/``) with the processor's chat
    template (chat_template.jinja, or the older chat_template.json). For text-only conversations the processor's
    ``apply_chat_template`` is this tokenizer's: the template rendered, then tokenised without added special tokens
    (the template writes <s> itself); loading the tokenizer alone spares the worker torchvision, which transformers'
    PixtralProcessor requires for its image half."""
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not tokenizer.chat_template:
        if (path / "chat_template.jinja").is_file():
            tokenizer.chat_template = (path / "chat_template.jinja").read_text()
        elif (path / "chat_template.json").is_file():
            tokenizer.chat_template = json.loads((path / "chat_template.json").read_text())["chat_template"]
        else:
            raise ModelError(f"{path} has no chat template (chat_template.jinja or chat_template.json): "
                             "FLUX.2 [dev] reads prompts in Mistral's")
    return tokenizer


def mistral_messages(texts: list[str]) -> list[list[dict]]:
    """Flux2Pipeline's ``format_input`` without images: its system message, then the prompt with "[IMG]" removed."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
             {"role": "user", "content": [{"type": "text", "text": t.replace("[IMG]", "")}]}] for t in texts]


def prompt_embeds(model, texts: list[str]) -> torch.Tensor:
    """(n, max_tokens, layers x width): the chosen hidden states of the encoder's language model, stacked per
    token, as the pipelines' ``out.permute(0, 2, 1, 3).reshape(...)``."""
    ids, mask = prompt_ids(model, texts)
    encoder = model.text_encoder
    device = next(encoder.parameters()).device
    states = text_model(encoder)(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                                 use_cache=False).hidden_states
    out = torch.stack([states[k] for k in ENCODER_LAYERS[model.pipeline]], dim=1)   # (n, 3, L, W)
    n, k, length, width = out.shape
    return out.permute(0, 2, 1, 3).reshape(n, length, k * width)


def text_model(encoder) -> torch.nn.Module:
    """The language model of a text encoder (Qwen3ForCausalLM's Qwen3Model, Mistral3's MistralModel): its hidden
    states without the LM head (nor, for Mistral3, the vision tower, which a text-only prompt never reaches)."""
    return encoder.get_decoder()


def rotary_in_float32(encoder) -> None:
    """The language model's rotary frequencies recomputed in float32, as transformers builds them (``from_pretrained``
    in bf16 keeps them float32): the loader's cast to the model's dtype rounds every buffer, and bf16 frequencies
    would move every position's rotation (the pipelines' encoders keep theirs)."""
    rotary = getattr(text_model(encoder), "rotary_emb", None)
    if rotary is None or getattr(rotary, "inv_freq", None) is None or rotary.inv_freq.dtype == torch.float32:
        return
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = rotary.compute_default_rope_parameters if rotary.rope_type == "default" else ROPE_INIT_FUNCTIONS[
        rotary.rope_type]
    inv_freq = init(rotary.config)[0].to(rotary.inv_freq.device, torch.float32)  # computed on the host, as built
    rotary.inv_freq = inv_freq
    rotary.original_inv_freq = inv_freq.clone()


def check_widths(model, path) -> None:
    """ModelError unless the transformer reads what the encoder gives: its joint_attention_dim is the stacked
    layers' width, and the encoder has those layers."""
    layers = ENCODER_LAYERS[model.pipeline]
    cfg = text_model(model.text_encoder).config
    width = model.transformer.config.joint_attention_dim
    if max(layers) > cfg.num_hidden_layers or len(layers) * cfg.hidden_size != width:
        raise ModelError(f"{path}: the text encoder ({cfg.num_hidden_layers} layers of {cfg.hidden_size}) does not fit "
                         f"the transformer: {model.pipeline} stacks its hidden states {layers} into "
                         f"{len(layers)} x {cfg.hidden_size}, the transformer's joint_attention_dim is {width}")


# -- the schedule ---------------------------------------------------------------------------------------
def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The pipelines' ``compute_empirical_mu`` (BFL's flux2 sampling.py): mu as a line in the step count between
    fits at 10 and 200 steps for this many image tokens; past 4300 tokens, the 200-step fit alone."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


# -- latents, ids, rotary tables --------------------------------------------------------------------------
def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h w, C): each latent cell a token, as ``_pack_latents``."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(z: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h w, C) -> (B, C, h, w): ``pack`` undone (``_unpack_latents_with_ids`` with the image ids)."""
    b, _, c = z.shape
    return z.permute(0, 2, 1).reshape(b, c, h, w)


def patchify(x: torch.Tensor) -> torch.Tensor:
    """(B, C, 2h, 2w) -> (B, 4C, h, w), as ``_patchify_latents``."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """(B, 4C, h, w) -> (B, C, 2h, 2w), as ``_unpatchify_latents``."""
    b, c, h, w = x.shape
    x = x.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """(h w, 4) int64 position ids of an h x w token grid: (t, row, column, l) = (0, i, j, 0), as
    ``_prepare_latent_ids``."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)).to(device)


def text_ids(length: int, device) -> torch.Tensor:
    """(length, 4) int64 position ids of the text tokens: (0, 0, 0, k), as ``_prepare_text_ids``."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length)).to(device)


@functools.cache
def _given_rotary_class(base: type) -> type:
    """``base`` (the transformer's ``pos_embed`` class) returning the tables ``make_step`` made for its shape,
    handed over by its step just before it calls the transformer: the image's at the first call, the text's at
    the second (``Flux2Transformer2DModel.forward``'s order), without the float64 kernels each would run."""

    def forward(self, ids):
        given = self._given_rotary
        if given is None:
            return base.forward(self, ids)
        head, rest = given[0], given[1:]
        object.__setattr__(self, "_given_rotary", rest or None)  # this forward's: a later call computes its own
        return head

    return type(f"Given{base.__name__}", (base,), {"forward": forward, "_given_rotary": None,
                                                    "__module__": __name__})


def rotary_tables(transformer, img_ids: torch.Tensor, txt_ids: torch.Tensor):
    """(image's (cos, sin), text's (cos, sin)) for these ids, computed now, and the transformer's ``pos_embed``
    made to return them while a step hands them over; None where its ``pos_embed`` is not diffusers'
    Flux2PosEmbed."""
    pos = transformer.pos_embed
    base = type(pos).__mro__[1] if type(pos).__module__ == __name__ else type(pos)
    if base.__name__ != "Flux2PosEmbed":
        return None
    with torch.no_grad():
        tables = (base.forward(pos, img_ids), base.forward(pos, txt_ids))
    pos.__class__ = _given_rotary_class(base)
    return tables


# -- the VAE --------------------------------------------------------------------------------------------------
class Flux2VAE(torch.nn.Module):
    """AutoencoderKLFlux2 as the engine decodes (``workers.decode``: ``vae.decode(z).sample``, ``config.out_channels``,
    ``dtype``): ``decode`` takes the engine's latents (B, 128, h, w) and does what the pipelines do after the loop,
    ``latents * sqrt(bn.running_var + eps) + bn.running_mean``, ``_unpatchify_latents``, then the VAE's decode
    ((B, 3, 16h, 16w)). Its config says scale 1 and shift 0: the de-normalisation is here."""

    def __init__(self, vae) -> None:
        super().__init__()
        self.vae = vae
        self.config = SimpleNamespace(out_channels=vae.config.out_channels,
                                      latent_channels=4 * vae.config.latent_channels, scaling_factor=1.0,
                                      shift_factor=0.0)

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    def latents(self, z: torch.Tensor) -> torch.Tensor:
        """The VAE's own latents (B, 32, 2h, 2w) of engine latents (B, 128, h, w)."""
        bn, eps = self.vae.bn, self.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(z.device, z.dtype)
        return unpatchify(z * std + mean)

    def decode(self, z: torch.Tensor, return_dict: bool = True):
        return self.vae.decode(self.latents(z), return_dict=return_dict)

    def encode_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] -> engine latents (B, 128, H/16, W/16), ``decode``'s inverse as the FLUX.2
        pipelines' ``_encode_vae_image``: the posterior's mode, ``_patchify_latents``, ``(z - mean) / std``."""
        z = patchify(self.vae.encode(pixels.to(self.dtype)).latent_dist.mode())
        bn, eps = self.vae.bn, self.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(z.device, z.dtype)
        return (z - mean) / std


# -- loading -------------------------------------------------------------------------------------------------
def _assemble(card, transformer, vae, pipeline: str):
    model = assemble(card, transformer, vae)
    model.vae_scale, model.vae_shift = 1.0, 0.0  # Flux2VAE de-normalises
    model.pipeline = pipeline  # which text recipe: KLEIN or DEV
    return model


def _load_builtin(card, device, dtype, **overrides):
    """A built-in with random weights made on the device (``builtin.build``), with the attributes ``load`` sets;
    ``overrides`` shrink its configs (tests)."""
    from workers.families.flux2 import builtin

    parts = builtin.build(card.builtin, card.image_size, device, dtype, **overrides)
    pipeline = KLEIN if "klein" in card.builtin else DEV
    model = _assemble(card, parts["transformer"], Flux2VAE(parts["vae"]), pipeline)
    model.text_encoder = place_encoder(parts["text_encoder"], device, dtype)
    rotary_in_float32(model.text_encoder)
    model.tokenizer = parts["tokenizer"]
    check_widths(model, card.builtin)
    return model
