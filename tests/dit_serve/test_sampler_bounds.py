"""Every job the API accepts can run: for each shipped model and each sampler, the step bounds the API
answers are those make_plan (the worker's plan builder) holds to, because both read samplers.rules.
Run at the API (TestClient, no worker); an accepted setting's plan is built here from the model's
schedule, as its worker builds it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from dit_serve.server.api import create_app
from dit_serve.server.catalog import grid_of
from dit_serve.server.metrics import Metrics
from dit_serve.server.service import build_catalog, open_store
from samplers.rules import RULES, max_steps
from workers.cards import SHIPPED, read_card
from workers.families.base import DIT_SCHEDULER

from .conftest import service_config


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("bounds"), "digits",
                         workers={"models": SHIPPED}, limits={"max_steps": 10_000})
    store = open_store(cfg)
    with TestClient(create_app(store, build_catalog(cfg), cfg.server, Metrics())) as client:
        yield client
    store.close()


def _body(model: str, sampler: str, steps: int) -> dict:
    what = {"prompts": ["a seven"]} if read_card(model).conditioning == "text" else {"labels": [7]}
    return {"model": model, "sampler": sampler, "steps": steps, **what}


@pytest.mark.parametrize("model", SHIPPED)
@pytest.mark.parametrize("sampler", list(RULES))
def test_each_sampler_and_step_bound_of_each_shipped_model(http, model, sampler):
    from samplers import NoiseSchedule, make_plan

    card = read_card(model)
    if card.prediction_type not in RULES[sampler].predictions:
        r = http.post("/v1/jobs", json=_body(model, sampler, 10))
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampler", r.text
        return
    top = max_steps(sampler, grid_of(card))
    schedule = NoiseSchedule.from_config(card.scheduler or DIT_SCHEDULER)
    mu = {"mu": 0.5} if schedule.use_dynamic_shifting else {}
    for steps in (1, top):
        r = http.post("/v1/jobs", json=_body(model, sampler, steps))
        assert r.status_code == 202, (steps, r.text)
        make_plan(sampler, steps, schedule, **mu)  # what the worker builds from it
    r = http.post("/v1/jobs", json=_body(model, sampler, top + 1))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "steps", r.text
    bound = f"use at most {top} steps" if top < card.num_train_timesteps else f"from 1 to {top}"
    assert bound in err["message"], err["message"]


def test_dpmpp_2m_at_1000_steps_on_digits_text_is_a_400_naming_steps(http):
    """The job that was accepted and then failed in every item of the worker."""
    r = http.post("/v1/jobs", json=_body("digits-text", "dpmpp_2m", 1000))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "steps"
    assert "dpmpp_2m with 1000 steps" in err["message"] and "use at most 999 steps" in err["message"]
