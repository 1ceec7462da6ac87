"""The flux family (not written yet)."""

from __future__ import annotations

BREAK_ATTENTION = False


def load(card, device, dtype):
    raise NotImplementedError("flux models cannot be loaded yet")
