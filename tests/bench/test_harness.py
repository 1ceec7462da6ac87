"""bench/harness.py: presets into engine configs, statistics, reports; and each script's --smoke run on a CPU."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import harness  # noqa: E402


@pytest.mark.parametrize("family, scope, precision", [("dit", "step", "fp8"), ("pixart", "blocks", "fp8"),
                                                      ("sd3", "blocks", "fp8+attention"),
                                                      ("flux", "blocks", "fp8+attention")])
def test_presets_build_the_engine_config_and_precision(family, scope, precision):
    (worker, speed), p = harness.engine_config("default", family)
    assert (worker.backend, speed.compile, speed.decode_graphs, p) == ("graphs", "off", False, "bf16")
    (worker, speed), p = harness.engine_config("fast", family)
    assert (speed.compile, speed.compile_scope, speed.decode_graphs, p) == ("inductor", scope, True, "bf16")
    (worker, speed), p = harness.engine_config("fastest", family)
    assert (speed.compile, speed.compile_scope, speed.precision, p) == ("inductor", scope, precision, precision)


def test_overrides_apply_last_and_unknown_presets_are_refused():
    (worker, speed), p = harness.engine_config("fastest", "flux", compile_scope="step", precision="fp8", max_batch=4,
                                               gelu_epilogue=False)
    assert (speed.compile_scope, worker.max_batch, speed.gelu_epilogue, p) == ("step", 4, False, "fp8")
    with pytest.raises(ValueError, match="preset"):
        harness.engine_config("turbo", "dit")


def test_percentiles_interpolate_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0, 5.0]  # sorted 1..5: p50 = 3, p10 = 1 + 0.4 * 1 = 1.4, p90 = 4.6
    assert harness.percentile(xs, 50) == 3.0
    assert harness.stats(xs) == {"median": 3.0, "p10": 1.4, "p90": 4.6, "n": 5}


def test_timers_return_every_sample():
    calls = []
    assert len(harness.wall_ms(lambda: calls.append(1), iters=4, warmup=2)) == 4 and len(calls) == 6
    assert len(harness.cuda_ms(lambda: None, iters=3)) == 3


def test_a_report_overwrites_the_workload_s_one_json_and_markdown(tmp_path):
    env = harness.environment("cpu")
    assert env["gpu"] is None and env["command"].startswith("python ")
    for value in (1, 2):
        paths = harness.write_report(tmp_path, "step_x", {"env": env, "value": value, "p": tmp_path}, "# t\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_x.json", "step_x.md"]
    assert json.loads(paths[0].read_text())["value"] == 2
    assert harness.table(["a", "b"], [[1.234, None]]) == ["| a | b |", "|---|---|", "| 1.23 | - |"]


def test_smoke_runs_never_write_into_docs_benchmarks(tmp_path):
    assert harness.out_dir(None, smoke=True) != harness.REPORTS
    assert harness.out_dir(None, smoke=False) == harness.REPORTS
    assert harness.out_dir(tmp_path, smoke=True) == tmp_path


def test_a_failing_part_is_recorded_and_the_rest_runs():
    result: dict = {}
    harness.attempt(result, "bad", lambda: 1 / 0)
    harness.attempt(result, "good", lambda: result.__setitem__("ran", True))
    assert result["ran"] and list(result["errors"]) == ["bad"] and "ZeroDivisionError" in result["errors"]["bad"]


def test_each_part_saves_the_report_so_far_marked_partial_and_the_end_saves_the_whole(tmp_path):
    """A run stopped by a time limit keeps the parts it finished; a half-done result the markdown cannot draw still
    leaves its JSON."""
    def markdown(result):
        return "# rows\n" + "\n".join(f"- {k}: {v['ms']}" for k, v in result["rows"].items())

    report = harness.Report(tmp_path, "step_x", markdown)
    result: dict = {"rows": {}}
    harness.attempt(result, "a", lambda: result["rows"].__setitem__("a", {"ms": 1.5}), report)
    data = json.loads((tmp_path / "step_x.json").read_text())
    assert data["partial"] is True and data["rows"] == {"a": {"ms": 1.5}}
    text = (tmp_path / "step_x.md").read_text()
    assert text.startswith("**Partial") and "- a: 1.5" in text
    harness.attempt(result, "b", lambda: result["rows"].__setitem__("b", {}), report)  # half done: no "ms" yet
    assert json.loads((tmp_path / "step_x.json").read_text())["rows"]["b"] == {}
    assert "not drawn from this partial result: KeyError" in (tmp_path / "step_x.md").read_text()
    result["rows"]["b"]["ms"] = 2.0
    report.save(result)
    assert "partial" not in json.loads((tmp_path / "step_x.json").read_text()) and "partial" not in result
    assert (tmp_path / "step_x.md").read_text() == "# rows\n- a: 1.5\n- b: 2.0\n"


class _Encoder(torch.nn.Module):
    """An encoder whose language model (``get_decoder()``, as transformers') takes 50 ms a call."""

    def __init__(self) -> None:
        super().__init__()
        self.language_model = _Sleep()

    def get_decoder(self):
        return self.language_model

    def forward(self, x):
        return self.language_model(x)


class _Sleep(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)

    def forward(self, x):
        time.sleep(0.05)
        return x


def test_the_encode_clock_times_an_encoder_once_whether_it_or_the_language_model_inside_it_is_called():
    model = SimpleNamespace(text_encoder=_Encoder(), device="cpu")
    with harness.EncodeClock(model) as clock:
        model.text_encoder(torch.ones(1))        # pipeline: encoder -> language model, one 50 ms call (not 100)
        outer = clock.take()
        model.text_encoder.language_model(torch.ones(1))  # ours (FLUX.2): the language model alone
        inner = clock.take()
    assert 45 <= outer < 95 and 45 <= inner < 95
    model.text_encoder(torch.ones(1))
    assert clock.take() == 0.0 and not model.text_encoder._forward_hooks  # its hooks gone with the block


def test_encoders_away_from_the_transformer_get_their_inputs_moved_once_and_the_others_nothing():
    away = SimpleNamespace(text_encoder=torch.nn.Linear(2, 2), text_encoder_2=torch.nn.Linear(2, 2), device="meta")
    away.text_encoder_3 = away.text_encoder  # shared modules count once
    for _ in range(2):
        harness.feed_encoders(away)
    assert [len(m._forward_pre_hooks) for m in harness.text_encoders(away)] == [1, 1]
    x = torch.ones(1, 2)  # already on the encoder's device: passed through, positional or by name
    assert torch.equal(away.text_encoder(input=x), away.text_encoder.forward(x))
    assert harness.encoder_device(away) == "cpu"
    here = SimpleNamespace(text_encoder=torch.nn.Linear(2, 2), device="cpu")
    harness.feed_encoders(here)
    assert not here.text_encoder._forward_pre_hooks and harness.encoder_device(SimpleNamespace(device="cpu")) is None
