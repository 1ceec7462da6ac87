"""The attention kernel chooser (workers/sdpa.py) on the CPU, with a fake timer: it keeps only kernels that
run the shape and match the math kernel, picks the fastest, measures each shape once, never inside a
capture, and leaves other devices to PyTorch's rule."""

from __future__ import annotations

import pytest
import torch

from workers import sdpa
from workers.sdpa import AttentionChooser


def _qkv(b=2, h=4, t=16, d=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=g) for _ in range(3)]


def test_the_fastest_kernel_that_runs_and_matches_is_chosen_once_per_shape(monkeypatch):
    timed = []

    def timer(fn):  # flash "takes" 2 ms, anything else 5
        timed.append(fn)
        return 2.0 if len(timed) == 1 else 5.0

    chooser = AttentionChooser(timer=timer, devices=("cpu",))
    q, k, v = _qkv()
    assert chooser.kernel(q, k, v) == "flash"  # on a CPU only flash runs of the three (math is the reference)
    choice = next(iter(chooser.choices.values()))
    assert set(choice.ms) == {"flash"} and set(choice.rejected) == {"cudnn", "efficient"}
    assert all(why == "does not run this shape" for why in choice.rejected.values())
    assert chooser.kernel(q, k, v) == "flash" and len(timed) == 1  # remembered, not measured again
    q2, k2, v2 = _qkv(b=4)
    chooser.kernel(q2, k2, v2)
    assert len(chooser.choices) == 2 and chooser.summary()[1].startswith("4x4x16x72 float32: flash")
    torch.testing.assert_close(sdpa.run("flash", q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_a_kernel_whose_output_differs_is_rejected_and_math_is_the_last_resort(monkeypatch):
    real = sdpa.run
    monkeypatch.setattr(sdpa, "run", lambda name, q, k, v: real(name, q, k, v) * (1.1 if name == "flash" else 1.0))
    choice = AttentionChooser(timer=lambda fn: 1.0, devices=("cpu",)).measure(*_qkv())
    assert choice.kernel == "math" and choice.ms == {}
    assert choice.rejected["flash"].startswith("differs from the math kernel by")


def test_no_measuring_inside_a_capture_and_other_devices_keep_the_rule():
    from graphs import breakable

    chooser = AttentionChooser(timer=lambda fn: 1.0, devices=("cpu",))
    breakable._local.capture = object()
    try:
        assert chooser.kernel(*_qkv()) is None and chooser.choices == {}
    finally:
        breakable._local.capture = None
    assert AttentionChooser(timer=lambda fn: 1.0).kernel(*_qkv()) is None  # CUDA only by default: the CPU keeps the rule


def test_the_patched_attention_goes_through_the_chooser(monkeypatch):
    from workers.patches import attention_into

    seen = []
    monkeypatch.setattr(sdpa.CHOOSER, "kernel", lambda q, k, v: seen.append(q.shape) or "math")
    q, k, v = _qkv()
    out = torch.empty_like(q)
    attention_into(q, k, v, out)
    assert seen == [q.shape]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_a_shape_that_cannot_be_measured_keeps_the_rule_and_is_not_tried_again(monkeypatch):
    chooser = AttentionChooser(timer=lambda fn: 1.0, devices=("cpu",))
    tries = []

    def no_memory(q, k, v):
        tries.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(chooser, "measure", no_memory)
    q, k, v = _qkv()
    assert chooser.kernel(q, k, v) is None and chooser.kernel(q, k, v) is None and len(tries) == 1
    assert "rule" in chooser.summary()[0]
    out = sdpa.attention(q, k, v)  # the module's own chooser is untouched and the call still works
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
