"""Sana's aspect-ratio bins, torch-free.

SanaPipeline snaps a request to the bin of its transformer's base resolution whose height/width ratio is
nearest (``use_resolution_binning``, on by default), generates at the bin, and resizes the image back to the
size asked. It picks the table by the transformer's ``sample_size`` (latent cells per side at the base
resolution): 16 -> ``ASPECT_RATIO_512_BIN``, 32 -> ``ASPECT_RATIO_1024_BIN`` (PixArt-α's tables, imported by
the Sana pipeline), 64 -> ``ASPECT_RATIO_2048_BIN`` (PixArt-Σ's), 128 -> ``ASPECT_RATIO_4096_BIN`` (its own,
below). Any other sample size it refuses to bin. Keys are height / width rounded to two places; values
height x width, as ``workers.families.pixart.bins`` keeps the shared ones.
"""

from __future__ import annotations

from workers.families.pixart.bins import ASPECT_RATIO_BINS


def _table(text: str) -> dict[float, tuple[int, int]]:
    """"ratio:HxW ..." -> {ratio: (height, width)}."""
    return {float(r): (int(hw.split("x")[0]), int(hw.split("x")[1]))
            for r, hw in (entry.split(":") for entry in text.split())}


ASPECT_RATIO_4096_BIN = _table("""
    0.25:2048x8192 0.26:2048x7936 0.27:2048x7680 0.28:2048x7424 0.32:2304x7168 0.33:2304x6912 0.35:2304x6656
    0.4:2560x6400 0.42:2560x6144 0.48:2816x5888 0.5:2816x5632 0.52:2816x5376 0.57:3072x5376 0.6:3072x5120
    0.68:3328x4864 0.72:3328x4608 0.78:3584x4608 0.82:3584x4352 0.88:3840x4352 0.94:3840x4096 1.0:4096x4096
    1.07:4096x3840 1.13:4352x3840 1.21:4352x3584 1.29:4608x3584 1.38:4608x3328 1.46:4864x3328 1.67:5120x3072
    1.75:5376x3072 2.0:5632x2816 2.09:5888x2816 2.4:6144x2560 2.5:6400x2560 2.89:6656x2304 3.0:6912x2304
    3.11:7168x2304 3.62:7424x2048 3.75:7680x2048 3.88:7936x2048 4.0:8192x2048""")
SANA_BINS = {16: ASPECT_RATIO_BINS[512], 32: ASPECT_RATIO_BINS[1024], 64: ASPECT_RATIO_BINS[2048],
             128: ASPECT_RATIO_4096_BIN}  # transformer sample_size -> its table, as SanaPipeline.__call__ picks


def sana_bins(sample_size: int) -> list[tuple[int, int]]:
    """The (width, height) bins SanaPipeline snaps to for a transformer of this latent ``sample_size``; empty
    where it has none (it then refuses to bin: such a model lists its sizes itself)."""
    table = SANA_BINS.get(int(sample_size))
    return [(w, h) for h, w in table.values()] if table else []
