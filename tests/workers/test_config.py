"""The worker's config (workers/config.py): the three speeds, per model, and the finer fields over them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.config import WorkerConfig
from workers.families import family_named

DIT, PIXART, FLUX = family_named("dit"), family_named("pixart"), family_named("flux")


def test_default_is_plain_graphs_in_the_models_dtype():
    speed = WorkerConfig().speed_for("digits", DIT)
    assert (speed.compile, speed.decode_graphs, speed.precision) == ("off", False, "")


@pytest.mark.parametrize("family, scope", [(DIT, "step"), (PIXART, "blocks"), (FLUX, "blocks")])
def test_fast_compiles_at_the_familys_scope_and_captures_the_decode(family, scope):
    speed = WorkerConfig(speed="fast").speed_for("m", family)
    assert (speed.compile, speed.compile_scope, speed.decode_graphs, speed.precision) == ("inductor", scope, True, "")


def test_fastest_adds_fp8_and_fp8_attention_where_the_family_has_it():
    assert WorkerConfig(speed="fastest").speed_for("m", DIT).precision == "fp8"
    assert WorkerConfig(speed="fastest").speed_for("m", FLUX).precision == "fp8+attention"
    assert WorkerConfig(speed="fastest").precision_for("m", FLUX) == ("fp8+attention", False)  # the speed's pick
    assert WorkerConfig(precision={"m": "fp8"}).precision_for("m", FLUX) == ("fp8", True)     # the user's own


def test_a_models_own_speed_and_the_finer_fields_override_the_speed():
    cfg = WorkerConfig(speed="fast", model_speed={"b": "default"}, compile_scope="step", decode_graphs=False,
                       precision={"a": "fp8"})
    a, b = cfg.speed_for("a", FLUX), cfg.speed_for("b", FLUX)
    assert (a.compile, a.compile_scope, a.decode_graphs, a.precision) == ("inductor", "step", False, "fp8")
    assert (b.compile, b.decode_graphs, b.precision) == ("off", False, "")
    assert WorkerConfig(compile="inductor").speed_for("c", DIT).compile == "inductor"  # compiled at "default"


def test_unknown_speeds_and_fields_are_refused():
    with pytest.raises(ValidationError, match="speed"):
        WorkerConfig(speed="turbo")
    with pytest.raises(ValidationError, match="kernels"):
        WorkerConfig(kernels={"digits": "fused"})  # the per-model compile switch is a model's speed now
