"""PixArt's aspect-ratio bins, torch-free.

PixArt-α and PixArt-Σ were trained on a fixed set of (height, width) bins per base resolution; their
reference pipelines snap a request to the bin whose height/width ratio is nearest, generate at the
bin, and resize the image back to the asked size (``use_resolution_binning``). The bins below are the
reference pipelines' tables (``ASPECT_RATIO_{256,512,1024,2048}_BIN``), kept as data so the API can
check sizes without torch. Keys are height / width rounded to two places; values height x width. The
nearest bin is ``workers.request.sizes.nearest_bin``'s.
"""

from __future__ import annotations


def _bins(text: str) -> dict[float, tuple[int, int]]:
    """"ratio:HxW ..." -> {ratio: (height, width)}."""
    out = {}
    for entry in text.split():
        ratio, hw = entry.split(":")
        h, w = hw.split("x")
        out[float(ratio)] = (int(h), int(w))
    return out


ASPECT_RATIO_BINS: dict[int, dict[float, tuple[int, int]]] = {
    256: _bins("""
        0.25:128x512 0.28:128x464 0.32:144x448 0.33:144x432 0.35:144x416 0.4:160x400 0.42:160x384
        0.48:176x368 0.5:176x352 0.52:176x336 0.57:192x336 0.6:192x320 0.68:208x304 0.72:208x288
        0.78:224x288 0.82:224x272 0.88:240x272 0.94:240x256 1.0:256x256 1.07:256x240 1.13:272x240
        1.21:272x224 1.29:288x224 1.38:288x208 1.46:304x208 1.67:320x192 1.75:336x192 2.0:352x176
        2.09:368x176 2.4:384x160 2.5:400x160 3.0:432x144 4.0:512x128"""),
    512: _bins("""
        0.25:256x1024 0.28:256x928 0.32:288x896 0.33:288x864 0.35:288x832 0.4:320x800 0.42:320x768
        0.48:352x736 0.5:352x704 0.52:352x672 0.57:384x672 0.6:384x640 0.68:416x608 0.72:416x576
        0.78:448x576 0.82:448x544 0.88:480x544 0.94:480x512 1.0:512x512 1.07:512x480 1.13:544x480
        1.21:544x448 1.29:576x448 1.38:576x416 1.46:608x416 1.67:640x384 1.75:672x384 2.0:704x352
        2.09:736x352 2.4:768x320 2.5:800x320 3.0:864x288 4.0:1024x256"""),
    1024: _bins("""
        0.25:512x2048 0.28:512x1856 0.32:576x1792 0.33:576x1728 0.35:576x1664 0.4:640x1600 0.42:640x1536
        0.48:704x1472 0.5:704x1408 0.52:704x1344 0.57:768x1344 0.6:768x1280 0.68:832x1216 0.72:832x1152
        0.78:896x1152 0.82:896x1088 0.88:960x1088 0.94:960x1024 1.0:1024x1024 1.07:1024x960 1.13:1088x960
        1.21:1088x896 1.29:1152x896 1.38:1152x832 1.46:1216x832 1.67:1280x768 1.75:1344x768 2.0:1408x704
        2.09:1472x704 2.4:1536x640 2.5:1600x640 3.0:1728x576 4.0:2048x512"""),
    2048: _bins("""
        0.25:1024x4096 0.26:1024x3968 0.27:1024x3840 0.28:1024x3712 0.32:1152x3584 0.33:1152x3456
        0.35:1152x3328 0.4:1280x3200 0.42:1280x3072 0.48:1408x2944 0.5:1408x2816 0.52:1408x2688
        0.57:1536x2688 0.6:1536x2560 0.68:1664x2432 0.72:1664x2304 0.78:1792x2304 0.82:1792x2176
        0.88:1920x2176 0.94:1920x2048 1.0:2048x2048 1.07:2048x1920 1.13:2176x1920 1.21:2176x1792
        1.29:2304x1792 1.38:2304x1664 1.46:2432x1664 1.67:2560x1536 1.75:2688x1536 2.0:2816x1408
        2.09:2944x1408 2.4:3072x1280 2.5:3200x1280 2.89:3328x1152 3.0:3456x1152 3.11:3584x1152
        3.62:3712x1024 3.75:3840x1024 3.88:3968x1024 4.0:4096x1024"""),
}
BIN_BY_SAMPLE_SIZE = {32: 256, 64: 512, 128: 1024, 256: 2048}  # transformer sample_size -> base resolution


def pixart_bins(sample_size: int) -> list[tuple[int, int]]:
    """The (width, height) bins a PixArt transformer of this latent ``sample_size`` was trained on; empty
    for sizes the reference pipelines do not bin (they then generate at the size asked)."""
    base = BIN_BY_SAMPLE_SIZE.get(int(sample_size))
    return [(w, h) for h, w in ASPECT_RATIO_BINS[base].values()] if base else []
