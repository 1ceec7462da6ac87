"""The API's view of the models (their cards, read from JSON without torch) is the loader's; requests
are resolved against models and limits."""

from __future__ import annotations

import pytest

from dit_serve.schemas import ImageGenerationRequest, JobRequest
from dit_serve.server.catalog import Catalog, RequestError
from dit_serve.server.config import LimitsConfig
from workers.request.cards import read_card


@pytest.fixture(scope="module")
def catalog(digits_model):
    return Catalog.of([digits_model], LimitsConfig(max_items_per_job=30))


@pytest.mark.parametrize("name", ["digits", "digits-flow", "digits-text", "dit-xl-2-256"])
def test_the_loader_builds_what_the_card_describes(name):
    from workers.loading import load_model

    info = read_card(name)
    model = load_model(name, device="meta") if info.builtin else load_model(name)
    assert model.card == info
    assert (info.name, info.num_classes, info.image_size) == (model.name, model.num_classes, model.image_size)
    assert (info.latent_channels, info.latent_size, info.latent_size) == model.latent_shape
    assert info.id2label == model.id2label and info.defaults == model.defaults
    assert info.prediction_type == model.schedule.prediction_type
    assert info.num_train_timesteps == model.schedule.num_train_timesteps
    assert (info.pixel_space, info.dtype) == ((model.vae is None), "float32" if info.path else "bfloat16")
    for label in ((0, "7", "9") if info.num_classes else ()) + (("seven", " Nine ") if info.id2label else ()):
        assert info.label_id(label) == model.label_id(label)
    assert (model.text_encoder is not None) == (info.conditioning == "text")


def test_serve_and_generate_accept_the_same_models():
    from dit_serve.server.config import Config
    from dit_serve.server.service import build_catalog

    catalog = build_catalog(Config().with_overrides(workers={"models": ("digits", "digits-flow")}))
    assert list(catalog.models) == ["digits", "digits-flow"]
    assert catalog.resolve_job(JobRequest(model="digits-flow", labels=[1])).params.sampler == "flow_euler"


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


def test_precision_and_speeds_are_per_served_model_and_a_name_not_served_is_refused():
    from dit_serve.errors import ConfigError
    from dit_serve.server.config import Config
    from dit_serve.server.service import ServiceError, build_catalog

    ok = Config().with_overrides(workers={"models": ("digits", "digits-text"), "precision": {"digits-text": "fp8"}})
    assert ok.workers.precision == {"digits-text": "fp8"} and build_catalog(ok)
    with pytest.raises(ServiceError, match=r"\[workers.precision\] names 'digits-flow', not among the served models"):
        build_catalog(Config().with_overrides(workers={"models": ("digits",), "precision": {"digits-flow": "fp8"}}))
    with pytest.raises(ServiceError, match=r"\[workers.model_speed\] names 'x', not among the served models"):
        build_catalog(Config().with_overrides(workers={"models": ("digits",), "model_speed": {"x": "fast"}}))
    with pytest.raises(ConfigError, match="workers.model_speed.digits: Input should be 'default', 'fast' or 'fastest'"):
        Config().with_overrides(workers={"model_speed": {"digits": "fused"}})
    with pytest.raises(ConfigError, match="workers.precision.digits: Input should be 'bf16', 'fp8' or 'fp8\\+attention'"):
        Config().with_overrides(workers={"precision": {"digits": "fp4"}})


def test_the_models_list_shows_each_models_speed():
    """GET /v1/models says the speed the workers run each model at ([workers] speed, model_speed over it)."""
    from dit_serve.server.config import Config
    from dit_serve.server.service import build_catalog

    config = Config().with_overrides(workers={"models": ("digits", "digits-text"), "speed": "fast",
                                              "model_speed": {"digits-text": "default"}})
    catalog = build_catalog(config)
    assert [catalog.entry(n).speed for n in catalog.models] == ["fast", "default"]
