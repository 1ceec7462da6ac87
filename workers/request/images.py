"""The input images of edit requests (image-to-image, inpainting), torch-free: the bytes a user uploaded,
checked and decoded with Pillow. The API runs these checks before it stores a job (a 4xx naming the field);
the worker decodes the same bytes again at admission (``workers.engine``), so what reaches a model is what the
checks passed. Every function here is pure: bytes in, a PIL image or an ``ImageError`` out.

The rules (each refusal an ``ImageError``, a ValueError whose ``field`` is ``image`` or ``mask``):

- **Formats**: PNG, JPEG and WebP only (Pillow is asked to try no other decoder). Empty or undecodable bytes,
  another format, a truncated file: refused. Nothing is executed or unpickled: Pillow's decoders only.
- **Size**: at most ``MAX_IMAGE_PIXELS`` pixels (25 MP: a 6000x4000 photo passes), read from the header before
  any pixel is decoded. Pillow's own decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) is set to the same
  number when this module is imported, so a file past it is refused on every path, never only warned about.
- **Animated** images (APNG, animated WebP): refused, not cut to their first frame: which frame a user means is
  not ours to guess ("upload one frame").
- **EXIF orientation** is applied (``ImageOps.exif_transpose``): a phone photo comes out upright, and sizes
  (the mask's comparison with the image's) are the upright ones.
- **Modes**: the result is RGB. Grayscale ("1", "L") and 16-bit grayscale ("I;16", "I": scaled to 8 bits,
  v / 257, not clipped) become gray RGB; palette, YCbCr and LAB are converted; CMYK is converted by Pillow's
  formula, without the file's colour profile. An alpha channel (RGBA, LA, PA, or a palette or colour key with
  transparency) is composited over white.
- **Masks** (``decode_mask``) pass the same checks and come out grayscale ("L"): white = repaint, black = keep,
  as diffusers' ``mask_image`` (its pipelines binarise at 50% after resizing). Alpha is composited over black:
  what a brush left transparent is kept. ``mask_from_alpha`` reads OpenAI's convention instead (transparent =
  repaint). A mask must have the image's size (``check_mask_size``).

``resize`` is what the reference pipelines' image processor does to an image before encoding it
(``VaeImageProcessor.preprocess``, resize mode "default"): a Lanczos resize to the generation size, the aspect
ratio not kept.
"""

from __future__ import annotations

import io
import math
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

MAX_IMAGE_PIXELS = 25_000_000  # per uploaded image (and mask), before any resize
FORMATS = ("PNG", "JPEG", "WEBP")

# Pillow's decompression-bomb guard, set explicitly (its default is about 89 MP, and only a warning up to twice
# that): images past our limit never reach a decoder in this process.
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS

TOO_LARGE = "(a decompression bomb, or a very large image: resize it before uploading)"
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_ALPHA = ("RGBA", "RGBa", "LA", "La", "PA")


class ImageError(ValueError):
    """An uploaded image (or mask) that is refused; ``field`` names the request field ("image" or "mask")."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def decode_image(data: bytes, what: str = "image") -> Image.Image:
    """An uploaded image as an upright RGB PIL image (the module's rules); ImageError naming ``what`` otherwise."""
    return _flatten(_open(data, what), background=(255, 255, 255), what=what).convert("RGB")


def decode_mask(data: bytes, what: str = "mask") -> Image.Image:
    """An uploaded mask as an upright grayscale ("L") PIL image, white = repaint; alpha composited over black."""
    return _flatten(_open(data, what), background=(0, 0, 0), what=what).convert("L")


def mask_from_alpha(data: bytes, what: str = "mask") -> Image.Image:
    """A mask ("L") from an image's transparency, as OpenAI's image edits read theirs: fully transparent pixels
    are repainted (white), opaque ones kept (black), partial alpha in between. ImageError when it has no alpha."""
    im = _open(data, what)
    if im.mode not in _ALPHA and "transparency" not in im.info:
        raise ImageError(f"{what}: has no transparency to read a mask from (a PNG or WebP with an alpha channel)",
                         what)
    alpha = im.convert("RGBA").getchannel("A")
    return alpha.point(lambda v: 255 - v)


def check_mask_size(image: Image.Image, mask: Image.Image) -> None:
    """ImageError (field ``mask``) when the mask is not the image's size, as OpenAI's image edits refuse it."""
    if image.size != mask.size:
        raise ImageError(f"mask: {mask.width}x{mask.height} differs from the image's {image.width}x{image.height}; "
                         "a mask must have the image's size", "mask")


def check_strength(strength: float) -> None:
    """ValueError naming ``strength`` unless it is in (0, 1]: how much of the schedule an edit runs (1: all of it,
    from pure noise as the reference pipelines; 0.3: its last 30%, close to the input)."""
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength) \
            or not 0 < strength <= 1:
        raise ValueError(f"strength must be a number in (0, 1], got {strength!r}")


def resize(image: Image.Image, width: int, height: int) -> Image.Image:
    """``image`` at width x height as the reference pipelines' image processor makes it before encoding: a Lanczos
    resize (``VaeImageProcessor.resize``, mode "default": stretched, the aspect ratio not kept; the same size: a
    copy)."""
    return image.resize((width, height), resample=Image.Resampling.LANCZOS)


# -- the checks ------------------------------------------------------------------------------------------------
def _open(data: bytes, what: str) -> Image.Image:
    """Decode ``data`` fully, upright, after the checks: format, pixel count, one frame."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"{what}: expected the bytes of a PNG, JPEG or WebP file, got {type(data).__name__}", what)
    if not len(data):
        raise ImageError(f"{what}: empty; upload a PNG, JPEG or WebP file", what)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(bytes(data)), formats=FORMATS)
            _check_size(im.width, im.height, what)
            if getattr(im, "n_frames", 1) > 1:
                raise ImageError(f"{what}: an animated {im.format} of {im.n_frames} frames is refused; upload one "
                                 "frame as a still PNG, JPEG or WebP", what)
            im.load()
            return ImageOps.exif_transpose(im)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{what}: more than the {MAX_IMAGE_PIXELS:,} pixels allowed {TOO_LARGE}", what) from None
    except UnidentifiedImageError:
        raise ImageError(f"{what}: not a PNG, JPEG or WebP image (or a damaged one)", what) from None
    except Exception as e:  # a decoder's error: truncated data, a bad chunk, corrupt EXIF
        raise ImageError(f"{what}: cannot be decoded ({type(e).__name__}: {e})", what) from None


def _check_size(width: int, height: int, what: str) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"{what}: has no pixels ({width}x{height})", what)
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"{what}: {width}x{height} is more than the {MAX_IMAGE_PIXELS:,} pixels allowed {TOO_LARGE}",
                         what)


def _flatten(im: Image.Image, background: tuple[int, int, int], what: str) -> Image.Image:
    """Any mode as RGB or L: 16-bit grayscale scaled to 8 bits, alpha composited over ``background``."""
    if im.mode in _SIXTEEN_BIT:  # convert("L") would clip 16-bit values at 255: scale instead
        return im.convert("I").point(lambda v: v * (1 / 257)).convert("L")
    if im.mode == "F":
        raise ImageError(f"{what}: floating-point pixels are not supported; upload 8- or 16-bit data", what)
    if im.mode in _ALPHA or "transparency" in im.info:
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*background, 255)), rgba).convert("RGB")
    return im if im.mode in ("RGB", "L") else im.convert("RGB")
