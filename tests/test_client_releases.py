"""A shared-memory load's release rides on the client's next prefetch or reserve
(`kvtier/client/releases.py`), against a real `kvtier serve`: counted by the server's own
per-route metrics and lease table. An idle client's release goes out alone within
`RELEASE_AFTER_S`, `close()` sends what is owed, another tenant's lease id in `release` is
passed over, and a malformed `release` is a 400 naming the field with nothing leased."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import threading
import time
from collections.abc import Iterator, Mapping

import httpx
import pytest
import torch
from service_server import Server, kv_of, running, tokens_of, write_config

from kvtier.client import AsyncClient, Client
from kvtier.client import releases as owed_module
from kvtier.client.lane import AsyncLaneConnections, LaneConnections
from kvtier.errors import LeaseError
from kvtier.results import Lease
from kvtier.service import wire


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    names = ("default", "rides", "idle", "alice", "bob", "carol", "dora")
    config = write_config(tmp_path_factory.mktemp("releases"), tenants={n: {} for n in names})
    with running(config) as live:
        yield live


@pytest.fixture
def held_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """No flush before `close()` within the test: what is released rode on a request."""
    monkeypatch.setattr(owed_module, "RELEASE_AFTER_S", 3600.0)


def releases_sent(server: Server) -> int:
    """`/v1/release` requests the server has answered (its request histogram)."""
    text = httpx.get(server.url + "/metrics").text
    found = re.search(r'^kvtier_request_seconds_count\{route="/v1/release"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def live_leases(server: Server) -> int:
    return int(httpx.get(server.url + "/v1/status").json()["index"]["leases"])


def post(server: Server, path: str, body: Mapping[str, object], tenant: str) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=json.dumps(body),  # JSON: 2**64 has no msgpack form
        headers={"content-type": wire.JSON, "x-kvtier-tenant": tenant},
    )


def stored(client: Client, seed: int, blocks: int = 4) -> tuple[list[int], torch.Tensor]:
    tokens, kv = tokens_of(1000 * seed, 4 * blocks), kv_of(4 * blocks, seed)
    client.store(tokens, kv)
    return tokens, kv


@pytest.mark.usefixtures("held_releases")
def test_a_loads_release_rides_on_the_next_prefetch_or_reserve(server: Server) -> None:
    sent = releases_sent(server)
    with Client(server.url, tenant="rides") as client:
        assert client.pool_buffer("gpu") is not None
        (a, kv_a), (b, kv_b) = stored(client, 1), stored(client, 2)
        base = live_leases(server)
        assert torch.equal(client.load(a).kv, kv_a)
        assert live_leases(server) == base + 1  # owed, not yet sent
        assert torch.equal(client.load(b).kv, kv_b)  # its prefetch carried a's release
        assert live_leases(server) == base + 1
        c, kv_c = stored(client, 3)  # the reserve carried b's
        assert live_leases(server) == base
        assert torch.equal(client.load(c).kv, kv_c)
        assert releases_sent(server) == sent  # not one release of its own so far
    assert live_leases(server) == base  # close() sent c's
    assert releases_sent(server) == sent + 1


def test_an_idle_clients_release_goes_out_alone_soon(server: Server) -> None:
    with Client(server.url, tenant="idle") as client:
        tokens, kv = stored(client, 4)
        base, sent = live_leases(server), releases_sent(server)
        assert torch.equal(client.load(tokens).kv, kv)
        deadline = time.monotonic() + 10  # RELEASE_AFTER_S is 50 ms; a bound, not a figure
        while live_leases(server) != base and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live_leases(server) == base
        assert releases_sent(server) == sent + 1


@pytest.mark.usefixtures("held_releases")
def test_another_tenants_lease_in_release_is_passed_over(server: Server) -> None:
    with Client(server.url, tenant="alice") as alice:
        tokens, kv = stored(alice, 5)
        assert torch.equal(alice.load(tokens).kv, kv)
        [lease_id] = list(alice._owed._owed)  # owed by alice's client, held on the server
        base = live_leases(server)
        body = {"tokens": list(range(8)), "release": [lease_id]}
        assert post(server, "/v1/prefetch", body, "bob").status_code == 200
        held = httpx.get(f"{server.url}/v1/leases/{lease_id}", headers={"x-kvtier-tenant": "alice"})
        assert held.status_code == 200 and held.json()["state"] == "ready"
        assert live_leases(server) >= base  # bob's empty prefetch may hold nothing itself
    assert (
        httpx.get(
            f"{server.url}/v1/leases/{lease_id}", headers={"x-kvtier-tenant": "alice"}
        ).status_code
        == 404
    )  # alice's close() released it


@pytest.mark.parametrize(
    "bad",
    ["1", [-1], [2**64], [1.5], ["1"], [None], list(range(wire.MAX_RELEASES + 1)), {"1": 1}],
    ids=["text", "negative", "too big", "float", "text id", "nil", "too many", "map"],
)
def test_a_malformed_release_is_a_400_naming_it_and_leases_nothing(
    server: Server, bad: object
) -> None:
    with Client(server.url, tenant="carol") as client:
        tokens, _ = stored(client, 6)
    base = live_leases(server)
    for path in ("/v1/prefetch", "/v1/reserve"):
        response = post(server, path, {"tokens": tokens, "release": bad}, "carol")
        assert response.status_code == 400, response.text
        error = response.json()
        kind = "malformed_body" if isinstance(bad, dict) else "invalid_argument"  # not flat
        assert error["error"] == kind and "release" in error["detail"], error
    assert live_leases(server) == base


@pytest.mark.usefixtures("held_releases")
def test_the_async_client_carries_and_closes_the_same_way(server: Server) -> None:
    with Client(server.url, tenant="dora") as client:
        (a, kv_a), (b, kv_b) = stored(client, 7), stored(client, 8)
    sent, base = releases_sent(server), live_leases(server)

    async def run() -> None:
        async with AsyncClient(server.url, tenant="dora") as client:
            assert torch.equal((await client.load(a)).kv, kv_a)
            assert live_leases(server) == base + 1
            assert torch.equal((await client.load(b)).kv, kv_b)
            assert live_leases(server) == base + 1
        assert live_leases(server) == base

    asyncio.run(run())
    assert releases_sent(server) == sent + 1


@pytest.mark.usefixtures("held_releases")
def test_a_client_dropped_without_close_leaves_no_thread_behind(server: Server) -> None:
    """The flusher holds its client weakly: dropped unclosed, it is collected and the thread
    ends (what it owed ends at the lease's ttl on the server)."""

    def flushers() -> int:
        return sum(t.name == "kvtier-client-releases" for t in threading.enumerate())

    before = flushers()
    client = Client(server.url, tenant="idle")
    tokens, kv = stored(client, 9)
    assert torch.equal(client.load(tokens).kv, kv)
    assert flushers() == before + 1
    del client
    gc.collect()
    deadline = time.monotonic() + 10  # it looks at least once a second
    while flushers() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flushers() == before


def check_waited(
    lease: Lease, again: Lease, lane: LaneConnections | AsyncLaneConnections | None, calls: int
) -> None:
    """`again`, a wait's answer for bob's 8-token `lease`, is that lease READY; the wait went
    over `lane` (one call more than `calls`) when the client has one."""
    assert (again.lease_id, again.tenant, again.block_table) == (
        lease.lease_id, "bob", lease.block_table,
    )  # fmt: skip
    assert again.ready() and again.num_tokens == 8
    if lane is not None:
        assert lane.calls == calls + 1


def test_waiting_on_a_lease_asks_as_the_leases_tenant_over_the_lane_and_over_http(
    server: Server,
) -> None:
    """`Client.wait_for` (a lease still pending past the prefetch's own wait) asks as the
    lease's tenant, whatever tenant the client was made for: over the local lane where the
    client reaches it, else with `GET /v1/leases/{id}`; an ended lease is a `LeaseError`."""
    for shared in (True, False):
        with Client(server.url, shared_memory=shared) as client:  # made for "default"
            tokens, kv = tokens_of(7000 + shared, 8), kv_of(8, 7)
            client.store(tokens, kv, tenant="bob")
            lease = client.prefetch(tokens, tenant="bob", wait=False)
            lane = client._lane
            assert (lane is not None) == shared
            calls = lane.calls if lane is not None else 0
            again = client.wait_for(lease, timeout_s=5)
            check_waited(lease, again, lane, calls)
            client.release(again)
            with pytest.raises(LeaseError):
                client.wait_for(again, timeout_s=0)


def test_the_async_client_waits_on_a_lease_as_its_tenant_over_the_lane_and_over_http(
    server: Server,
) -> None:
    """`AsyncClient.wait_for`, as `Client.wait_for`: the lease's tenant, the lane where it is
    reached, a `LeaseError` for an ended lease."""

    async def run(shared: bool) -> None:
        async with AsyncClient(server.url, shared_memory=shared) as client:
            tokens, kv = tokens_of(7100 + shared, 8), kv_of(8, 8)
            await client.store(tokens, kv, tenant="bob")
            lease = await client.prefetch(tokens, tenant="bob", wait=False)
            lane = client._lane
            assert (lane is not None) == shared
            calls = lane.calls if lane is not None else 0
            again = await client.wait_for(lease, timeout_s=5)
            check_waited(lease, again, lane, calls)
            await client.release(again)
            with pytest.raises(LeaseError):
                await client.wait_for(again, timeout_s=0)

    for shared in (True, False):
        asyncio.run(run(shared))
