"""The families added beside DiT, PixArt, SD3 and FLUX.1 (FLUX.2, Qwen-Image, Z-Image, Sana) through the HTTP
API as any family: an API-only service over their tiny random pipeline directories lists each with its sizes,
defaults and samplers (GET /v1/models), accepts a job with the card's defaults (POST /v1/jobs) and an OpenAI
request at a size it makes, and answers a field its card refuses with a 400 naming that field. The images
themselves equal the diffusers pipelines' in tests/workers/families/test_<family>.py."""

from __future__ import annotations

import httpx
import pytest

from dit_serve.server.service import Service
from workers.request.cards import read_card

from .conftest import service_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from workers.models.tiny_flux2 import make_tiny_flux2
    from workers.models.tiny_qwenimage import make_tiny_qwenimage
    from workers.models.tiny_sana import make_tiny_sana
    from workers.models.tiny_zimage import make_tiny_zimage

    root = tmp_path_factory.mktemp("families")
    return {"klein": make_tiny_flux2(root / "klein"), "klein-base": make_tiny_flux2(root / "klein-base", base=True),
            "qwen": make_tiny_qwenimage(root / "qwen"), "zimage": make_tiny_zimage(root / "zimage"),
            "sana": make_tiny_sana(root / "sana")}


@pytest.fixture(scope="module")
def api(dirs, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("api"), "digits", workers={"models": tuple(map(str, dirs.values()))})
    with Service(cfg, roles=("api",)) as svc:
        with httpx.Client(base_url=svc.url, timeout=10) as http:
            yield http


def test_each_is_listed_with_its_cards_sizes_defaults_and_samplers(api, dirs):
    listed = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    families = {}
    for name, path in dirs.items():
        card, entry = read_card(path), listed[path.name]
        families[name] = entry["family"]
        assert entry["sizes"] == [f"{w}x{h}" for w, h in card.made_sizes()] and entry["defaults"] == card.defaults
        assert card.defaults["sampler"] in entry["samplers"] and entry["conditioning"] == "text"
    assert families == {"klein": "flux2", "klein-base": "flux2", "qwen": "qwenimage", "zimage": "zimage",
                        "sana": "sana"}
    assert listed[dirs["sana"].name]["samplers"] == ["flow_euler", "flow_dpmpp_2m"]
    assert listed[dirs["klein"].name]["guidance"] == "none" and listed[dirs["klein-base"].name]["guidance"] == "cfg"


@pytest.mark.parametrize("name", ["klein", "klein-base", "qwen", "zimage", "sana"])
def test_a_job_takes_the_cards_defaults_and_an_openai_request_a_size_it_makes(api, dirs, name):
    card = read_card(dirs[name])
    r = api.post("/v1/jobs", json={"model": card.name, "prompts": ["a red cat"]})
    assert r.status_code == 202, r.text
    params = api.get(f"/v1/jobs/{r.json()['id']}").json()["params"]
    assert (params["sampler"], params["steps"], params["guidance"]) == (
        card.defaults["sampler"], card.defaults["steps"], card.defaults["guidance"])
    body = {"model": card.name, "prompt": "a red cat", "response_format": "b64_json"}
    if card.size_range[1]:  # sizes in a range (FLUX.2, Qwen-Image, Z-Image): one past it is refused; Sana snaps
        r = api.post("/v1/images/generations", json={**body, "size": "4096x4000"})  # to its nearest bin
        assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
    w, h = card.made_sizes()[-1]
    with pytest.raises(httpx.ReadTimeout):  # accepted: it waits for the images (no worker in an API-only service)
        api.post("/v1/images/generations", json={**body, "size": f"{w}x{h}"}, timeout=1.0)


def test_a_field_the_card_refuses_is_a_400_naming_it(api, dirs):
    def error(body):
        r = api.post("/v1/jobs", json=body)
        assert r.status_code == 400, r.text
        return r.json()["error"]["param"], r.json()["error"]["message"]

    klein, sana, qwen = (read_card(dirs[n]).name for n in ("klein", "sana", "qwen"))
    assert error({"model": klein, "prompts": ["a cat"], "negative_prompt": "blur"})[0] == "negative_prompt"
    assert error({"model": sana, "labels": [1]})[0] == "labels"
    assert error({"model": sana, "prompts": ["a cat"], "sampler": "ddim"})[0] == "sampler"
    assert error({"model": qwen, "prompts": ["a cat"], "width": 4096, "height": 4096})[0] in ("width", "size")
    param, message = error({"model": sana, "prompts": ["a cat"], "sampler": "flow_dpmpp_2m", "steps": 900})
    assert param == "steps" and "flow_dpmpp_2m" in message
