"""Text-to-image jobs at the API (no workers): prompts for text models, labels for class models, the
wrong kind a 400 naming the field, nothing stored; prompts travel to the worker's spec."""

from __future__ import annotations

import time

import httpx
import pytest

from dit_serve.server.service import Service
from workers.models.tiny_pixart import make_tiny_pixart

from .conftest import service_config


@pytest.fixture(scope="module")
def api(digits_model, tmp_path_factory):
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_sd3 import make_tiny_sd3

    models = tmp_path_factory.mktemp("models")
    text_model = make_tiny_pixart(models / "pixart-tiny")
    cfg = service_config(tmp_path_factory.mktemp("text-api"), digits_model,
                         workers={"models": (digits_model, "digits-text", str(text_model), str(make_tiny_sd3(models / "sd3-tiny")),
                                             str(make_tiny_flux(models / "flux-tiny")),
                                             str(make_tiny_flux(models / "schnell-tiny", schnell=True)))})
    with Service(cfg, roles=("api",)) as svc:
        with httpx.Client(base_url=svc.url, timeout=10) as http:
            yield svc, http


def test_a_text_job_stores_its_prompts(api):
    svc, http = api
    r = http.post("/v1/jobs", json={"model": "pixart-tiny", "prompts": ["a red cat", "a dog"], "num_per_prompt": 2,
                                    "negative_prompt": "small", "seed": 3})
    assert r.status_code == 202, r.text
    job = r.json()
    assert [it["prompt"] for it in job["items"]] == ["a red cat", "a red cat", "a dog", "a dog"]
    assert all(it["label"] is None for it in job["items"]) and job["params"]["negative_prompt"] == "small"
    assert job["params"]["sampler"] == "dpmpp_2m" and job["params"]["steps"] == 20  # the card's defaults
    leases = [ls for ls in svc.store.lease("w", ["pixart-tiny"], 10, ttl=30) if ls.job_id == job["id"]]
    spec = leases[2].spec
    assert (spec.prompt, spec.negative_prompt, spec.seed, spec.model) == ("a dog", "small", 5, "pixart-tiny")
    svc.store.release(leases, "stop")
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["pixart-tiny"]["conditioning"] == "text" and models["pixart-tiny"]["max_tokens"] == 16
    assert models["digits"]["conditioning"] == "class" and models["pixart-tiny"]["sizes"] == [
        "16x16", "32x16", "16x32", "32x32"] and models["digits"]["sizes"] == ["8x8"]


@pytest.mark.parametrize("body, param, words", [
    ({"model": "pixart-tiny", "labels": [1]}, "labels", "draws from text: send prompts"),
    ({"labels": [1], "prompts": ["a cat"]}, None, "both were given"),
    ({"model": "digits", "prompts": ["seven"]}, "prompts", "class-conditional: send labels"),
    ({"model": "digits", "labels": [7], "negative_prompt": "blurry"}, "negative_prompt", "applies to text models"),
    ({"model": "pixart-tiny", "prompts": ["   "]}, "prompts.0", "non-empty"),
    ({"model": "pixart-tiny", "prompts": ["x" * 32001]}, "prompts.0", "at most 32000"),
    ({"model": "digits", "labels": [1], "width": 32}, "width", "makes 8x8 images only"),
    ({"model": "digits", "labels": [1], "height": 16, "exact_size": True}, "height", "makes 8x8 images only"),
    ({"model": "pixart-tiny"}, None, "neither was given"),
])
def test_the_wrong_conditioning_is_a_400_and_stores_nothing(api, body, param, words):
    _, http = api
    before = http.get("/v1/jobs").json()["total"]
    r = http.post("/v1/jobs", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err
    assert http.get("/v1/jobs").json()["total"] == before


def test_the_images_endpoint_takes_the_prompt_of_a_text_model(api):
    from dit_serve.schemas import ImageGenerationRequest

    svc, _ = api
    from dit_serve.server.service import build_catalog

    new = build_catalog(svc.config).resolve_images(ImageGenerationRequest(model="pixart-tiny", prompt="a tree", n=2))
    assert new.prompts == ["a tree", "a tree"] and new.model == "pixart-tiny"


@pytest.mark.parametrize("body, made, output", [
    ({}, (16, 16), (0, 0)),                                         # the native size
    ({"width": 32, "height": 16}, (32, 16), (0, 0)),                # a size it makes
    ({"width": 300, "height": 140}, (32, 16), (0, 0)),              # snapped to the nearest aspect ratio
    ({"width": 300, "height": 140, "exact_size": True}, (32, 16), (300, 140)),  # then resized to it
    ({"width": 32, "height": 16, "exact_size": True}, (32, 16), (0, 0)),        # nothing to resize
])
def test_sizes_snap_to_what_the_model_makes_and_reach_the_worker(api, body, made, output):
    svc, http = api
    r = http.post("/v1/jobs", json={"model": "pixart-tiny", "prompts": ["a cat"], **body})
    assert r.status_code == 202, r.text
    p = r.json()["params"]
    assert (p["width"], p["height"], p["output_width"], p["output_height"]) == (*made, *output)
    leases = [ls for ls in svc.store.lease("w", ["pixart-tiny"], 50, ttl=30) if ls.job_id == r.json()["id"]]
    spec = leases[0].spec
    assert (spec.width, spec.height, spec.out_width, spec.out_height) == (*made, *output)
    svc.store.release(svc.store.lease("w", ["pixart-tiny"], 50, ttl=30) + leases, "stop")
    http.post(f"/v1/jobs/{r.json()['id']}/cancel")


def test_the_images_endpoint_size_is_the_image_size(api):
    from dit_serve.schemas import ImageGenerationRequest
    from dit_serve.server.service import build_catalog

    svc, http = api
    catalog = build_catalog(svc.config)
    p = catalog.resolve_images(ImageGenerationRequest(model="pixart-tiny", prompt="a tree", size="64x30")).params
    assert (p.width, p.height, p.output_width, p.output_height) == (32, 16, 64, 30)
    p = catalog.resolve_images(ImageGenerationRequest(model="pixart-tiny", prompt="a tree", size="16x32")).params
    assert (p.width, p.height, p.output_width, p.output_height) == (16, 32, 0, 0)
    for size, words in (("big", "WIDTHxHEIGHT"), ("16x16", "does not make 16x16 images; size must be one of 8x8")):
        r = http.post("/v1/images/generations", json={"model": "digits" if size == "16x16" else "pixart-tiny",
                                                      "prompt": "7", "size": size})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "size" and "width" not in r.json()["error"]["message"]


def test_a_prompt_over_the_token_limit_is_cut_with_a_warning_in_the_job(api):
    _, http = api
    long = " ".join(["a red cat"] * 10)  # 31 tokens with </s>; the tiny model reads 16
    r = http.post("/v1/jobs", json={"model": "pixart-tiny", "prompts": ["a dog", long]})
    assert r.status_code == 202, r.text
    (warning,) = r.json()["params"]["warnings"]
    assert warning.startswith(f"prompts[1] {long[:57] + '...'!r} has 31 tokens") and "reads the first 16" in warning
    assert http.get(f"/v1/jobs/{r.json()['id']}").json()["params"]["warnings"] == [warning]  # stored with the job
    http.post(f"/v1/jobs/{r.json()['id']}/cancel")


def test_digits_text_counts_tokens_before_its_tokenizer_truncates(api):
    """digits-text's tokenizer.json truncates at 32 and pads to 32: counted as shipped, every prompt had 32."""
    _, http = api
    long = " ".join(["seven"] * 90)  # 90 words, 91 tokens with the end token
    r = http.post("/v1/jobs", json={"model": "digits-text", "prompts": ["a seven", long]})
    assert r.status_code == 202, r.text
    (warning,) = r.json()["params"]["warnings"]
    assert warning.startswith("prompts[1] 'seven seven") and "has 91 tokens" in warning, warning
    huge = "seven " * 1666  # about 10,000 characters, through the OpenAI endpoint (no worker: it waits, then 504)
    job = _openai_job(http, {"model": "digits-text", "prompt": huge})
    (warning,) = job["params"]["warnings"]
    assert warning.startswith("prompt 'seven seven") and "has 1667 tokens" in warning, warning


def test_one_prompt_limit_for_jobs_and_the_images_endpoint_from_the_model_card(api):
    _, http = api
    card = http.get("/v1/models/digits-text").json()
    limit = card["max_prompt_chars"]
    assert limit == 32000
    fits, over = "seven " * ((limit - 1) // 6), "x" * (limit + 1)
    r = http.post("/v1/jobs", json={"model": "digits-text", "prompts": [fits]})
    assert r.status_code == 202, r.text
    http.delete(f"/v1/jobs/{r.json()['id']}")
    assert _openai_job(http, {"model": "digits-text", "prompt": fits})["params"]["warnings"]
    for path, body, param in (("/v1/jobs", {"model": "digits-text", "prompts": [over]}, "prompts.0"),
                              ("/v1/images/generations", {"model": "digits-text", "prompt": over}, "prompt")):
        err = http.post(path, json=body).json()["error"]
        assert err["param"] == param and f"has {limit + 1} characters; at most {limit}" in err["message"], err


def _openai_job(http, body: dict) -> dict:
    """The job an images request made (this service has no worker): sent in a thread, found in the list."""
    import threading

    before = http.get("/v1/jobs").json()["total"]
    def send() -> None:
        try:
            httpx.post(str(http.base_url.join("/v1/images/generations")), json=body, timeout=2)
        except httpx.TimeoutException:  # it waits for a worker there is none of; its job is cancelled
            pass

    threading.Thread(target=send, daemon=True).start()
    for _ in range(100):
        page = http.get("/v1/jobs").json()
        if page["total"] > before:
            job = page["data"][0]
            http.delete(f"/v1/jobs/{job['id']}")
            return job
        time.sleep(0.05)
    raise AssertionError("the images request made no job")


def test_mmdit_models_say_what_guidance_means_and_refuse_what_does_not_apply(api):
    svc, http = api
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert [models[k]["family"] for k in ("sd3-tiny", "flux-tiny", "schnell-tiny")] == ["sd3", "flux", "flux"]
    assert [models[k]["guidance"] for k in ("sd3-tiny", "flux-tiny", "schnell-tiny", "digits")] == [
        "cfg", "embedded", "none", "cfg"]
    assert models["flux-tiny"]["defaults"]["sampler"] == "flow_euler" and models["flux-tiny"]["samplers"] == ["flow_euler"]
    assert "flow_euler" not in models["digits"]["samplers"] and "dpmpp_2m" in models["pixart-tiny"]["samplers"]
    for name in ("flux-tiny", "schnell-tiny"):
        r = http.post("/v1/jobs", json={"model": name, "prompts": ["a cat"], "negative_prompt": "blurry"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "negative_prompt", r.text
        assert "no classifier-free guidance" in r.json()["error"]["message"]
    r = http.post("/v1/jobs", json={"model": "sd3-tiny", "prompts": ["A Cat"], "negative_prompt": "blurry",
                                    "width": 40, "height": 24})
    assert r.status_code == 202, r.text
    p = r.json()["params"]
    assert (p["sampler"], p["negative_prompt"]) == ("flow_euler", "blurry")
    assert (p["width"], p["height"], p["warnings"]) == (40, 24, [])  # unlisted, made as asked (a multiple of 4)
    assert models["sd3-tiny"]["size_range"] == [4, 64] and models["sd3-tiny"]["size_multiple"] == 4
    big = http.post("/v1/jobs", json={"model": "sd3-tiny", "prompts": ["a cat"], "width": 4000, "height": 2000})
    assert big.status_code == 400 and big.json()["error"]["param"] == "width"  # past its positional embedding
    assert "multiples of 4 px from 4 to 64" in big.json()["error"]["message"]
    leases = [ls for ls in svc.store.lease("w", ["sd3-tiny"], 10, ttl=30) if ls.job_id == r.json()["id"]]
    assert leases[0].spec.prompt == "A Cat"  # SD3 reads the prompt as written (no lower-casing)
    svc.store.release(leases, "stop")
    http.post(f"/v1/jobs/{r.json()['id']}/cancel")
