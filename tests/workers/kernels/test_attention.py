"""The attention kernel chooser (workers/sdpa.py) on the CPU, with a fake timer: it keeps only kernels that
run the shape and match the math kernel, picks the fastest, measures each shape once, never inside a
capture, and leaves other devices to PyTorch's rule."""

from __future__ import annotations

import pytest
import torch

from workers.config import WorkerConfig
from workers.speed import SpeedConfig
from workers.kernels import attention as sdpa
from workers.kernels.attention import AttentionChooser


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
    from workers.speed.patches import attention_into

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


def _fake_fa4(calls):
    """A stand-in for FlashAttention-4's forward with its calling convention: (B, T, heads, d) inputs, the
    result written into ``out`` (B, T, heads, d), tiling keywords."""

    def forward(q, k, v, out, **tiles):
        calls.append((tiles, out.is_contiguous()))
        assert out.is_contiguous() and q.stride(-1) == 1
        out.copy_(torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                   v.transpose(1, 2)).transpose(1, 2))
        return out, None
    return forward


def test_fa4_runs_on_the_projections_layout_and_writes_into_the_scratch(monkeypatch):
    calls = []
    monkeypatch.setattr(sdpa, "_fa4_forward", _fake_fa4(calls))
    b, t, h, d = 2, 16, 4, 72
    qkv = torch.randn(b * t, 3 * h * d)  # the fused projection's (rows, 3 x inner) slot, as the scratch holds it
    q, k, v = (x.view(b, t, h, d).transpose(1, 2) for x in qkv.split(h * d, dim=1))  # (B, h, T, d) views
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    scratch = torch.full((b * t, h * d), float("nan"))
    out = scratch.view(b, t, h, d).transpose(1, 2)  # contiguous (B, T, h, d) underneath: written in place
    result = sdpa.run("fa4/128x128", q, k, v, out)
    assert result.data_ptr() == out.data_ptr() and calls[-1] == (sdpa.FA4_TILES["fa4/128x128"], True)
    torch.testing.assert_close(out, ref)
    strided = torch.full((b, h, t, d), float("nan"))  # not (B, T, h, d) underneath: its own buffer, copied
    assert sdpa.run("fa4", q, k, v, strided).data_ptr() == strided.data_ptr() and calls[-1] == ({}, True)
    torch.testing.assert_close(strided, ref)
    torch.testing.assert_close(sdpa.run("fa4", q, k, v), ref)  # no out: a view of a buffer of its own


def test_fa4_is_measured_only_on_gpus_and_sequences_it_can_win(monkeypatch):
    monkeypatch.setattr(sdpa, "_fa4_forward", _fake_fa4([]))
    long = torch.empty(1, 2, sdpa.FA4_MIN_TOKENS, 72)
    assert sdpa.candidates(long) == sdpa.CANDIDATES  # a CPU tensor: PyTorch's kernels only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert sdpa.candidates(long) == (*sdpa.CANDIDATES, *sdpa.FA4_TILES)
    assert sdpa.candidates(long, torch.empty(1, 2, 300, 72)) == sdpa.CANDIDATES  # 300 keys (PixArt's cross-attention)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    assert sdpa.candidates(long) == sdpa.CANDIDATES
    monkeypatch.setattr(sdpa, "_fa4_forward", None)  # not installed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert sdpa.candidates(long) == sdpa.CANDIDATES


class _CompilerError(Exception):
    """Stands for the CuTe DSL's own exception types, which are not RuntimeErrors."""


@pytest.mark.parametrize("failure", [AssertionError("head_dim must be divisible by 8"), _CompilerError("ptxas")])
def test_an_fa4_failure_is_a_runtime_error_the_chooser_records(monkeypatch, failure):
    def refuses(q, k, v, out, **tiles):
        raise failure

    monkeypatch.setattr(sdpa, "_fa4_forward", refuses)
    monkeypatch.setattr(sdpa, "candidates", lambda q, k=None: (*sdpa.CANDIDATES, "fa4"))
    with pytest.raises(RuntimeError, match=type(failure).__name__):
        sdpa.run("fa4", *_qkv())
    choice = AttentionChooser(timer=lambda fn: 1.0, devices=("cpu",)).measure(*_qkv())
    assert choice.kernel == "flash" and choice.rejected["fa4"] == "does not run this shape"


def test_the_kernel_cache_directory_reaches_fa4_before_its_import_only(monkeypatch, tmp_path):
    import sys

    for name in (sdpa.FA4_CACHE_ENABLED, sdpa.FA4_CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "flash_attn.cute.cache_utils", raising=False)
    assert sdpa.use_cache_dir(tmp_path / "kernels")
    assert sdpa.os.environ[sdpa.FA4_CACHE_ENABLED] == "1"
    assert sdpa.os.environ[sdpa.FA4_CACHE_DIR] == str(tmp_path / "kernels" / "flash-attention-4")
    monkeypatch.setenv(sdpa.FA4_CACHE_DIR, "/elsewhere")  # the operator's own setting is kept
    assert sdpa.use_cache_dir(tmp_path / "other")
    assert sdpa.os.environ[sdpa.FA4_CACHE_DIR] == "/elsewhere"
    monkeypatch.delenv(sdpa.FA4_CACHE_DIR)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.cache_utils", object())  # read already: too late
    assert not sdpa.use_cache_dir(tmp_path / "late")
    assert sdpa.FA4_CACHE_DIR not in sdpa.os.environ


def test_an_engine_with_a_compile_cache_gives_it_to_fa4(monkeypatch, tmp_path):
    import sys

    from workers.engine import Engine
    from workers.loading import load_model

    for name in (sdpa.FA4_CACHE_ENABLED, sdpa.FA4_CACHE_DIR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "flash_attn.cute.cache_utils", raising=False)
    model = load_model("digits", device="cpu")
    Engine(model, WorkerConfig(backend="eager"))
    assert sdpa.FA4_CACHE_DIR not in sdpa.os.environ  # no cache directory configured: FA4's default
    Engine(model, WorkerConfig(backend="eager"), speed=SpeedConfig(compile_cache=str(tmp_path)))  # not compiled: FA4 still compiles
    assert sdpa.os.environ[sdpa.FA4_CACHE_DIR] == str(tmp_path / "flash-attention-4")
