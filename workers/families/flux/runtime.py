"""FLUX.1-dev and FLUX.1-schnell, the torch part (the card is in ``workers.families.flux``); Black Forest
Labs 2024, diffusers' ``FluxTransformer2DModel`` and ``FluxPipeline``: a rectified-flow MMDiT conditioned on
a prompt twice, T5's token embeddings (``prompt_embeds``, max_tokens x 4096) and CLIP's pooled output
(``pooled``, 768).

Guidance. Dev is guidance-distilled: the request's guidance scale is an input of the network (one row
per image, no CFG); schnell has no guidance input and ignores the scale. The reference pipeline's
optional true CFG (``true_cfg_scale`` with a negative prompt: a second forward per image) is not offered:
a request has one guidance scale, which dev needs for its embedding. Negative prompts are not encoded.

Latents. The engine keeps each request's latents unpacked, (16, H/8, W/8), so the engine and the
splitter stay family-agnostic; the step packs them into (H/16)(W/16) tokens of 64 for the transformer and
unpacks its output, as ``FluxPipeline._pack_latents`` / ``_unpack_latents`` do. The update is elementwise,
so applying it to the unpacked latents is the pipeline's update in the packed layout.

Encoding follows ``FluxPipeline.encode_prompt`` exactly: the prompt as given (no lower-casing or stripping
here; CLIP's tokenizer lower-cases by itself), CLIP padded and truncated to its ``model_max_length`` (77),
T5 padded and truncated to ``max_tokens``, neither encoder given an attention mask, and no mask in the
transformer: padding tokens take part, as in the reference, and every shape is fixed per model.
Encodings are cached per model in an LRU keyed by the prompt.

Kontext (``FluxKontextPipeline``; a card whose ``edit`` is "reference"). A request's image is resized as the
pipeline resizes it (``workers.families.flux.reference_size``), VAE-encoded at admission (the posterior's mode: the
pipeline's ``sample_mode="argmax"``, so nothing is drawn from the request's generator) and packed into tokens of
64: a per-request input of the step, ``reference`` (n, 64). The step runs the transformer over [latent tokens,
reference tokens], the reference's position ids those of its own grid with the first axis 1, and keeps the latent
tokens' output, as the pipeline does. The token count depends on the reference's size: it is the step variant
(``kontext-RxC``, the reference's R x C token grid; ``variant_of``), so the engine groups and captures each
reference size apart. The schedule's shift reads the latent tokens only, as the pipeline's ``mu``.

Graph safety: the position ids (image grid and text zeros) are device tensors made once per shape in
``make_step``, and so are the RoPE tables the transformer would make of them at each call (float64 on CUDA;
``rotary_tables``), so the step captures as is.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from graphs import TensorSpec
from samplers import model_input, sampler_step
from workers.speed import modulation
from workers.families.encoders import place_encoder
from workers.families.flux import Flux, builtin, fast, reference_size  # fast: its routed attention registers on import
from workers.families.textcache import encodings
from workers.loading import assemble, load_checked_encoder, load_sharded, load_vae
from workers.speed.modulation import give as give_modulation

CACHE_SIZE = 4096
KONTEXT = "kontext-"  # a Kontext edit's step variant: KONTEXT + "RxC", its reference's token grid


def reference_grid(variant: str) -> tuple[int, int] | None:
    """(rows, columns) of the reference tokens of a Kontext variant; None for another variant."""
    if not variant.startswith(KONTEXT):
        return None
    rows, cols = variant[len(KONTEXT):].split("x")
    return int(rows), int(cols)


def reference_image(model, spec):
    """A Kontext request's reference: its decoded image resized as FluxKontextPipeline resizes it, and its size;
    None where the model takes no reference or the request has no image."""
    from workers.request.images import decode_image

    card = model.card
    if card is None or card.edit != "reference" or not spec.image:
        return None
    image = decode_image(spec.image)
    return image, reference_size(card, *image.size)


@torch.no_grad()
def reference_tokens(model, images: list) -> torch.Tensor:
    """The packed latents (B, n, 64) of Kontext references (``reference_image``'s, one size), in the model's dtype:
    the pipeline's preprocess (Lanczos resize, [-1, 1]), the VAE's posterior mode, ``(z - shift) * scale``, packed."""
    from workers.edits import pixels_of, vae_encode

    pixels = torch.stack([pixels_of(image, w, h) for image, (w, h) in images]).to(model.device)
    return pack(vae_encode(model, pixels, None)).to(model.dtype)


@torch.no_grad()
def _encode_texts(model, texts: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    def encode(missing: list[str]):
        # as FluxPipeline._get_clip_prompt_embeds: the pooled output, no attention mask
        clip = model.tokenizer(missing, padding="max_length", max_length=model.tokenizer.model_max_length,
                               truncation=True, return_tensors="pt")
        pooled = model.text_encoder(clip.input_ids.to(model.text_encoder.device),
                                    output_hidden_states=False).pooler_output               # (n, 768)
        # as FluxPipeline._get_t5_prompt_embeds: the last hidden state, no attention mask
        t5 = model.tokenizer_2(missing, padding="max_length", max_length=model.card.max_tokens, truncation=True,
                               return_tensors="pt")
        embeds = model.text_encoder_2(t5.input_ids.to(model.text_encoder_2.device),
                                      output_hidden_states=False)[0]                        # (n, L, 4096)
        return list(zip(embeds.to(model.dtype), pooled.to(model.dtype)))

    return encodings(model, texts, encode, CACHE_SIZE)


class FluxRuntime(Flux):
    def cond_specs(self, model) -> dict[str, TensorSpec]:
        cfg = model.transformer.config
        return {"prompt_embeds": TensorSpec((model.card.max_tokens, cfg.joint_attention_dim), model.dtype),
                "pooled": TensorSpec((cfg.pooled_projection_dim,), model.dtype)}

    def table_specs(self, model) -> dict[str, TensorSpec]:
        """The step's inputs that change every step and are known at admission: the modulation's row of the
        step (``workers.modulation``, tables), where the engine hoisted it."""
        cache = modulation.temb_modulation(model.transformer)
        if cache is None:
            return {}
        return {"modulation": TensorSpec((cache.width,), model.dtype)}

    def step_tables(self, model, plans, specs, conds) -> list[dict[str, torch.Tensor]]:
        """Each request's modulation at every step of its plan, (S, width) on the model's device, in one product
        for all of ``specs`` (the engine asks only where ``table_specs`` is not empty)."""
        steps = [p.num_steps for p in plans]
        rows = self.table_inputs(model, {
            "t": torch.cat([p.timesteps for p in plans]),
            "guidance": torch.cat([torch.full((n,), float(s.guidance)) for s, n in zip(specs, steps)]),
            "pooled": torch.cat([c["pooled"][None].expand(n, -1) for c, n in zip(conds, steps)])})
        return [{"modulation": m} for m in rows["modulation"].split(steps)]

    @torch.no_grad()
    def table_inputs(self, model, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The ``table_specs`` inputs of the step's rows ``inputs`` (its t, guidance and pooled, (N, ...) each):
        the embedding of the timestep, guidance and pooled prompt the step would compute, as the step gives them
        (the timestep through the model's dtype over 1000 and back, the guidance times 1000), and its product."""
        dtype, device, tr = model.dtype, model.device, model.transformer
        timestep = (inputs["t"].to(device, torch.float32).to(dtype) / 1000).to(dtype) * 1000
        pooled = inputs["pooled"].to(device, dtype)
        embed = tr.time_text_embed  # its forward, not its call: the hook that hands out the slices must not fire
        if model.card.guidance_mode == "embedded":
            temb = embed.forward(timestep, inputs["guidance"].to(device, torch.float32).to(dtype) * 1000, pooled)
        else:
            temb = embed.forward(timestep, pooled)
        return {"modulation": modulation.temb_modulation(tr).table(temb)}                # (N, width)

    def speed_rewrites(self, model, stage: str, config, graphs: bool) -> int:
        """FLUX.1's blocks made fast (``workers.families.flux.fast``): the FP8 single blocks' GELU folded into
        their output's quantization ("precision"), the bf16 single blocks' GELU in its product's epilogue
        ("epilogues"), the FP8 blocks' norms fused with their codes ("norms"); how many blocks."""
        rewrite = {"precision": fast.fold_single_block_gelus, "epilogues": fast.fuse_gelu_epilogues,
                   "norms": fast.fuse_block_norms}.get(stage)
        return rewrite(model.transformer) if rewrite is not None else 0

    def plan_kwargs(self, model, shape: tuple[int, int, int]) -> dict:
        """FLUX.1-dev's resolution-dependent shift: ``mu`` from the packed sequence length (h/2)(w/2), as
        FluxPipeline's ``calculate_shift(latents.shape[1], ...)``; nothing for a static shift (schnell)."""
        if not model.card.scheduler.get("use_dynamic_shifting", False):
            return {}
        from samplers import flow_mu

        _, h, w = shape
        return {"mu": flow_mu((h // 2) * (w // 2), model.card.scheduler)}

    def encode(self, model, specs) -> list[dict[str, torch.Tensor]]:
        """Each request's prompt, encoded in one batch per text encoder (cache misses only); a Kontext request's
        reference tokens too (``reference``), its images encoded in one VAE batch per reference size."""
        found = _encode_texts(model, sorted({s.prompt for s in specs}))
        out = [{"prompt_embeds": found[s.prompt][0], "pooled": found[s.prompt][1]} for s in specs]
        refs = {i: r for i, r in enumerate(reference_image(model, s) for s in specs) if r is not None}
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, (_, size) in refs.items():
            by_size.setdefault(size, []).append(i)
        for rows in by_size.values():
            for i, tokens in zip(rows, reference_tokens(model, [refs[i] for i in rows])):
                out[i]["reference"] = tokens
        return out

    def variant_of(self, model, spec) -> str:
        """A Kontext request's variant: its reference's token grid (``KONTEXT`` + "RxC"); "" otherwise."""
        ref = reference_image(model, spec)
        if ref is None:
            return ""
        w, h = ref[1]
        m = model.card.size_multiple
        return f"{KONTEXT}{h // m}x{w // m}"

    def variant_specs(self, model, shape, variant: str) -> dict[str, TensorSpec]:
        """A Kontext variant's reference tokens, (R C, 64) per sample."""
        grid = reference_grid(variant)
        if grid is None:
            return {}
        return {"reference": TensorSpec((grid[0] * grid[1], model.transformer.config.in_channels), model.dtype)}

    def make_step(self, model, shape=None, variant: str = ""):
        """One whole denoising step for latents of ``shape`` (16, h, w; the native one by default): pack, the
        transformer at timestep t / 1000 (FluxPipeline divides by 1000; the model multiplies back), with the
        guidance scale per row when the model embeds it, unpack, sampler update. The position ids depend on
        the shape only: device tensors made here, outside capture, and so are the rotary tables made of them
        (``rotary_tables``), which the transformer would otherwise compute every step. ``modulation`` (B, width):
        the step's rows of the requests' modulation tables (``table_specs``), which the transformer then reads
        instead of computing."""
        transformer, dtype, device = model.transformer, model.dtype, model.device
        _, h, w = shape or model.latent_shape
        img_ids = image_ids(h // 2, w // 2, device)                       # (N, 3)
        n = img_ids.shape[0]
        grid = reference_grid(variant)
        if grid is not None:  # Kontext: the reference's tokens follow, ids of its grid with the first axis 1
            ref_ids = image_ids(*grid, device)
            ref_ids[:, 0] = 1
            img_ids = torch.cat([img_ids, ref_ids])                       # (N + n_ref, 3)
        txt_ids = torch.zeros(model.card.max_tokens, 3, device=device)   # (L, 3): text tokens share position 0
        embeds_guidance = model.card.guidance_mode == "embedded"  # the card read guidance_embeds
        rotary = rotary_tables(transformer, img_ids, txt_ids)
        pos = transformer.pos_embed

        def step(x, t, guidance, coeffs, hist, noise, prompt_embeds, pooled, modulation=None, reference=None):
            tokens = pack(model_input(x, coeffs).to(dtype))                 # (B, N, 64)
            if reference is not None:  # Kontext: [latent tokens, reference tokens]
                tokens = torch.cat([tokens, reference], dim=1)              # (B, N + n_ref, 64)
            if modulation is not None:  # this step's rows of the requests' tables (table_specs)
                give_modulation(transformer, modulation)
            if rotary is not None:  # taken by this forward's one call of pos_embed
                object.__setattr__(pos, "_given_rotary", rotary)
            v = transformer(tokens, encoder_hidden_states=prompt_embeds,    # (B, L, 4096)
                            pooled_projections=pooled, timestep=t.to(dtype) / 1000,
                            guidance=guidance if embeds_guidance else None,  # (B,) float32, as the pipeline's
                            img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]  # (B, N, 64)
            if reference is not None:  # the latent tokens' output only, as the pipeline's noise_pred[:, :N]
                v = v[:, :n]
            x_next, denoised = sampler_step(x, unpack(v.float(), h, w), hist, noise, coeffs)  # (B, 16, h, w)
            return {"x_next": x_next, "hist_next": denoised}

        return step

    def reference_pipeline(self, model):
        """FluxPipeline over the model's modules, flow Euler of its card's scheduler config (the pipeline sets
        its own sigma grid)."""
        import diffusers as d

        config = {k: v for k, v in model.card.scheduler.items() if k != "flow_grid"}
        pipe = d.FluxPipeline(text_encoder=model.text_encoder, tokenizer=model.tokenizer,
                              text_encoder_2=model.text_encoder_2, tokenizer_2=model.tokenizer_2,
                              transformer=model.transformer, vae=model.vae,
                              scheduler=d.FlowMatchEulerDiscreteScheduler.from_config(config))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_call(self, model, specs) -> dict:
        s = specs[0]
        w, h = (s.width, s.height) if s.width else model.card.native_size
        return dict(prompt=[x.prompt for x in specs], height=h, width=w, num_inference_steps=s.steps,
                    guidance_scale=s.guidance, max_sequence_length=model.card.max_tokens)

    def load(self, card, device, dtype):
        """The transformer and VAE (safetensors, sharded or not), both text encoders (transformers, local
        files only, safetensors only) and both tokenizers, from ``card.path``. The second encoder and
        tokenizer are extra attributes of the LoadedModel: ``text_encoder_2`` (T5), ``tokenizer_2``. A built-in
        card (``flux-dev-1024``) gets random weights instead (``_load_builtin``)."""
        if card.builtin:
            return _load_builtin(card, device, dtype)
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        path = Path(card.path)
        transformer = _load_transformer(path / "transformer", device, dtype)
        model = assemble(card, transformer, load_vae(path / "vae", device, dtype))
        model.text_encoder = _load_encoder(CLIPTextModel, path / "text_encoder", device, dtype)
        model.text_encoder_2 = _load_encoder(T5EncoderModel, path / "text_encoder_2", device, dtype)
        model.tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        model.tokenizer_2 = AutoTokenizer.from_pretrained(str(path / "tokenizer_2"), local_files_only=True)
        return model


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, (H/2)(W/2), 4C): 2x2 cells as tokens, as FluxPipeline._pack_latents."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # (B, H/2, W/2, C, 2, 2)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(z: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, (h/2)(w/2), 4C) -> (B, C, h, w), as FluxPipeline._unpack_latents."""
    b, _, d = z.shape
    z = z.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # (B, C, h/2, 2, w/2, 2)
    return z.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """(h w, 3) position ids of an h x w token grid: (0, row, column), as FluxPipeline._prepare_latent_image_ids.
    Float32 (the pipeline uses the encoder's dtype; bfloat16 would round rows and columns past 256)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device)


@functools.cache
def _given_rotary_class(base: type) -> type:
    """``base`` (the transformer's ``pos_embed`` class) returning, once, the tables ``make_step`` made for its
    shape, handed over by its step just before it calls the transformer: the same values, without the thirty-odd small kernels (float64
    frequencies, cos, sin, interleaves, concatenations) every step would run for them."""

    def forward(self, ids):
        given = self._given_rotary
        if given is None:
            return base.forward(self, ids)
        object.__setattr__(self, "_given_rotary", None)  # one call's: a later call computes its own
        return given

    return type(f"Given{base.__name__}", (base,), {"forward": forward, "_given_rotary": None,
                                                    "__module__": __name__})


def rotary_tables(transformer, img_ids: torch.Tensor, txt_ids: torch.Tensor):
    """The transformer's (cos, sin) rotary tables for these ids, computed now, and its ``pos_embed`` made to
    return them while a step hands them over; None where its ``pos_embed`` is not diffusers' FluxPosEmbed."""
    pos = transformer.pos_embed
    base = type(pos).__mro__[1] if type(pos).__module__ == __name__ else type(pos)
    if base.__name__ != "FluxPosEmbed":
        return None
    with torch.no_grad():
        tables = base.forward(pos, torch.cat((txt_ids, img_ids), dim=0))
    pos.__class__ = _given_rotary_class(base)
    return tables


# -- loading -----------------------------------------------------------------------------------------------


def _load_builtin(card, device, dtype, **overrides):
    """FLUX.1-dev with random weights made on the device (``builtin.build_flux_dev``), with the
    attributes ``load`` sets; ``overrides`` shrink its configs (tests)."""
    parts = builtin.build_flux_dev(card.image_size, device, dtype, **overrides)
    model = assemble(card, parts.pop("transformer"), parts.pop("vae"))
    for name, part in parts.items():  # text_encoder, tokenizer, text_encoder_2, tokenizer_2
        setattr(model, name, place_encoder(part, device, dtype) if name.startswith("text_encoder") else part)
    return model


def _load_transformer(path: Path, device, dtype) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return load_sharded(FluxTransformer2DModel, path, device, dtype)


def _load_encoder(cls, path: Path, device, dtype) -> torch.nn.Module:
    return load_checked_encoder(cls, path, device, dtype)
