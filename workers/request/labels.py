"""Class labels by number or by name (pure Python: the API process uses it without torch)."""

from __future__ import annotations


def resolve_label(label: int | str, num_classes: int, id2label: dict[int, str], model: str) -> int:
    """A class index from a number or one of id2label's comma-separated names (case-insensitive);
    ValueError with a message a user can act on when it is not a class of ``model``."""
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        label = int(label)
    if isinstance(label, int):
        if 0 <= label < num_classes:
            return label
        raise ValueError(f"label {label} is outside model {model!r}'s classes 0..{num_classes - 1}")
    key = label.strip().lower()
    for idx, names in id2label.items():
        if key in (n.strip().lower() for n in names.split(",")):
            return idx
    hint = ", ".join(list(id2label.values())[:5])
    raise ValueError(f"unknown class name {label!r} for model {model!r}" + (
        f" (class names look like: {hint}, ...)" if hint else f" (it has no class names: use 0..{num_classes - 1})"))
