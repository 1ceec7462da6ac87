"""The text families' encoding cache: an LRU per model keyed by the processed text (repeated prompts
are common in batch jobs: 10,000 images of one prompt encode once), misses encoded in one batch."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

CACHE_SIZE = 4096


@torch.no_grad()
def encodings(model, texts: list[str], encode: Callable[[list[str]], list[tuple[torch.Tensor, ...]]],
              size: int = CACHE_SIZE) -> dict[str, tuple[torch.Tensor, ...]]:
    """``{text: tensors}`` for ``texts``: cached ones reused, the rest from one ``encode(missing)`` call
    (one tuple of tensors per text). Entries are copies, so evicting one frees its memory."""
    cache: OrderedDict = model.cache
    missing = [t for t in texts if t not in cache]
    if missing:
        for text, tensors in zip(missing, encode(missing), strict=True):
            cache[text] = tuple(t.clone() for t in tensors)
    out = {}
    for text in texts:
        cache.move_to_end(text)
        out[text] = cache[text]
    while len(cache) > size:
        cache.popitem(last=False)
    return out
