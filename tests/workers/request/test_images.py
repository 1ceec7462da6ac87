"""An edit request's uploaded image and mask (``workers.request.images``): what is decoded and how, what is
refused and with which message. Torch-free, like the module (the API runs the same checks)."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image

from workers.request import images
from workers.request.images import (MAX_IMAGE_PIXELS, ImageError, check_mask_size, check_strength, decode_image,
                                    decode_mask, mask_from_alpha, resize)
from workers.request.spec import ItemSpec


def _encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A valid one-pixel PNG whose header says width x height (a decompression bomb's header)."""
    data = bytearray(_encode(Image.new("L", (1, 1))))
    data[16:24] = struct.pack(">II", width, height)  # IHDR's width and height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_png_jpeg_and_webp_decode_to_rgb(fmt):
    src = Image.new("RGB", (12, 8), (200, 40, 10))
    im = decode_image(_encode(src, fmt, **({"quality": 95} if fmt != "PNG" else {})))
    assert (im.mode, im.size) == ("RGB", (12, 8))
    assert all(abs(a - b) <= 4 for a, b in zip(im.getpixel((5, 5)), (200, 40, 10)))


def test_exif_orientation_is_honoured():
    src = Image.new("RGB", (2, 1))
    src.putpixel((0, 0), (255, 0, 0))
    src.putpixel((1, 0), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the camera was turned; shown rotated 90 degrees clockwise
    im = decode_image(_encode(src, "PNG", exif=exif))
    assert im.size == (1, 2)  # upright: the left pixel on top
    assert im.getpixel((0, 0)) == (255, 0, 0) and im.getpixel((0, 1)) == (0, 0, 255)


def test_modes_are_converted():
    cmyk = decode_image(_encode(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "JPEG", quality=100))
    assert cmyk.mode == "RGB" and cmyk.getpixel((1, 1))[0] > 240 and cmyk.getpixel((1, 1))[1] < 15  # red
    sixteen = Image.new("I;16", (2, 1))
    sixteen.putpixel((0, 0), 65535)
    sixteen.putpixel((1, 0), 32896)
    gray = decode_image(_encode(sixteen))  # scaled to 8 bits, not clipped at 255
    assert gray.getpixel((0, 0)) == (255, 255, 255) and gray.getpixel((1, 0)) == (128, 128, 128)
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.putpixel((1, 0), 1)
    assert decode_image(_encode(palette)).getpixel((1, 0)) == (10, 200, 30)
    assert decode_image(_encode(Image.new("1", (3, 3), 1))).getpixel((0, 0)) == (255, 255, 255)


def test_alpha_is_composited_over_white_for_images_and_black_for_masks():
    rgba = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (255, 255, 255, 255))
    data = _encode(rgba)
    assert decode_image(data).getpixel((0, 0)) == (255, 255, 255)  # transparent: white behind it
    mask = decode_mask(data)
    assert mask.mode == "L" and mask.getpixel((0, 0)) == 0 and mask.getpixel((1, 0)) == 255
    keyed = Image.new("P", (2, 1))  # a palette with a transparent index
    keyed.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    keyed.putpixel((1, 0), 1)
    assert decode_image(_encode(keyed, transparency=0)).getpixel((0, 0)) == (255, 255, 255)


def test_a_mask_from_alpha_repaints_what_is_transparent():
    rgba = Image.new("RGBA", (3, 1), (9, 9, 9, 255))
    rgba.putpixel((0, 0), (9, 9, 9, 0))
    rgba.putpixel((1, 0), (9, 9, 9, 128))
    mask = mask_from_alpha(_encode(rgba))
    assert [mask.getpixel((x, 0)) for x in range(3)] == [255, 127, 0]
    with pytest.raises(ImageError, match="mask: has no transparency") as e:
        mask_from_alpha(_encode(Image.new("RGB", (2, 2))))
    assert e.value.field == "mask"


@pytest.mark.parametrize("data, message", [
    (b"", "image: empty"),
    (b"GIF89a not really", "image: not a PNG, JPEG or WebP"),
    (_encode(Image.new("RGB", (4, 4)), "GIF"), "image: not a PNG, JPEG or WebP"),
    (_encode(Image.new("RGB", (4, 4)), "BMP"), "image: not a PNG, JPEG or WebP"),
    (_encode(Image.new("RGB", (64, 64), (3, 4, 5)))[:-40], "image: cannot be decoded"),
    (_png_claiming(6000, 5000), "image: .*more than the 25,000,000 pixels allowed \\(a decompression bomb"),
    (_png_claiming(100_000, 100_000), "image: .*more than the 25,000,000 pixels allowed"),
])
def test_bad_bytes_are_refused_naming_the_field(data, message):
    with pytest.raises(ImageError, match=message) as e:
        decode_image(data)
    assert e.value.field == "image" and isinstance(e.value, ValueError)
    with pytest.raises(ImageError, match=message.replace("image:", "mask:")) as e:
        decode_mask(data)
    assert e.value.field == "mask"


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_animated_images_are_refused(fmt):
    frames = [Image.new("RGB", (4, 4), (60 * i, 0, 0)) for i in range(3)]
    with pytest.raises(ImageError, match=f"image: an animated {fmt} of 3 frames is refused"):
        decode_image(_encode(frames[0], fmt, save_all=True, append_images=frames[1:]))


def test_pillows_own_limit_is_ours():
    assert Image.MAX_IMAGE_PIXELS == MAX_IMAGE_PIXELS == images.MAX_IMAGE_PIXELS == 25_000_000
    with pytest.raises(ImageError, match="image: 5001x5000 is more than the 25,000,000 pixels allowed"):
        images._check_size(5001, 5000, "image")  # ours, behind Pillow's (which refuses such a file first)
    assert decode_image(_encode(Image.new("L", (5000, 5000)))).size == (5000, 5000)  # at the limit: decoded


def test_the_mask_must_have_the_images_size():
    check_mask_size(Image.new("RGB", (8, 6)), Image.new("L", (8, 6)))
    with pytest.raises(ImageError, match="mask: 6x8 differs from the image's 8x6") as e:
        check_mask_size(Image.new("RGB", (8, 6)), Image.new("L", (6, 8)))
    assert e.value.field == "mask"


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, float("nan"), float("inf"), True, "0.5", None])
def test_strength_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="strength must be a number in \\(0, 1\\]"):
        check_strength(value)


def test_strength_inside_passes_and_the_resize_is_lanczos():
    for value in (1e-6, 0.3, 1, 1.0):
        check_strength(value)
    src = Image.effect_noise((20, 10), 60).convert("RGB")
    assert resize(src, 8, 16).tobytes() == src.resize((8, 16), Image.Resampling.LANCZOS).tobytes()


def test_the_specs_repr_leaves_the_bytes_out():
    spec = ItemSpec(id="a", seed=1, sampler="ddim", steps=4, guidance=1.0, image=b"\x89PNG" * 1000, mask=b"x",
                    strength=0.5)
    assert "PNG" not in repr(spec) and "strength=0.5" in repr(spec)
    assert ItemSpec(id="b", seed=1, sampler="ddim", steps=4, guidance=1.0).image == b""
