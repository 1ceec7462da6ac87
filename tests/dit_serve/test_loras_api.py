"""Adapters (LoRA) through the HTTP API, in an API-only service: registration (checks before anything is stored,
tenants and sharing, ``[workers] lora_dir``), ``loras`` on jobs and the OpenAI endpoints (a 400 naming the adapter,
nothing stored), what reaches the worker (``ItemSpec.loras``), the manifest's record, and /metrics."""

from __future__ import annotations

import hashlib
import json
import struct

import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from dit_serve.server.keys import create_key
from dit_serve.server.service import Service
from dit_serve.server.store import dump_manifest

from .conftest import service_config

KEY = "loras-admin-key-0123"


def peft(rank: int = 2, modules=("transformer_blocks.0.attn.to_q",), width: int = 8, **meta) -> bytes:
    """A diffusers/PEFT adapter: lora_A (r, in), lora_B (out, r) per module."""
    tensors = {}
    for m in modules:
        tensors[f"transformer.{m}.lora_A.weight"] = np.ones((rank, width), np.float32)
        tensors[f"transformer.{m}.lora_B.weight"] = np.zeros((width, rank), np.float32)
    return save(tensors, metadata=meta or None)


def kohya_sd3() -> bytes:
    return save({"lora_unet_joint_blocks_0_x_block_attn_proj.lora_down.weight": np.ones((2, 8), np.float32),
                 "lora_unet_joint_blocks_0_x_block_attn_proj.lora_up.weight": np.zeros((8, 2), np.float32)})


@pytest.fixture(scope="module")
def svc(digits_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_dir")
    (folder / "house.safetensors").write_bytes(peft())
    (folder / "textonly.safetensors").write_bytes(peft())
    (folder / "textonly.json").write_text(json.dumps({"model": "digits-text"}))
    (folder / "broken.safetensors").write_bytes(b"\x80\x04 a pickle")
    cfg = service_config(tmp_path_factory.mktemp("loras"), digits_model,
                         workers={"models": ("digits", "digits-text"), "lora_slots": 4, "lora_max_rank": 8,
                                  "lora_per_request": 2, "lora_max_bytes": 4096, "lora_dir": str(folder)},
                         server={"api_keys": [KEY]})
    with Service(cfg, roles=("api",)) as service:
        yield service


@pytest.fixture(scope="module")
def http(svc):
    with httpx.Client(base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as h:
        yield h


@pytest.fixture(scope="module")
def alice(svc):
    _, key = create_key(svc.store, "alice")
    with httpx.Client(base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as h:
        yield h


@pytest.fixture(scope="module")
def bob(svc):
    _, key = create_key(svc.store, "bob")
    with httpx.Client(base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as h:
        yield h


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _state(svc) -> tuple[int, list[str]]:
    """Jobs in the store, and the files under loras/."""
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {KEY}"}) as h:
        total = h.get("/v1/jobs").json()["total"]
    folder = svc.config.store.data_dir / "loras"
    return total, sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_lora_dir_adapters_are_registered_shared(http, alice):
    names = {a["name"]: a for a in alice.get("/v1/loras").json()["data"]}
    assert {"house", "textonly"} <= set(names) and "broken" not in names
    assert names["house"]["shared"] and names["house"]["source"] == "dir" and names["house"]["model"] == ""
    assert names["textonly"]["model"] == "digits-text" and names["textonly"]["family"] == "pixart"
    assert names["house"]["sha256"] == hashlib.sha256(peft()).hexdigest()


def test_an_upload_is_the_tenants_own(svc, alice, bob, http):
    data = peft(rank=4)
    r = alice.post("/v1/loras", files={"file": ("a.safetensors", data)}, data={"name": "alice-style", "model": "digits"})
    assert r.status_code == 201, r.text
    got = r.json()
    assert (got["name"], got["model"], got["family"], got["format"], got["rank"], got["modules"], got["owner"],
            got["shared"]) == ("alice-style", "digits", "dit", "peft", 4, 1, "alice", False)
    assert (svc.config.store.data_dir / "loras" / "alice-style.safetensors").read_bytes() == data
    assert "alice-style" in {a["name"] for a in alice.get("/v1/loras").json()["data"]}
    assert "alice-style" not in {a["name"] for a in bob.get("/v1/loras").json()["data"]}
    _error(bob.get("/v1/loras/alice-style"), 404)
    _error(bob.delete("/v1/loras/alice-style"), 404)
    e = _error(bob.post("/v1/jobs", json={"labels": [1], "loras": [{"name": "alice-style"}]}), 400)
    assert "alice-style" in e["message"] and e["param"] == "loras"
    _error(alice.post("/v1/loras", files={"file": ("a.safetensors", data)}, data={"name": "alice-style"}), 409)
    _error(bob.post("/v1/loras", files={"file": ("a.safetensors", data)}, data={"name": "x", "shared": "true"}), 403)
    assert alice.delete("/v1/loras/alice-style").json()["name"] == "alice-style"
    assert not (svc.config.store.data_dir / "loras" / "alice-style.safetensors").exists()


def test_the_admin_key_shares(http, bob):
    r = http.post("/v1/loras", files={"file": ("s.safetensors", peft())}, data={"name": "shared-one"})
    assert r.status_code == 201 and r.json()["shared"], r.text
    assert "shared-one" in {a["name"] for a in bob.get("/v1/loras").json()["data"]}
    _error(bob.delete("/v1/loras/shared-one"), 404)  # shared, not bob's


def _torch_pickle() -> bytes:
    return b"PK\x03\x04" + b"\0" * 60


@pytest.mark.parametrize("files, data, status, param, words", [
    ({"file": ("x.pt", _torch_pickle())}, {"name": "p"}, 400, "file", "pickle"),
    ({"file": ("x.ckpt", b"\x80\x04\x95 pickle")}, {"name": "p"}, 400, "file", "pickle"),
    ({"file": ("x.bin", b"not safetensors at all")}, {"name": "p"}, 400, "file", "not a safetensors"),
    ({"file": ("x.st", b"")}, {"name": "p"}, 400, "file", "empty"),
    ({"file": ("x.st", struct.pack("<Q", 2) + b"{}")}, {"name": "p"}, 400, "file", "no tensors"),
    ({"file": ("x.st", peft(rank=16))}, {"name": "p"}, 400, "file", "rank 16"),
    ({"file": ("x.st", peft(width=400))}, {"name": "p"}, 413, "file", "4,096"),
    ({"file": ("x.st", save({"a": np.ones(3, np.int64)}))}, {"name": "p"}, 400, "file", "floats"),
    ({"file": ("x.st", save({"text_encoder.x.lora_A.weight": np.ones((2, 8), np.float32),
                             "text_encoder.x.lora_B.weight": np.ones((8, 2), np.float32)}))},
     {"name": "p"}, 400, "file", "text-encoder"),
    ({"file": ("x.st", kohya_sd3())}, {"name": "p", "model": "digits"}, 400, "file", "sd3 family"),
    ({"file": ("x.st", peft())}, {"name": "../etc"}, 400, "name", "not an adapter name"),
    ({"file": ("x.st", peft())}, {"name": "p", "model": "nope"}, 400, "model", "unknown model"),
    ({"file": ("x.st", peft())}, {"name": "p", "colour": "red"}, 400, "colour", "unknown field"),
    ({"file": ("x.st", peft())}, {"name": "house"}, 409, "name", "exists"),
    ({}, {"name": "p"}, 400, "file", "file is required"),
])
def test_bad_adapters_are_refused_and_nothing_is_stored(svc, http, files, data, status, param, words):
    before = _state(svc)
    parts = {**files, **{k: (None, v) for k, v in data.items()}}  # multipart even without a file
    e = _error(http.post("/v1/loras", files=parts), status)
    assert e["param"] == param and words in e["message"], e
    assert _state(svc) == before


def test_jobs_carry_their_adapters_to_the_worker_and_manifest(svc, http):
    r = http.post("/v1/jobs", json={"labels": [3], "num_per_label": 2, "loras": [{"name": "house", "scale": 0.8}]})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["params"]["loras"] == [{"name": "house", "scale": 0.8, "sha256": hashlib.sha256(peft()).hexdigest()}]
    leases = [ls for ls in svc.store.lease("test-loras", ["digits"], 64, 60.0) if ls.job_id == job["id"]]
    assert [ls.spec.loras for ls in leases] == [(("house", 0.8),)] * 2
    manifest = json.loads(dump_manifest(svc.store.get_job(job["id"])))
    assert manifest["params"]["loras"] == job["params"]["loras"]


@pytest.mark.parametrize("loras, model, words", [
    ([{"name": "nope"}], "digits", "no adapter 'nope'"),
    ([{"name": "house", "scale": 4.5}], "digits", "adapter 'house': scale 4.5 is outside"),
    ([{"name": "house", "scale": -5}], "digits", "adapter 'house': scale -5"),
    ([{"name": "house"}, {"name": "house"}], "digits", "named twice"),
    ([{"name": "house"}, {"name": "textonly"}, {"name": "shared-one"}], "digits", "at most 2"),
    ([{"name": "textonly"}], "digits", "adapter 'textonly' is for model 'digits-text'"),
    ([{"name": "../x"}], "digits", "loras"),
    ([{"name": "house", "weight": 1}], "digits", "weight"),
    ([], "digits", "loras"),
])
def test_bad_loras_on_a_job_are_a_400_naming_them(svc, http, loras, model, words):
    before = _state(svc)
    body = {"model": model, "labels": [1], "loras": loras}
    e = _error(http.post("/v1/jobs", json=body), 400)
    assert words in e["message"] or words in (e["param"] or ""), e
    e = _error(http.post("/v1/images/generations", json={"model": model, "prompt": "1", "loras": loras}), 400)
    assert words in e["message"] or words in (e["param"] or ""), e
    assert _state(svc) == before


def test_openai_edits_take_loras_as_json_text(svc, http):
    before = _state(svc)
    e = _error(http.post("/v1/images/edits", files={"image": ("i.png", b"x")},
                         data={"prompt": "1", "loras": "not json"}), 400)
    assert "loras" in e["message"] or e["param"] == "loras"
    e = _error(http.post("/v1/images/edits", files={"image": ("i.png", b"x")},
                         data={"prompt": "1", "loras": json.dumps([{"name": "nope"}])}), 400)
    assert _state(svc) == before


def test_metrics_count_adapters(http):
    text = http.get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("dit_serve_loras_registered "))
    assert float(line.split()[1]) >= 2


def test_metrics_show_each_workers_adapters_and_drop_what_it_no_longer_reports():
    from dit_serve.server.metrics import Metrics

    def series(m: Metrics) -> dict[str, float]:
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in m.render().decode().splitlines()
                if ln.startswith("dit_serve_lora_") and not ln.startswith("dit_serve_lora_pushes")}

    m = Metrics()
    lora = {"resident": {"flux": ["ink", "oil"], "sd3": []}, "loads": 3, "evictions": 1,
            "rows": {"ink": 5, "oil": 2}, "waiting": 1}
    m.worker_report("w1", {"stats": {"lora": lora}})
    m.worker_report("w2", {"stats": {}})  # a worker without adapters sets none
    got = series(m)
    assert got['dit_serve_lora_resident{model="flux",worker="w1"}'] == 2
    assert got['dit_serve_lora_resident{model="sd3",worker="w1"}'] == 0
    assert got['dit_serve_lora_rows{adapter="ink",worker="w1"}'] == 5
    assert (got['dit_serve_lora_loads{worker="w1"}'], got['dit_serve_lora_evictions{worker="w1"}'],
            got['dit_serve_lora_waiting{worker="w1"}']) == (3, 1, 1)
    assert not any("w2" in k for k in got)
    m.worker_report("w1", {"stats": {"lora": {**lora, "resident": {"flux": ["ink"]}, "rows": {"ink": 6}}}})
    got = series(m)
    assert 'dit_serve_lora_rows{adapter="oil",worker="w1"}' not in got and "sd3" not in str(got)
    assert got['dit_serve_lora_rows{adapter="ink",worker="w1"}'] == 6
    m.forget_worker("w1")
    assert series(m) == {}


def test_an_adapter_on_a_linear_lora_targets_leave_out_is_refused_at_upload():
    """With ``[workers] lora_targets`` the API refuses, before anything is stored, an adapter on a linear the
    workers' banks leave out (the module's name and the patterns in the message); one within them passes."""
    from dit_serve.server.loras import AdapterError, LoraPolicy, check_bytes

    policy = LoraPolicy(slots=2, targets=(r"attn\.to_(q|k|v)$",))
    assert check_bytes(peft(modules=("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_v")),
                       policy).modules == 2
    with pytest.raises(AdapterError, match=r"'transformer_blocks\.0\.ff\.net\.2'.*lora_targets"):
        check_bytes(peft(modules=("transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.2")), policy)
    assert check_bytes(peft(modules=("transformer_blocks.0.ff.net.2",)), LoraPolicy(slots=2)).modules == 1


def test_the_sdk_registers_lists_applies_and_deletes_adapters(svc, tmp_path):
    from dit_serve import client as sdk

    path = tmp_path / "sdk-style.safetensors"
    path.write_bytes(peft(rank=3))
    with sdk.Client(svc.url, api_key=KEY) as c:
        lora = c.upload_lora(path, "sdk-style", "digits", shared=False)
        assert (lora.name, lora.rank, lora.shared) == ("sdk-style", 3, False)
        assert "sdk-style" in {a.name for a in c.loras().data}
        job = c.submit([1], loras=[("sdk-style", 0.5), {"name": "house", "scale": -1}])
        assert [(u.name, u.scale) for u in job.params.loras] == [("sdk-style", 0.5), ("house", -1.0)]
        with pytest.raises(sdk.ApiError, match="no adapter 'gone'"):
            c.submit([1], loras=["gone"])
        with pytest.raises(sdk.InvalidRequest):
            c.submit([1], loras=[("x", float("nan"))])
        assert c.delete_lora("sdk-style").name == "sdk-style"
        c.cancel(job)


def test_the_async_sdk_lists_adapters(svc):
    import asyncio

    from dit_serve import client as sdk

    async def run():
        async with sdk.AsyncClient(svc.url, api_key=KEY) as c:
            return await c.loras()

    assert "house" in {a.name for a in asyncio.run(run()).data}


def test_the_cli_uploads_lists_and_applies_adapters(svc, tmp_path):
    from .test_cli_usage import cli

    env = {"DIT_SERVE_URL": svc.url, "DIT_SERVE_API_KEY": KEY}
    path = tmp_path / "cli-style.safetensors"
    path.write_bytes(peft())
    up = cli("loras", "upload", str(path), "--model", "digits", env=env)
    assert up.returncode == 0 and up.stdout.startswith("cli-style\tdigits\tpeft rank 2"), up.stderr
    listed = cli("loras", env=env)
    assert listed.returncode == 0 and "cli-style\t" in listed.stdout and "house\t(any model)" in listed.stdout
    sub = cli("submit", "--labels", "2", "--lora", "cli-style:0.25", "--lora", "house", env=env)
    assert sub.returncode == 0, sub.stderr
    job = svc.store.get_job(sub.stdout.strip())
    assert [(u.name, u.scale) for u in job.params.loras] == [("cli-style", 0.25), ("house", 1.0)]
    bad = cli("submit", "--labels", "2", "--lora", "nope", env=env)
    assert bad.returncode != 0 and "no adapter 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    assert cli("loras", "delete", "cli-style", env=env).returncode == 0


def test_a_version_8_store_gains_the_adapter_table(tmp_path):
    """Schema 8 -> 9 in place: the ``loras`` table is created, and adapters register after it."""
    from sqlalchemy import inspect, text

    from dit_serve.server.store import SCHEMA_VERSION, Store

    url = f"sqlite:///{tmp_path}/s.db"
    store = Store(url, tmp_path)
    with store.engine.begin() as conn:
        conn.execute(text("DROP TABLE loras"))
        conn.execute(text("UPDATE dit_serve_schema SET version = 8"))
    store.close()
    store = Store(url, tmp_path)
    assert "loras" in inspect(store.engine).get_table_names() and SCHEMA_VERSION == 9
    store.put_lora("x", b"bytes", "default", False, "digits", "dit", "peft", 2, 1)
    assert [a.name for a in store.list_loras("default")] == ["x"] and store.list_loras("bob") == []
    store.close()
