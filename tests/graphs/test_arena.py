"""Arena layout arithmetic and CPU views: no GPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs import Arena, ArenaLayout, TensorSpec
from graphs.arena import ALIGN

SPECS = {
    "x": TensorSpec((4, 3, 3), torch.float32),  # 36 floats = 144 bytes a row
    "t": TensorSpec((), torch.int64),  # 8 bytes a row
    "cond": TensorSpec((5,), torch.bfloat16),  # 10 bytes a row
    "flag": TensorSpec((1,), torch.bool),
}


def assert_valid_layout(layout, specs, max_batch):
    assert layout.max_batch == max_batch
    assert [e.name for e in layout.entries] == list(specs)
    spans = []
    for e in layout.entries:
        assert e.offset % ALIGN == 0
        assert e.nbytes == specs[e.name].nbytes(max_batch)
        spans.append((e.offset, e.offset + e.nbytes))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start  # no overlap
    assert layout.total_bytes >= sum(e.nbytes for e in layout.entries)
    assert layout.total_bytes % ALIGN == 0
    assert all(end <= layout.total_bytes for _, end in spans)


def test_layout_example():
    layout = ArenaLayout.plan(SPECS, max_batch=8)
    # x: 8 * 144 = 1152 bytes at 0; t: 8 * 8 = 64 at 1280 (1152 rounded up to 256);
    # cond: 8 * 10 = 80 at 1536; flag: 8 at 1792; total 2048.
    assert [(e.name, e.offset, e.nbytes) for e in layout.entries] == [
        ("x", 0, 1152), ("t", 1280, 64), ("cond", 1536, 80), ("flag", 1792, 8)]
    assert layout.total_bytes == 2048
    assert layout.entry("t").offset == 1280
    assert_valid_layout(layout, SPECS, 8)


dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
                          torch.uint8, torch.float64])
spec_st = st.builds(TensorSpec, st.lists(st.integers(0, 5), max_size=3).map(tuple), dtypes)


@settings(max_examples=100, deadline=None)
@given(specs=st.dictionaries(st.text("abcdef", min_size=1, max_size=4), spec_st, max_size=6),
       max_batch=st.integers(1, 16))
def test_layout_properties(specs, max_batch):
    assert_valid_layout(ArenaLayout.plan(specs, max_batch), specs, max_batch)


def test_arena_views_share_one_zeroed_allocation():
    arena = Arena(SPECS, max_batch=8, device="cpu")
    assert arena.nbytes == arena.buffer.numel() == 2048
    assert arena.buffer.dtype == torch.uint8
    base = arena.buffer.data_ptr()
    for name, spec in SPECS.items():
        view = arena.tensor(name)
        assert view.shape == (8, *spec.shape_per_sample)
        assert view.dtype == spec.dtype
        assert view.is_contiguous()
        assert view.data_ptr() == base + arena.layout.entry(name).offset
        assert view.data_ptr() % ALIGN == base % ALIGN
        assert not view.any()  # zeroed
        rows = arena.slice(name, 3)
        assert rows.shape == (3, *spec.shape_per_sample)
        assert rows.data_ptr() == view.data_ptr()
    assert arena.slice("x", 0).shape == (0, 4, 3, 3)


def test_arena_views_do_not_overlap():
    arena = Arena(SPECS, max_batch=4, device="cpu")
    for i, name in enumerate(SPECS, start=1):
        arena.tensor(name).fill_(i)
    for i, (name, spec) in enumerate(SPECS.items(), start=1):
        assert (arena.tensor(name) == torch.tensor(i).to(spec.dtype)).all()  # bool: True
    arena.slice("t", 2).copy_(torch.tensor([7, 9]))  # a slice writes into the arena itself
    assert arena.tensor("t").tolist() == [7, 9, 2, 2]


def test_arena_errors_are_clear():
    arena = Arena(SPECS, max_batch=4, device="cpu")
    with pytest.raises(KeyError, match="no tensor 'y'"):
        arena.tensor("y")
    for bad in (5, -1, 1.0):
        with pytest.raises(ValueError, match="rows must be an int in \\[0, 4\\]"):
            arena.slice("x", bad)
    with pytest.raises(ValueError, match="max_batch"):
        ArenaLayout.plan(SPECS, 0)
    with pytest.raises(ValueError, match="must be a TensorSpec"):
        ArenaLayout.plan({"x": ((3,), torch.float32)}, 4)
    with pytest.raises(ValueError, match="ints >= 0"):
        TensorSpec((3, -1), torch.float32)
    with pytest.raises(ValueError, match="torch.dtype"):
        TensorSpec((3,), "float32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_arena_on_cuda_without_cuda_raises():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        Arena(SPECS, max_batch=4, device="cuda")
