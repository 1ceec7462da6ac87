"""bench/fp8_quality.py on a CPU (digits, float32): both accumulations against one reference, one FP8 load."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("fp8_quality_bench", BENCH / "fp8_quality.py")
    q = sys.modules["fp8_quality_bench"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(q)
    seen, real = [], q.generate

    def spy(name, precision, n, device, dtype, variants=((None, False),)):
        seen.append((precision, tuple(variants)))
        return real(name, precision, n, device, dtype, variants)

    monkeypatch.setattr(q, "generate", spy)
    return q, seen


def test_both_accumulations_are_reported_against_the_same_reference(tmp_path, monkeypatch):
    from workers import fp8

    q, seen = _bench(monkeypatch)
    before = fp8.FAST_ACCUM
    assert q.main(["--smoke", "--fast-accum", "--images", "1", "--models", "digits", "--out", str(tmp_path)]) == 0
    assert seen == [("bf16", ((None, False),)), ("fp8", ((False, False), (True, False)))]  # one FP8 load for both
    assert fp8.FAST_ACCUM == before
    r = json.loads((tmp_path / "fp8_quality_smoke_fastaccum.json").read_text())["models"]["digits"]
    for run in (r, r["fast_accum"]):
        assert 20 < run["median_psnr_db"] < 200 and run["items"][0]["max_abs_diff"] >= 0
    md = (tmp_path / "fp8_quality_smoke_fastaccum.md").read_text()
    assert "| digits, promoted accumulation |" in md and "| digits, fast accumulation |" in md


def test_without_the_flag_fp8_runs_once_as_the_products_are_set(tmp_path, monkeypatch):
    from workers import fp8

    q, seen = _bench(monkeypatch)
    assert q.main(["--smoke", "--images", "1", "--models", "digits", "--out", str(tmp_path)]) == 0
    assert seen[1] == ("fp8", ((None, False),))
    md = (tmp_path / "fp8_quality_smoke.md").read_text()
    assert "| digits | dit |" in md and "accumulation" not in md and "attention" not in md


def test_the_attention_flag_adds_an_fp8_attention_run_from_the_same_load(tmp_path, monkeypatch):
    q, seen = _bench(monkeypatch)
    assert q.main(["--smoke", "--attention", "--images", "1", "--models", "digits", "--out", str(tmp_path)]) == 0
    assert seen[1] == ("fp8", ((None, False), (None, True)))
    r = json.loads((tmp_path / "fp8_quality_smoke_attention.json").read_text())["models"]["digits"]
    # DiT has no joint attention to route: its FP8-attention run is its bf16-attention run, image for image
    assert r["fp8_attention"]["items"] == r["items"]
    md = (tmp_path / "fp8_quality_smoke_attention.md").read_text()
    assert "| digits, bf16 attention |" in md and "| digits, FP8 attention |" in md
