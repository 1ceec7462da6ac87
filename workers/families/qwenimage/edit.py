"""Qwen-Image-Edit, the torch part of an instruction edit (a card whose ``edit`` is "reference"; the card is in
``workers.families.qwenimage``): diffusers' ``QwenImageEditPipeline`` (one reference image) and
``QwenImageEditPlusPipeline`` (a list of reference images: a request's ``image`` then its ``extra_images``, at most
the card's ``max_images``). The runtime (``runtime.QwenImageRuntime``) calls this module for such cards.

Each reference is read twice, at admission, as the pipelines read it:

1. By the Qwen2.5-VL text encoder. The prompt goes into the edit template with the images' placeholders
   (``EDIT_TEMPLATE``: one; the Plus pipeline's ``PLUS_TEMPLATE`` with one ``PICTURE`` per image, numbered from 1,
   before the prompt), and the processor (Qwen2.5-VL's: ``load_processor``) expands each placeholder to its image's
   vision tokens and makes the image's patches from the reference resized as the pipeline resizes it
   (QwenImageEditPipeline: the reference itself; the Plus pipeline: a 384 x 384-area copy of each at its own
   ratio). The encoder's last hidden state, each row's real tokens after the template's first ``DROP_TOKENS`` (its
   system part): the vision tokens, then the prompt's. The negative prompt (" " for an empty one, as
   QwenImagePipeline's requests) is encoded with the same images: the pipelines do.
2. As latent tokens. Each reference, resized to its ``reference_size`` (Lanczos, [-1, 1]), is encoded by the VAE
   (the posterior's mode: the pipelines' ``sample_mode="argmax"``, so nothing is drawn from the request's
   generator), normalised by the per-channel statistics, packed 2x2 into tokens of 64; a request's references
   joined in order: ``reference`` (n_1 + n_2 + ..., 64), as the Plus pipeline's ``prepare_latents`` joins them.

The step runs the transformer over [latent tokens, reference tokens] with ``img_shapes`` [latents' grid, each
reference's grid] (the references' rotary frame indices 1, 2, ...) and keeps the latent tokens' output, as the
pipelines do; true CFG as QwenImagePipeline's (``runtime.true_cfg``). The sequence grows with the references (their
tokens) and so does the text (their vision tokens): each reference layout (every reference's grid, in order) with
its vision tokens is a step variant (``edit-RxC-vlN``; several references ``edit-R1xC1+R2xC2-vlN``; and ``-no-cfg``
for rows at a scale of at most 1, which skip the negative forward and take no negative inputs), so the engine groups
and captures each layout apart, in its one pool, and requests whose references have the same sizes batch together.
The text inputs hold the N vision tokens, the template's own (which grows with the number of images:
``model.template_tokens``) and ``max_tokens`` of the prompt's (``text_length``), zero-padded with a mask, as
QwenImagePipeline's (the runtime's docstring says why padding changes no real token); the pipelines keep every
token, so a prompt is cut only where it is longer than ``max_tokens``. The schedule's shift reads the latent tokens
only, as the pipelines' ``mu``.

Encodings are cached per model by (text, the images' digests); a request without an image (only the engine's
warm-up probe makes one: admission refuses them, ``ModelCard.needs_image``) gets no conditioning, and warm-up fills
the variant's inputs with seeded noise.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from graphs import TensorSpec
from workers.edits import pixels_of
from workers.families.base import NO_CFG, read_json
from workers.families.qwenimage import edit_setup, reference_size, vision_size
from workers.families.textcache import encodings
from workers.loading import ModelError
from workers.request.images import decode_image, resize

# QwenImageEditPipeline.__init__: prompt_template_encode (the image in it), prompt_template_encode_start_idx
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>"
                 "<|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
# QwenImageEditPlusPipeline's: the images go in the user's part, each as PICTURE (its img_prompt_template)
PLUS_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
DROP_TOKENS = 64
EMPTY_NEGATIVE = " "
CACHE_SIZE = 256  # (text, images) pairs; 13 MB each in bf16 at 1024 x 1024 (about 1,400 vision tokens + 512) x 3584
EDIT = "edit-"  # an edit's step variant: EDIT + "RxC" per reference joined by "+", "-vlN" (+ "-" + NO_CFG)


@dataclass(frozen=True)
class EditVariant:
    """A step variant of an edit: each reference's token grid (rows, cols) in order, their vision tokens in all,
    and whether its rows run true CFG."""

    grids: tuple[tuple[int, int], ...]
    vision: int
    cfg: bool = True

    @property
    def name(self) -> str:
        grids = "+".join(f"{r}x{c}" for r, c in self.grids)
        return f"{EDIT}{grids}-vl{self.vision}" + ("" if self.cfg else f"-{NO_CFG}")

    @property
    def tokens(self) -> int:
        """The references' latent tokens in all."""
        return sum(r * c for r, c in self.grids)


def parse_variant(variant: str) -> EditVariant | None:
    """The edit variant named ``variant``; None for another one."""
    if not variant.startswith(EDIT):
        return None
    body = variant[len(EDIT):]
    cfg = not body.endswith(f"-{NO_CFG}")
    grids, vision = body.removesuffix(f"-{NO_CFG}").split("-vl")
    return EditVariant(tuple(tuple(int(n) for n in g.split("x")) for g in grids.split("+")), int(vision), cfg)


@dataclass(frozen=True)
class Reference:
    """A reference image of a request: the decoded image, its size for the VAE and for the encoder's processor, and
    a digest of its bytes (the encodings' cache key)."""

    image: object  # PIL RGB
    size: tuple[int, int]    # (width, height): the VAE's
    vision: tuple[int, int]  # (width, height): the encoder processor's input
    digest: str


def references_of(model, spec) -> tuple[Reference, ...]:
    """``spec``'s references (``image``, then ``extra_images``) as the pipelines resize them; empty without an
    image."""
    setup, out = model.edit, []
    for data in spec.references:
        image = decode_image(data)
        out.append(Reference(image, reference_size(setup, *image.size), vision_size(setup, *image.size),
                             hashlib.sha256(data).hexdigest()))
    return tuple(out)


def layout(model, refs: tuple[Reference, ...], cfg: bool = True) -> EditVariant:
    """The variant of references ``refs``: each one's token grid, and their vision tokens."""
    m = model.card.size_multiple
    return EditVariant(tuple((h // m, w // m) for w, h in (r.size for r in refs)),
                       sum(vision_tokens(model, *r.vision) for r in refs), cfg)


def vision_tokens(model, width: int, height: int) -> int:
    """The vision tokens the processor makes of a width x height image (its patches over the merge's square)."""
    processor = model.processor.image_processor
    return processor.get_number_of_image_patches(height, width) // processor.merge_size ** 2


def variant_of(model, spec) -> str:
    """An edit request's variant: its references' token grids and vision tokens, and whether it guides."""
    refs = references_of(model, spec)
    if not refs:
        raise ValueError(f"image: model {model.name!r} edits an input image (an instruction edit): send one")
    return layout(model, refs, spec.guidance > 1).name


def square_variants(model) -> tuple[str, ...]:
    """The variants of one square reference (the ones warm-up captures at each size): with and without CFG."""
    (w, h), (vw, vh) = reference_size(model.edit, 1, 1), vision_size(model.edit, 1, 1)
    m = model.card.size_multiple
    base = EditVariant(((h // m, w // m),), vision_tokens(model, vw, vh))
    return base.name, EditVariant(base.grids, base.vision, cfg=False).name


def text_length(model, variant: EditVariant) -> int:
    """The text inputs' length of a variant: its vision tokens, the template's own after its system part for its
    number of images (``model.template_tokens``), and ``max_tokens`` of the prompt's."""
    return variant.vision + model.template_tokens[len(variant.grids)] + model.card.max_tokens


def template(model, text: str, images: int = 1) -> str:
    """``text`` in the model's edit template with ``images`` image placeholders (QwenImageEditPipeline's: one)."""
    if model.edit.plus:  # QwenImageEditPlusPipeline: "Picture 1: <image>Picture 2: <image>..." before the prompt
        return PLUS_TEMPLATE.format("".join(PICTURE.format(i + 1) for i in range(images)) + text)
    return EDIT_TEMPLATE.format(text)


def variant_specs(model, variant: EditVariant) -> dict[str, TensorSpec]:
    """A variant's inputs per sample: the prompt's embeddings and mask (the negative's too where it guides) and
    the references' latent tokens, joined."""
    length, width = text_length(model, variant), model.transformer.config.joint_attention_dim
    embeds, mask = TensorSpec((length, width), model.dtype), TensorSpec((length,), model.dtype)
    text = {"prompt_embeds": embeds, "prompt_mask": mask}
    if variant.cfg:
        text.update(neg_embeds=embeds, neg_mask=mask)
    reference = TensorSpec((variant.tokens, model.transformer.config.in_channels), model.dtype)
    return {**text, "reference": reference}


def encode(model, specs) -> list[dict[str, torch.Tensor]]:
    """Each request's text inputs (its prompt and, where it guides, its negative prompt, each read with its
    references by the encoder: cache misses in one batch) and its references' tokens joined in order (one VAE
    batch per reference size, over every request's references); nothing for a request without an image (the
    module docstring)."""
    refs = [references_of(model, s) for s in specs]
    wanted = {}  # (text, digests) -> (text, references)
    for s, mine in zip(specs, refs):
        if mine:
            for text in _texts(s):
                wanted[text, _digests(mine)] = (text, mine)
    found = _encode_texts(model, wanted)
    out = []
    for s, mine in zip(specs, refs):
        row = {}
        if mine:
            prompt, *negative = (found[t, _digests(mine)] for t in _texts(s))
            row.update(prompt_embeds=prompt[0], prompt_mask=prompt[1])
            if negative:
                row.update(neg_embeds=negative[0][0], neg_mask=negative[0][1])
        out.append(row)
    by_size: dict[tuple[int, int], list[tuple[int, int]]] = {}  # VAE size -> (request, its j-th reference)
    for i, mine in enumerate(refs):
        for j, ref in enumerate(mine):
            by_size.setdefault(ref.size, []).append((i, j))
    tokens: dict[tuple[int, int], torch.Tensor] = {}
    for where in by_size.values():
        tokens.update(zip(where, reference_tokens(model, [refs[i][j] for i, j in where])))
    for i, mine in enumerate(refs):
        if mine:
            out[i]["reference"] = torch.cat([tokens[i, j] for j in range(len(mine))])      # (n_1 + n_2 + ..., 64)
    return out


def _digests(refs: tuple[Reference, ...]) -> tuple[str, ...]:
    return tuple(r.digest for r in refs)


def _texts(spec) -> tuple[str, ...]:
    """The texts a request's step reads: its prompt, and its negative prompt where it guides."""
    return (spec.prompt, spec.negative_prompt or EMPTY_NEGATIVE) if spec.guidance > 1 else (spec.prompt,)


@torch.no_grad()
def reference_tokens(model, refs: list[Reference]) -> torch.Tensor:
    """The packed latents (B, n, 64) of references of one size, in the model's dtype: the pipelines' preprocess
    (Lanczos resize, [-1, 1]), the video VAE's posterior mode of one frame, ``(z - mean) / std``
    (``_encode_vae_image``), packed."""
    vae = model.vae  # runtime.LatentDecoder
    pixels = torch.stack([pixels_of(r.image, *r.size) for r in refs]).to(model.device, vae.dtype)
    z = vae.autoencoder.encode(pixels[:, :, None]).latent_dist.mode()                    # (B, 16, 1, h, w)
    z = ((z - vae.mean.to(z.dtype)) / vae.std.to(z.dtype))[:, :, 0]                      # (B, 16, h, w)
    b, c, h, w = z.shape  # packed 2x2 into tokens, as runtime.pack (QwenImageEditPipeline._pack_latents)
    tokens = z.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)
    return tokens.to(model.dtype)                                                        # (B, hw/4, 64)


def _encode_texts(model, wanted: dict) -> dict:
    def encode(keys: list):
        pairs = [wanted[k] for k in keys]
        embeds, masks = encode_prompts(model, [t for t, _ in pairs], [r for _, r in pairs])
        return [(e.to("cpu", model.dtype), m.to("cpu", model.dtype)) for e, m in zip(embeds, masks)]

    return encodings(model, list(wanted), encode, CACHE_SIZE)


@torch.no_grad()
def encode_prompts(model, texts: list[str], refs: list[tuple[Reference, ...]]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each text read with its references: (L, D) embeddings, zero past its tokens, and the (L,) mask of its tokens,
    L its variant's ``text_length``: the pipelines' ``_get_qwen_prompt_embeds`` over a batch of (text, images)."""
    encoder = model.text_encoder
    device = next(encoder.parameters()).device
    formatted = [template(model, t, len(mine)) for t, mine in zip(texts, refs)]
    # the images the pipeline's processor is given: each resized (Lanczos) to its vision size, which the processor
    # resizes again to its patch grid (QwenImageEditPipeline's vision size is the reference's); one flat list, which
    # the processor hands to the placeholders in order, row after row
    images = [resize(r.image, *r.vision) for mine in refs for r in mine]
    inputs = model.processor(text=formatted, images=images, padding=True, return_tensors="pt").to(device)
    # the last hidden state (logits_to_keep=1: the LM head's logits, unused, for one token instead of all)
    hidden = encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     output_hidden_states=True, logits_to_keep=1).hidden_states[-1]    # (n, l, D)
    embeds, masks = [], []
    for i, (row, mine) in enumerate(zip(hidden, refs)):
        length = text_length(model, layout(model, mine))
        kept = row[inputs["attention_mask"][i].bool()][DROP_TOKENS:][:length]  # after the template's system part
        embeds.append(torch.cat([kept, kept.new_zeros(length - len(kept), kept.shape[1])]))
        masks.append(torch.arange(length, device=kept.device) < len(kept))
    return embeds, masks


def modulation_index(transformer, n: int, n_ref: int, device) -> torch.Tensor | None:
    """``zero_cond_t`` transformers (Qwen-Image-Edit-2511): (1, n + n_ref) which modulation each token takes, 0 the
    latents' (timestep t), 1 the references' (timestep 0; ``n_ref`` all of theirs), as the transformer's forward
    makes it from img_shapes; None for the others."""
    if not getattr(transformer, "zero_cond_t", False):
        return None
    return torch.cat([torch.zeros(n, dtype=torch.int), torch.ones(n_ref, dtype=torch.int)])[None].to(device)


# -- loading -----------------------------------------------------------------------------------------------------
def load_edit(model, path: Path) -> None:
    """An edit directory's setup (``model.edit``, read from model_index.json as its card was), processor
    (``model.processor``) and template lengths (``model.template_tokens``: by the number of images)."""
    model.edit = edit_setup(path, read_json(path / "model_index.json"))
    model.processor = load_processor(path / "processor")
    # the template's tokens after its system part, besides the images' placeholders: their vision markers, the Plus
    # pipeline's "Picture i: ", the assistant's turn (special tokens end the prompt's merges on both sides)
    model.template_tokens = {n: len(model.processor.tokenizer(template(model, "", n)).input_ids) - DROP_TOKENS - n
                             for n in range(1, model.edit.max_images + 1)}


def load_processor(folder: Path):
    """Qwen2.5-VL's processor from the directory's processor/ (local files): its image processor and tokenizer,
    without the video processor (transformers makes that only with torchvision; edits pass no video). ModelError
    when its files do not make one."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    class ImageTextProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    try:
        images = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        processor = ImageTextProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelError(f"{folder}: not Qwen2.5-VL's processor (its image processor and tokenizer files): "
                         f"{type(e).__name__}: {e}") from None
    if tokenizer.convert_tokens_to_ids(processor.image_token) in (None, tokenizer.unk_token_id):
        raise ModelError(f"{folder}: its tokenizer has no {processor.image_token} token (Qwen2.5-VL's image placeholder)")
    return processor

