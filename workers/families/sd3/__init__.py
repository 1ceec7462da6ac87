"""Stable Diffusion 3 and 3.5, torch-free: the model card of a pipeline directory and the built-in
architecture (``sd35-medium-1024``: random weights, ``builtin``). The model runs in ``runtime``.

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
1344x768, 1536x640 and their transposes, the buckets SDXL and SD3 users know). Those are the sizes it lists;
like the reference it makes any other multiple of the patch as asked, up to the positional embedding's
``pos_embed_max_size`` patches per side (twice the native side for a transformer without one), and refuses a
side off the multiple, as StableDiffusion3Pipeline does (``size_range``).
"""

from __future__ import annotations

from pathlib import Path

from workers.families.base import Builtin, CardError, Family, ModelCard, listed_sizes, read_json
from workers.families.previews import PreviewMap
from workers.request.sizes import ratio_sizes

CLIP_ARCH = "CLIPTextModelWithProjection"
T5_ARCH = "T5EncoderModel"
SD35_POS_EMBED_MAX = 384  # SD3.5 medium's pos_embed_max_size (patches per side)
MAX_T5_TOKENS = 512  # the reference pipeline refuses a longer max_sequence_length

DEFAULTS = {"sampler": "flow_euler", "steps": 28, "guidance": 7.0}  # StableDiffusion3Pipeline's
# SD3.5 medium: transformer + its positional-embedding table (a buffer) + VAE; CLIP-L, CLIP-bigG, T5-XXL
SD35_MEDIUM = Builtin(1024, 2_243_171_520 + 226_492_416 + 83_819_683, 123_650_304 + 694_659_840 + 4_762_310_656)

# ComfyUI latent_formats.SD3: the 16-channel SD3 / SD3.5 VAE (workers.families.previews)
SD3_VAE = PreviewMap(weight=((-0.0922, -0.0175, 0.0749), (0.0311, 0.0633, 0.0954), (0.1994, 0.0927, 0.0458),
                             (0.0856, 0.0339, 0.0902), (0.0587, 0.0272, -0.0496), (-0.0006, 0.1104, 0.0309),
                             (0.0978, 0.0306, 0.0427), (-0.0042, 0.1038, 0.1358), (-0.0194, 0.0020, 0.0669),
                             (-0.0488, 0.0130, -0.0268), (0.0922, 0.0988, 0.0951), (-0.0278, 0.0524, -0.0542),
                             (0.0332, 0.0456, 0.0895), (-0.0069, -0.0030, -0.0810), (-0.0596, -0.0465, -0.0293),
                             (-0.1448, -0.1463, -0.1189)),
                     bias=(0.2394, 0.2135, 0.1925))


class SD3(Family):
    name = "sd3"
    pipelines = ("StableDiffusion3Pipeline",)
    transformers = ("SD3Transformer2DModel",)
    builtins = {"sd35-medium-1024": SD35_MEDIUM}
    previews = {16: SD3_VAE}
    runtime = "workers.families.sd3.runtime:SD3Runtime"
    joint_attention = True  # its joint attention by the kernel per shape (workers.speed.routing), not a break
    compile_scope = "blocks"  # SD3.5-medium 1024's fastest measured step (39.4 ms in FP8 on an H200) compiled by blocks
    fp8_attention = True
    # image-to-image and inpainting (workers.edits), as StableDiffusion3Img2ImgPipeline and
    # StableDiffusion3InpaintPipeline
    takes_image = True
    takes_mask = True
    rate_reference = "flux-dev-1024"  # none of its own measured in bf16: FLUX.1-dev's, an MMDiT at 1024 too

    def read_card(self, name: str, path: Path, transformer: dict, vae: dict | None, index: dict,
                  scheduler: dict) -> ModelCard:
        return card(name, path, transformer, vae, index, scheduler)

    def builtin_card(self, name: str) -> ModelCard:
        # SD3.5 medium's scheduler_config.json; its model card's 40 steps at CFG 4.5
        size = self.builtins[name].image_size
        scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
        return ModelCard(name, "sd3", "text", builtin=name, image_size=size, latent_channels=16,
                         latent_size=size // 8, scheduler=scheduler, max_tokens=256,
                         sizes=tuple(aspect_sizes(size, 16)), size_multiple=16,
                         size_range=(16, SD35_POS_EMBED_MAX * 16), defaults={"sampler": "flow_euler", "steps": 40, "guidance": 4.5})


def card(name: str, path: Path, transformer: dict, vae: dict | None, index: dict, scheduler: dict) -> ModelCard:
    """SD3 / SD3.5 pipeline directories: every part must be there (T5 may be left out); CardError names
    the first one missing."""
    extra = index.get("dit_serve", {})
    no_t5 = skips_t5(path, index)
    _check_parts(path, vae, scheduler, no_t5)
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    size, patch = int(transformer.get("sample_size", 128)), int(transformer.get("patch_size", 2))
    multiple = factor * patch
    sizes = listed_sizes(path, extra, multiple) or aspect_sizes(size * factor, multiple)
    largest = int(transformer.get("pos_embed_max_size") or 0) * multiple  # without it, remade for any size
    if largest:
        _check_sizes(path, sizes, largest)
    tokens = int(extra.get("max_sequence_length", 256))
    if not 1 <= tokens <= MAX_T5_TOKENS:
        raise CardError(f"{path}/model_index.json: dit_serve.max_sequence_length must be 1..{MAX_T5_TOKENS}, "
                        f"got {tokens}")
    tokenizer_json = path / "tokenizer_3" / "tokenizer.json"  # T5's: the API counts prompt tokens with it
    return ModelCard(
        name, "sd3", "text", path=str(path), image_size=size * factor,
        latent_channels=int(transformer.get("in_channels", 16)), latent_size=size,
        dtype=extra.get("dtype", "bfloat16"), scheduler=scheduler, defaults={**DEFAULTS, **extra.get("defaults", {})},
        max_tokens=tokens, sizes=tuple(sizes), size_multiple=multiple,
        size_range=(multiple, largest or 2 * size * factor),
        tokenizer_file=str(tokenizer_json) if tokenizer_json.is_file() and not no_t5 else "")


def skips_t5(path: Path, index: dict) -> bool:
    """Whether the model runs without T5 (its prompt part zeros, as the reference with text_encoder_3=None):
    no text_encoder_3/ in the directory, or ``dit_serve.skip_t5`` set (saves T5-XXL's ~9 GiB)."""
    return bool(index.get("dit_serve", {}).get("skip_t5")) or not (path / "text_encoder_3").is_dir()


def aspect_sizes(native: int, multiple: int) -> list[tuple[int, int]]:
    """(width, height): the native square, then each of workers.sizes.RATIOS landscape and portrait at the native pixel
    count, sides rounded to 64 px (to ``multiple`` when the native side is not a multiple of 64: tiny models)."""
    return ratio_sizes(native, 64 if native % 64 == 0 and 64 % multiple == 0 else multiple)


def _check_parts(path: Path, vae: dict | None, scheduler: dict, no_t5: bool) -> None:
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
    for w, h in sizes:
        if max(w, h) > largest:
            raise CardError(f"{path}: size {w}x{h} is larger than the transformer's positional embedding "
                            f"allows ({largest} px per side: pos_embed_max_size patches)")
