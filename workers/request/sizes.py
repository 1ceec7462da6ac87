"""Image sizes: how a requested width x height maps to the size a model makes (pure Python: the API
checks sizes without torch).

A family with reference aspect-ratio bins lists them itself (PixArt's: ``workers.families.pixart.bins``);
``nearest_bin`` snaps a request to the one whose height/width ratio is nearest, as the reference
pipelines do, and ``ratio_sizes`` lists the sizes of families that make any multiple of their patch.
"""

from __future__ import annotations

import math


def nearest_bin(width: int, height: int, sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The (width, height) in ``sizes`` whose height/width ratio is nearest the request's, as the reference
    pipelines choose (ties: the first listed)."""
    ratio = height / width
    return min(sizes, key=lambda wh: abs(round(wh[1] / wh[0], 2) - ratio))


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height); ValueError naming the expected form."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"size must be 'WIDTHxHEIGHT' in pixels (e.g. '512x768'), got {text!r}") from None
    if w <= 0 or h <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return w, h


RATIOS = ((4, 3), (3, 2), (16, 9), (21, 9))  # width:height besides the square, each also transposed


def ratio_sizes(native: int, unit: int) -> list[tuple[int, int]]:
    """(width, height): the native square, then each of RATIOS at the native pixel count, landscape then
    portrait, each side rounded to the nearest ``unit`` (sizes already listed dropped). For families that
    make any multiple of their patch (SD3, FLUX) but have no reference bins."""
    def side(v: float) -> int:
        return max(unit, round(v / unit) * unit)

    out = [(native, native)]
    for w, h in RATIOS:
        r = math.sqrt(w / h)
        wide = (side(native * r), side(native / r))
        out += [s for s in (wide, wide[::-1]) if s not in out]
    return out
