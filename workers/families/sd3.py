"""The sd3 family (not written yet)."""

from __future__ import annotations

BREAK_ATTENTION = False


def load(card, device, dtype):
    raise NotImplementedError("sd3 models cannot be loaded yet")
