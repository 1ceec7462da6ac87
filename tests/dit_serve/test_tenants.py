"""Tenants over HTTP: keys stored hashed and made by the CLI, each tenant confined to its own jobs
(404 for another's), Idempotency-Keys per tenant, per-tenant limits, admins, revocation."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import select

from dit_serve.server.keys import create_key, list_keys, revoke_key, set_limits
from dit_serve.server.service import Service
from dit_serve.server.store import api_keys

from .conftest import service_config


@pytest.fixture(scope="module")
def svc(digits_model, tmp_path_factory):
    cfg = service_config(tmp_path_factory.mktemp("tenants"), digits_model, server={"api_keys": ["config-admin-key"]},
                         limits={"tenant_max_priority": 10})
    with Service(cfg, roles=("api",)) as service:
        yield service


def _http(svc, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=svc.url, headers=headers, timeout=10)


def test_tenants_are_confined_to_their_own_jobs(svc):
    _, alice_key = create_key(svc.store, "alice")
    _, bob_key = create_key(svc.store, "bob")
    _, root_key = create_key(svc.store, "ops", role="admin")
    with _http(svc, alice_key) as alice, _http(svc, bob_key) as bob, _http(svc, root_key) as root:
        a = alice.post("/v1/jobs", json={"labels": [1]}, headers={"Idempotency-Key": "same-key"})
        b = bob.post("/v1/jobs", json={"labels": [2, 3]}, headers={"Idempotency-Key": "same-key"})
        assert a.status_code == b.status_code == 202 and a.json()["id"] != b.json()["id"]  # keys are per tenant
        a_id = a.json()["id"]
        assert a.json()["tenant"] == "alice"
        for method, path in (("GET", f"/v1/jobs/{a_id}"), ("GET", f"/v1/jobs/{a_id}/images/0"),
                             ("GET", f"/v1/jobs/{a_id}/archive"), ("DELETE", f"/v1/jobs/{a_id}"),
                             ("DELETE", f"/v1/jobs/{a_id}?purge=true"), ("POST", f"/v1/jobs/{a_id}/retry")):
            r = bob.request(method, path)
            assert r.status_code == 404 and a_id in r.json()["error"]["message"], (method, path, r.text)
        assert alice.get(f"/v1/jobs/{a_id}").json()["state"] == "queued"  # bob's cancel did nothing
        assert [j["id"] for j in bob.get("/v1/jobs").json()["data"]] == [b.json()["id"]]
        assert {j["tenant"] for j in root.get("/v1/jobs").json()["data"]} >= {"alice", "bob"}
        assert root.get(f"/v1/jobs/{a_id}").status_code == 200
        with _http(svc, "config-admin-key") as cfg_admin:  # a configured key: admin of 'default'
            assert cfg_admin.get(f"/v1/jobs/{a_id}").status_code == 200


def test_tenant_limits_priority_and_queue(svc):
    _, key = create_key(svc.store, "carol")
    assert set_limits(svc.store, "carol", max_queued=3, max_priority=None)
    with _http(svc, key) as carol:
        r = carol.post("/v1/jobs", json={"labels": [1], "priority": 11})
        assert r.status_code == 403 and "above your tenant's highest, 10" in r.json()["error"]["message"]
        assert carol.post("/v1/jobs", json={"labels": [1], "priority": 10}).status_code == 202
        assert carol.post("/v1/jobs", json={"labels": [1, 2]}).status_code == 202
        r = carol.post("/v1/jobs", json={"labels": [1]})
        assert r.status_code == 429 and "your tenant has 3 items" in r.json()["error"]["message"]
        assert r.headers["Retry-After"]
        assert carol.get("/v1/jobs").json()["total"] == 2
    with _http(svc, "config-admin-key") as admin:  # admins are bounded by the service only
        assert admin.post("/v1/jobs", json={"labels": [1], "priority": 100}).status_code == 202


def test_one_tenant_cannot_fill_the_queue_for_the_others(digits_model, tmp_path):
    """max_queued_items 10 with a reserve of 3: a tenant stops at 7 (the admin, unbounded per tenant, too);
    the last 3 places take tenants holding at most 3 items."""
    cfg = service_config(tmp_path, digits_model, server={"api_keys": ["admin-key"]},
                         limits={"max_queued_items": 10, "reserve_fraction": 0.3})
    with Service(cfg, roles=("api",)) as service:
        _, alice_key = create_key(service.store, "alice")
        _, bob_key = create_key(service.store, "bob")
        _, eve_key = create_key(service.store, "eve")
        with _http(service, "admin-key") as admin, _http(service, alice_key) as alice, \
                _http(service, bob_key) as bob, _http(service, eve_key) as eve:
            held = 0
            while (r := admin.post("/v1/jobs", json={"labels": [1]})).status_code == 202:
                held += 1
            assert held == 7 and r.status_code == 429 and r.headers["Retry-After"]
            assert "last 3 places are kept for tenants holding at most 3" in r.json()["error"]["message"]
            assert alice.post("/v1/jobs", json={"labels": [1, 2]}).status_code == 202  # 9 of 10
            r = alice.post("/v1/jobs", json={"labels": [1, 2]})
            assert r.status_code == 429 and "this job of 2 would pass that" in r.json()["error"]["message"]
            assert bob.post("/v1/jobs", json={"labels": [3]}).status_code == 202  # the last place
            assert eve.post("/v1/jobs", json={"labels": [4]}).status_code == 429  # a full queue is full


def test_keys_are_stored_hashed_and_can_be_revoked(svc):
    key_id, key = create_key(svc.store, "dave", name="laptop")
    with svc.store.engine.connect() as conn:
        row = conn.execute(select(api_keys).where(api_keys.c.id == key_id)).one()
    assert key.split("_")[2] not in (row.hash, row.salt) and len(row.hash) == 64
    assert [k["name"] for k in list_keys(svc.store) if k["id"] == key_id] == ["laptop"]
    with _http(svc, key) as dave, _http(svc, None) as anonymous, _http(svc, key[:-1] + "x") as forged:
        assert dave.get("/v1/jobs").status_code == 200
        assert anonymous.get("/v1/jobs").status_code == 401 and forged.get("/v1/jobs").status_code == 401
        assert revoke_key(svc.store, key_id) and not revoke_key(svc.store, key_id)
        time.sleep(2.1)  # the key ring caches answers for 2 s
        r = dave.get("/v1/jobs")
        assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"


def test_stored_keys_alone_make_a_service_need_keys(digits_model, tmp_path, monkeypatch):
    monkeypatch.delenv("DIT_SERVE_API_KEY", raising=False)
    with Service(service_config(tmp_path, digits_model), roles=("api",)) as open_svc:
        with _http(open_svc, None) as anonymous:
            assert anonymous.get("/v1/jobs").status_code == 200  # no key anywhere: open
            _, key = create_key(open_svc.store, "erin")
            time.sleep(2.1)
            assert anonymous.get("/v1/jobs").status_code == 401
        with _http(open_svc, key) as erin:
            assert erin.get("/v1/jobs").status_code == 200


def test_the_key_ring_answers_without_the_store_only_what_it_knows(tmp_path):
    """``answer_now`` (the event loop's check) never reads the store: None whenever only a read can tell
    (keys not yet looked for, a stored key not yet checked or cached too long), the answer otherwise,
    and the same answer ``authenticate`` gives."""
    from dit_serve.server.keys import AuthError, KeyRing
    from dit_serve.server.store import Store

    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    reads: list[int] = []
    real_tx = store._tx
    store._tx = lambda *a, **k: reads.append(1) or real_tx(*a, **k)
    ring = KeyRing(store, [], cache_s=60.0)
    assert ring.answer_now(None) is None and not reads  # whether keys exist: not known without a read
    assert ring.authenticate(None).tenant == "default" and ring.answer_now(None).tenant == "default"
    _, key = create_key(store, "fay")
    ring = KeyRing(store, [], cache_s=60.0)
    ring.required()
    reads.clear()
    assert ring.answer_now(key) is None and not reads  # a stored key not checked yet
    with pytest.raises(AuthError):
        ring.answer_now(None)  # keys needed, none sent: known at once
    assert ring.authenticate(key).tenant == "fay" and reads
    reads.clear()
    assert ring.answer_now(key).tenant == "fay" and not reads  # cached
    with pytest.raises(AuthError):
        ring.authenticate(key[:-1] + "x")
    with pytest.raises(AuthError, match="invalid API key"):
        ring.answer_now(key[:-1] + "x")  # a cached refusal
    assert not reads[1:]
    configured = KeyRing(store, ["cfg-key"], cache_s=60.0)
    assert configured.answer_now("cfg-key").tenant == "default"
    store.close()


def test_the_keys_command(tmp_path, capsys):
    from dit_serve.cli import main

    data = ["--data-dir", str(tmp_path)]
    assert main(["keys", "create", "--tenant", "frank", "--max-priority", "5", *data]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("dsk_") and len(key) > 40
    assert main(["keys", "list", *data]) == 0
    listing = capsys.readouterr().out
    key_id = key.split("_")[1]
    assert key_id in listing and "frank" in listing and "max_priority=5" in listing and key not in listing
    assert main(["keys", "revoke", key_id, *data]) == 0
    assert main(["keys", "list", *data]) == 0 and "revoked" in capsys.readouterr().out
    assert main(["keys", "revoke", key_id, *data]) == 2
    assert main(["keys", "create", "--tenant", "Bad Name", *data]) == 2
    assert "a tenant name is" in capsys.readouterr().err
