"""The API's view of the models (read from JSON, no torch) agrees with the loader's; requests are
resolved against models and limits."""

from __future__ import annotations

import pytest

from dit_serve.catalog import Catalog, RequestError, describe
from dit_serve.config import LimitsConfig
from dit_serve.schemas import ImageGenerationRequest, JobRequest


@pytest.fixture(scope="module")
def catalog(digits_model):
    return Catalog([describe(digits_model)], LimitsConfig(max_items_per_job=30))


def test_describe_matches_the_loader(digits_model):
    from workers.loading import load_model

    info, model = describe(digits_model), load_model(digits_model)
    assert (info.name, info.num_classes, info.image_size) == (model.name, model.num_classes, model.image_size)
    assert info.id2label == model.id2label and info.defaults == model.defaults
    for label in (0, "7", "seven", " Nine "):
        assert info.label_id(label) == model.label_id(label)
    big = describe("dit-xl-2-256")
    assert (big.num_classes, big.image_size) == (1000, 256)


def test_resolve_job_fills_defaults_and_seeds(catalog):
    new = catalog.resolve_job(JobRequest(labels=["two", 5], num_per_label=3, seed=7))
    info = catalog.model("digits")
    assert new.labels == [2, 2, 2, 5, 5, 5] and new.seeds == [7, 8, 9, 10, 11, 12]
    assert (new.params.sampler, new.params.steps) == (info.defaults["sampler"], info.defaults["steps"])
    assert catalog.resolve_job(JobRequest(labels=[1, 2], seeds=[5, 3])).seeds == [5, 3]


@pytest.mark.parametrize("req, param", [
    (JobRequest(labels=[1], num_per_label=31), "labels"),
    (JobRequest(labels=[1], steps=1001), "steps"),
    (JobRequest(labels=[1], sampler="flow_euler"), "sampler"),  # digits predicts noise, not flow
    (JobRequest(model="x", labels=[1]), "model"),
])
def test_resolve_job_refuses(catalog, req, param):
    with pytest.raises(RequestError) as e:
        catalog.resolve_job(req)
    assert e.value.param == param and e.value.status == 400


def test_openai_prompt_names_the_class(catalog):
    new = catalog.resolve_images(ImageGenerationRequest(prompt="Eight", n=2, size="8x8", seed=4))
    assert new.labels == [8, 8] and new.seeds == [4, 5]
    with pytest.raises(RequestError, match="must name one class"):
        catalog.resolve_images(ImageGenerationRequest(prompt="a cat"))
