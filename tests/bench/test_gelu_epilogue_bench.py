"""bench/gelu_epilogue.py runs end to end on a CPU (--smoke) and writes its report."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_smoke_writes_a_row_per_shape(tmp_path):
    spec = importlib.util.spec_from_file_location("gelu_epilogue", BENCH / "gelu_epilogue.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gelu_epilogue_smoke.json").read_text())
    assert saved["rows"] == result["rows"] and len(saved["rows"]) == len(bench.SMOKE)
    assert saved["epilogue_is_tanh"] is False  # no CUDA: the CPU's form is erf, never used
    assert all(r["separate_ms"] > 0 and r["epilogue_ms"] > 0 for r in saved["rows"])
    assert "| tiny | 128 | 64 |" in (tmp_path / "gelu_epilogue_smoke.md").read_text()
