"""A weights file told apart by its first bytes: safetensors, or a pickle (refused, never read).

A safetensors file starts with its header's length, 8 bytes little-endian, then the header's JSON (``{``). A pickle
is what ``torch.save`` writes: a zip archive (``PK\\x03\\x04``) or a bare pickle (``\\x80`` and its protocol). The
length's first byte may itself be ``\\x80`` (a header of 128, 384, ... bytes), so the safetensors shape is checked
first: such a file is safetensors, not a pickle. Torch-free: the API checks uploads with it.
"""

from __future__ import annotations

PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive; a bare pickle (protocol 2+)
HEAD = 9  # the bytes ``is_pickle`` reads: the header's length and its first character


def is_safetensors(head: bytes, size: int) -> bool:
    """Whether a file of ``size`` bytes starting with ``head`` (at least ``HEAD`` bytes) is shaped as safetensors:
    a header length that fits the file, then the header's ``{``."""
    if len(head) < HEAD:
        return False
    length = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 2 <= length <= size - 8


def is_pickle(head: bytes, size: int) -> bool:
    """Whether a file of ``size`` bytes starting with ``head`` is a pickle (``torch.save``) and not safetensors."""
    return head.startswith(PICKLE_MAGIC) and not is_safetensors(head, size)
