"""Tenants who do not trust each other on one sidecar (`kvtier serve` with a key per tenant): what
one tenant does or learns through the service's shared parts, found by an outside audit.

- `/v1/blocks` (a router's resync): a tenant at its in-flight share, its own snapshots waiting
  for room, does not hold back another tenant's snapshot (`service/snapshots.py`: the lock that
  builds them one at a time is never held while a call waits for its budget). Before, alice's
  resync took body_timeout_s behind mallory's (0.04 s -> 19 s in the audit's run).
- a 503 `busy` names a tenant's own held bytes and share only, as its /v1/status does; before,
  it named the bytes all tenants held, and so what the others held (`service/budget.py`).
- a load asked for in JSON (whose reply, KV bytes, JSON cannot carry) is refused 400 before it
  runs: no counter moves; before, the whole load ran and was refused as its reply was encoded.
- an admin clear naming a tenant the configuration does not list is 404 `unknown_tenant`
  naming the value; a caller whose own tenant is unknown (without auth, `x-kvtier-tenant`)
  stays 403 `unknown_tenant`. Before, both were 403.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack  # type: ignore[import-untyped]
import pytest
import yaml
from service_server import (
    ADMIN_KEY,
    Server,
    free_port,
    kv_of,
    running,
    tokens_of,
    write_config,
)

from kvtier.client import Client
from kvtier.service.budget import Budget
from kvtier.service.wire import WireError

MIB = 1 << 20
KEYS = {
    "alice": "isolation-alice-0123456789ab",
    "mallory": "isolation-mallory-0123456789",
    "bob": "isolation-bob-0123456789abcd",
}
TIMEOUT_S = 3.0  # service.body_timeout_s: how long a held share waits, then is refused


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Server]:
    """Three tenants, a 3 MiB budget (a share of 1 MiB each, one body's most), KV events on."""
    service = {"max_body_bytes": MIB, "max_inflight_bytes": 3 * MIB, "body_timeout_s": TIMEOUT_S}
    tenants = {name: {"api_keys": [key]} for name, key in KEYS.items()}
    config = write_config(tmp_path, service=service, tenants=tenants)
    document = yaml.safe_load(config.read_text())
    document["events"] = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "per_tenant_topic": True}
    config.write_text(yaml.safe_dump(document))
    with running(config) as server:
        yield server


def headers(tenant: str, msgpack_body: bool = True) -> dict[str, str]:
    kind = "application/msgpack" if msgpack_body else "application/json"
    return {"authorization": f"Bearer {KEYS[tenant]}", "content-type": kind, "accept": kind}


def unsent_store(server: Server, tenant: str, length: int | None = None) -> socket.socket:
    """A /v1/store whose body never comes: chunked (`length` None), it is held in the budget
    for `max_body_bytes`, its tenant's whole share; else for `length`. Refused 408 after
    body_timeout_s, when the budget gets it back."""
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    size = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
    sock.sendall(
        f"POST /v1/store HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {KEYS[tenant]}\r\n"
        f"content-type: application/msgpack\r\n{size}\r\n\r\n".encode()
    )
    return sock


def resync(server: Server, tenant: str, out: list[tuple[str, int, float]]) -> None:
    started = time.monotonic()
    response = httpx.get(server.url + "/v1/blocks", headers=headers(tenant), timeout=60)
    out.append((tenant, response.status_code, time.monotonic() - started))


def test_a_tenant_at_its_share_does_not_delay_another_tenants_resync(shared: Server) -> None:
    with Client(shared.url, api_key=KEYS["alice"], shared_memory=False) as alice:
        alice.store(tokens_of(100, 16), kv_of(16, seed=1))
    out: list[tuple[str, int, float]] = []
    resync(shared, "alice", out)
    assert out[0][1] == 200
    stall = unsent_store(shared, "mallory")  # mallory's whole share, for body_timeout_s
    try:
        time.sleep(0.3)
        waiting = [threading.Thread(target=resync, args=(shared, "mallory", out)) for _ in range(3)]
        for thread in waiting:  # mallory's snapshots, each waiting for her own share
            thread.start()
            time.sleep(0.05)
        time.sleep(0.3)
        resync(shared, "alice", out)
        for thread in waiting:
            thread.join(60)
    finally:
        stall.close()
    _, status, took = [o for o in out if o[0] == "alice"][1]
    assert status == 200
    assert took < 1.5, out  # before: behind mallory's wait for her share, about body_timeout_s
    mallory = [o for o in out if o[0] == "mallory"]
    assert len(mallory) == 3 and all(status in (200, 503) for _, status, _ in mallory), out
    assert shared.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}


def test_a_resync_asked_for_in_json_is_refused_before_it_runs(shared: Server) -> None:
    refused = httpx.get(shared.url + "/v1/blocks", headers=headers("alice", False), timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"] == "invalid_argument"
    assert "application/msgpack" in refused.json()["detail"]


def small_lookup(server: Server, tenant: str) -> httpx.Response:
    lookup = b'{"tokens": [1, 2, 3, 4]}'
    url = server.url + "/v1/lookup"
    return httpx.post(url, headers=headers(tenant, False), content=lookup, timeout=60)


def test_a_busy_refusal_names_only_the_tenants_own_bytes(shared: Server) -> None:
    """mallory at her share (one unsent body, a second queued behind it to take its place) and
    alice holding 700000 bytes: mallory's next call is refused 503 busy, its detail naming her
    own 1 MiB and share, not the 1748576 bytes held in all nor the 3 MiB total."""
    held = [unsent_store(shared, "mallory")]
    try:
        time.sleep(0.3)
        held.append(unsent_store(shared, "mallory"))  # granted when the first is refused 408
        time.sleep(0.3)
        started = time.monotonic()
        result: list[httpx.Response] = []
        lookup = threading.Thread(target=lambda: result.append(small_lookup(shared, "mallory")))
        lookup.start()
        time.sleep(0.9)
        held.append(unsent_store(shared, "alice", 700_000))  # held past mallory's refusal
        lookup.join(60)
    finally:
        for sock in held:
            sock.close()
    response = result[0]
    assert response.status_code == 503 and response.json()["error"] == "busy", response.text
    assert time.monotonic() - started >= TIMEOUT_S - 0.2
    detail = response.json()["detail"]
    assert f"{MIB} of its share of {MIB}" in detail, detail
    for other in (700_000, MIB + 700_000, 2 * MIB, 3 * MIB):  # alice's, all held, the total
        assert str(other) not in detail, detail
    own = httpx.get(shared.url + "/v1/status", headers=headers("mallory", False), timeout=30)
    assert set(own.json()["inflight"]) == {"held_bytes", "limit_bytes"}  # the same figures


def test_a_busy_refusal_names_the_global_figures_without_tenant_keys() -> None:
    """`own` False (the admin key's or a server without auth): the global figures, as its
    /v1/status shows them; `own` True: the tenant's only."""

    async def refused(own: bool) -> str:
        budget = Budget(total=3 * MIB, share=MIB)
        await budget.hold("alice").take(700_000, time.monotonic() + 1)
        await budget.hold("mallory").take(MIB, time.monotonic() + 1)
        with pytest.raises(WireError) as busy:
            await budget.hold("mallory", own).take(10, time.monotonic() + 0.05)
        assert (busy.value.status, busy.value.kind) == (503, "busy")
        budget.check()
        return busy.value.detail

    mine = asyncio.run(refused(own=True))
    assert mine.endswith(f"this tenant holds {MIB} of its share of {MIB} bytes"), mine
    assert str(MIB + 700_000) not in mine and str(3 * MIB) not in mine
    everyone = asyncio.run(refused(own=False))
    assert f"{MIB + 700_000} of {3 * MIB} held" in everyone, everyone


def counters(server: Server, tenant: str) -> dict[str, Any]:
    figures = httpx.get(server.url + "/v1/status", headers=headers(tenant, False), timeout=30)
    status = figures.json()
    reads = {name: tier["hits"] for name, tier in status["tiers"].items()}
    return {"ops": status["ops"], "reads": reads, "inflight": status["inflight"]}


def test_a_load_asked_for_in_json_is_refused_before_it_runs(shared: Server) -> None:
    tokens = tokens_of(300, 32)
    with Client(shared.url, api_key=KEYS["alice"], shared_memory=False) as alice:
        alice.store(tokens, kv_of(32, seed=2))
    before = counters(shared, "alice")
    refusal = {
        "error": "invalid_argument",
        "detail": "the response carries KV bytes, which JSON cannot: send the request as "
        "application/msgpack",
    }  # the 400 it always was
    for _ in range(3):
        refused = httpx.post(shared.url + "/v1/load", headers=headers("alice", False),
                             json={"tokens": tokens}, timeout=30)  # fmt: skip
        assert (refused.status_code, refused.json()) == (400, refusal)
    assert counters(shared, "alice") == before  # no load ran: no op, no hit, nothing held
    unread = httpx.post(shared.url + "/v1/load", headers=headers("alice", False),
                        content=b"{not json", timeout=30)  # fmt: skip
    assert (unread.status_code, unread.json()) == (400, refusal)  # refused before the body
    loaded = httpx.post(shared.url + "/v1/load", headers=headers("alice"),
                        content=msgpack.packb({"tokens": tokens}), timeout=30)  # fmt: skip
    assert loaded.status_code == 200 and msgpack.unpackb(loaded.content)["num_tokens"] == 32
    assert counters(shared, "alice")["ops"] != before["ops"]  # a load that runs is counted


def test_an_admin_clear_of_an_unknown_tenant_is_404_naming_it(shared: Server) -> None:
    with Client(shared.url, api_key=KEYS["alice"], shared_memory=False) as alice:
        alice.store(tokens_of(400, 16), kv_of(16, seed=3))
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        for name in ("nobody", "", "x" * 10_000):
            refused = shared.post("/v1/admin/clear", headers=admin, params={"tenant": name})
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"] == "unknown_tenant"
            detail = refused.json()["detail"]
            assert repr(name[:64]) in detail and "'alice', 'bob', 'mallory'" in detail
            assert len(detail) < 400
        assert alice.lookup(tokens_of(400, 16)).num_tokens == 16  # nothing was cleared
        not_admin = shared.post("/v1/admin/clear", headers=headers("alice", False),
                                params={"tenant": "nobody"})  # fmt: skip
        assert (not_admin.status_code, not_admin.json()["error"]) == (403, "forbidden")
        cleared = shared.post("/v1/admin/clear", headers=admin, params={"tenant": "alice"})
        assert cleared.json() == {"dropped_blocks": 4}


def test_a_caller_whose_own_tenant_is_unknown_stays_403(tmp_path: Path) -> None:
    """Without auth the caller names its tenant (`x-kvtier-tenant`): an unknown one is who the
    caller is, refused 403 `unknown_tenant` as an unknown key is."""
    config = write_config(tmp_path, tenants={"alice": {}, "bob": {}})
    with running(config) as server:
        response = server.post("/v1/lookup", content=b'{"tokens": [1, 2, 3, 4]}',
                               headers={"content-type": "application/json",
                                        "x-kvtier-tenant": "zed"})  # fmt: skip
        assert response.status_code == 403
        assert response.json()["error"] == "unknown_tenant"
        assert "'zed'" in response.json()["detail"]
