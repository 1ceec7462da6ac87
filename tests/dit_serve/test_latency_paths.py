"""What keeps a single image's trip through the service short: accepted HTTP connections without
Nagle's algorithm (else every response waits ~40 ms for the client's delayed ACK), the store's new-work
signal that wakes the scheduler at a submission, and long polls that hand a finished image over at once."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from dit_serve.client import Client
from dit_serve.schemas import JobParams
from dit_serve.service import Service, _bind
from dit_serve.store import Store

from .conftest import service_config


def test_connections_accepted_on_the_service_socket_have_nagle_off():
    """uvicorn serves on the socket ``_bind`` made, through ``loop.create_server(sock=...)``, as here."""
    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    async def main():
        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


def test_the_store_signals_new_work_on_submit_retry_and_release(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/s.db", tmp_path)
    assert not store.work.is_set()
    store.submit("digits", JobParams(sampler="ddim", steps=5, guidance=1.0), [1, 2], [0, 1])
    assert store.work.is_set()
    store.work.clear()
    leases = store.lease("me", ["digits"], 2, 30.0)
    assert len(leases) == 2 and not store.work.is_set()
    store.release(leases[:1], "stop")
    assert store.work.is_set()


@pytest.mark.slow
def test_a_submission_is_leased_and_committed_without_waiting_for_ticks(tmp_path, digits_model):
    """Ticks of 5 s and heartbeats of 20 s: without the new-work signal the job would wait for a tick
    (or an idle worker's 10 s long poll) before it is leased, and without long polls its image would
    wait as long to be committed. With both, a 5-step digit comes back in well under one tick."""
    cfg = service_config(tmp_path, digits_model, scheduler={"tick_seconds": 5.0, "heartbeat_seconds": 20.0},
                         store={"lease_seconds": 60.0})
    with Service(cfg) as svc, Client(svc.url) as client:
        assert svc.wait_ready(120)
        time.sleep(1.0)  # the worker's first long poll is out
        t0 = time.monotonic()
        job = client.wait(client.submit([7], steps=5), progress=False, timeout=60)
        took = time.monotonic() - t0
    assert job.state == "done"
    assert took < 3.0, f"one image took {took:.1f} s: leasing or committing waited for a tick"
