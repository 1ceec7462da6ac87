"""The model card of a Stable Diffusion 3 / 3.5 pipeline directory (torch-free, like workers.cards).

The layout is ``stabilityai/stable-diffusion-3.5-medium``'s (and 3-medium's, 3.5-large's): transformer/
(SD3Transformer2DModel), vae/ (16 latent channels, with a shift_factor), text_encoder/ and text_encoder_2/
(CLIP-L and CLIP-bigG, CLIPTextModelWithProjection), text_encoder_3/ (T5EncoderModel), tokenizer/,
tokenizer_2/, tokenizer_3/, scheduler/ (FlowMatchEulerDiscreteScheduler, shift 3.0).

T5 is optional, as in the reference pipeline (``text_encoder_3=None``: its part of the prompt is zeros):
a directory without text_encoder_3/, or one whose model_index.json says ``"dit_serve": {"skip_t5": true}``,
runs without it (``skips_t5``).

Sizes. SD3 makes any multiple of the patch in pixels up to ``pos_embed_max_size`` patches per side (its
positional embedding is cropped about the centre). The card lists a directory's ``dit_serve.sizes`` when
it has them, else ``aspect_sizes``: the native square and the landscape and portrait sizes of 4:3, 3:2,
16:9 and 21:9 at the native pixel count, each side rounded to 64 px (at 1024: 1152x896, 1280x832,
1344x768, 1536x640 and their transposes, the buckets SDXL and SD3 users know).
"""

from __future__ import annotations

from pathlib import Path

CLIP_ARCH = "CLIPTextModelWithProjection"
T5_ARCH = "T5EncoderModel"
MAX_T5_TOKENS = 512  # the reference pipeline refuses a longer max_sequence_length

DEFAULTS = {"sampler": "flow_euler", "steps": 28, "guidance": 7.0}  # StableDiffusion3Pipeline's


def card(name: str, path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict):
    """SD3 / SD3.5 pipeline directories: every part must be there (T5 may be left out); CardError names
    the first one missing."""
    from workers.cards import ModelCard, _listed_sizes

    extra = index.get("dit_serve", {})
    no_t5 = skips_t5(path, index)
    _check_parts(path, vae, scheduler, no_t5)
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    size, patch = int(transformer.get("sample_size", 128)), int(transformer.get("patch_size", 2))
    multiple = factor * patch
    sizes = _listed_sizes(path, extra, multiple) or aspect_sizes(size * factor, multiple)
    if transformer.get("pos_embed_max_size"):  # without it, the embedding is remade for any size
        _check_sizes(path, sizes, int(transformer["pos_embed_max_size"]) * multiple)
    tokens = int(extra.get("max_sequence_length", 256))
    if not 1 <= tokens <= MAX_T5_TOKENS:
        from workers.cards import CardError

        raise CardError(f"{path}/model_index.json: dit_serve.max_sequence_length must be 1..{MAX_T5_TOKENS}, "
                        f"got {tokens}")
    tokenizer_json = path / "tokenizer_3" / "tokenizer.json"  # T5's: the API counts prompt tokens with it
    return ModelCard(
        name, "sd3", "text", path=str(path), image_size=size * factor,
        latent_channels=int(transformer.get("in_channels", 16)), latent_size=size,
        dtype=extra.get("dtype", "bfloat16"), scheduler=scheduler, defaults={**DEFAULTS, **extra.get("defaults", {})},
        max_tokens=tokens, sizes=tuple(sizes), size_multiple=multiple,
        tokenizer_file=str(tokenizer_json) if tokenizer_json.is_file() and not no_t5 else "")


def skips_t5(path: Path, index: dict) -> bool:
    """Whether the model runs without T5 (its prompt part zeros, as the reference with text_encoder_3=None):
    no text_encoder_3/ in the directory, or ``dit_serve.skip_t5`` set (saves T5-XXL's ~9 GiB)."""
    return bool(index.get("dit_serve", {}).get("skip_t5")) or not (path / "text_encoder_3").is_dir()


def aspect_sizes(native: int, multiple: int) -> list[tuple[int, int]]:
    """(width, height): the native square, then each of workers.sizes.RATIOS landscape and portrait at the native pixel
    count, sides rounded to 64 px (to ``multiple`` when the native side is not a multiple of 64: tiny models)."""
    from workers.sizes import ratio_sizes

    return ratio_sizes(native, 64 if native % 64 == 0 and 64 % multiple == 0 else multiple)


def _check_parts(path: Path, vae: dict | None, scheduler: dict, no_t5: bool) -> None:
    from workers.cards import CardError, read_json

    what = "an SD3 pipeline needs it (stabilityai/stable-diffusion-3.5-medium's layout)"
    if vae is None:
        raise CardError(f"{path} is an SD3 pipeline without vae/config.json: {what}")
    if not scheduler:
        raise CardError(f"{path} is an SD3 pipeline without scheduler/scheduler_config.json: {what}")
    parts = {"text_encoder": CLIP_ARCH, "text_encoder_2": CLIP_ARCH, **({} if no_t5 else {"text_encoder_3": T5_ARCH})}
    for part, arch in parts.items():
        cfg = path / part / "config.json"
        if not cfg.is_file():
            raise CardError(f"{path} is an SD3 pipeline without {part}/config.json: {what}")
        found = read_json(cfg).get("architectures") or [arch]
        if arch not in found:
            raise CardError(f"{cfg} describes {', '.join(found)}; SD3's {part} is a {arch}")
    for part in ("tokenizer", "tokenizer_2", *(() if no_t5 else ("tokenizer_3",))):
        if not (path / part).is_dir():
            raise CardError(f"{path} is an SD3 pipeline without {part}/: {what}")


def _check_sizes(path: Path, sizes: list[tuple[int, int]], largest: int) -> None:
    """Each side at most pos_embed_max_size patches (the transformer's positional embedding is that big)."""
    from workers.cards import CardError

    for w, h in sizes:
        if max(w, h) > largest:
            raise CardError(f"{path}: size {w}x{h} is larger than the transformer's positional embedding "
                            f"allows ({largest} px per side: pos_embed_max_size patches)")
