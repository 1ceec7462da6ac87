"""Reading an engine's group stats in the families' GPU tests."""

from __future__ import annotations


def fallbacks(group_stats: dict) -> int:
    """Replays of a group's buckets that fell back to eager or failed to capture."""
    return sum(s["eager_fallbacks"] + s["capture_failures"] for s in group_stats["buckets"].values())


def pooled(groups) -> dict:
    """The stats of a shape's groups (its step with CFG and without: the family's step variants) as one: the
    first's backend and compile stats, every bucket's replays and fallbacks summed."""
    groups = list(groups)
    out = {**groups[0], "buckets": {}}
    for g in groups:
        if g["backend"] != out["backend"]:
            out["backend"] = "mixed"
        for b, st in g["buckets"].items():
            into = out["buckets"].setdefault(b, {k: 0 for k in st if isinstance(st[k], (int, float))})
            for k in into:
                into[k] += st.get(k, 0) if isinstance(st.get(k, 0), (int, float)) else 0
    return out
