"""Tenant isolation in a real `kvtier serve`, beyond `test_service_tenants.py` and
`test_lane_audit.py`: tenants `a` and `b`, each with its own key, attack each other through the
API (HTTP and the local lane) and each finding is checked on the live server.

- A refused prefetch or reserve changes nothing: the leases it carried in `release` stay live
  (the store validates every field before it releases them).
- A reservation never lands in a quantized host tier: its canaries, planted as in a pool of
  blocks, fell into other slots of the payload pool, another tenant's blocks among them.
"""

from __future__ import annotations

import gc
import itertools
import struct
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import lane_peer
import msgpack  # type: ignore[import-untyped]
import pytest
import yaml
from service_server import BLOCK_BYTES, BT, MODEL, Server, kv_of, running, tokens_of, write_config

from kvtier.config import parse_config
from kvtier.errors import CapacityError
from kvtier.service import wire
from kvtier.store import KVStore

KEY_A = "audit-tenant-a-key-0123456789"
KEY_B = "audit-tenant-b-key-0123456789"
AUTH_A, AUTH_B = f"Bearer {KEY_A}", f"Bearer {KEY_B}"
TENANTS = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
BASES = itertools.count(10_000, 1000)  # each test's own token ids on the module's server


def packed(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


class Tenant:
    """One tenant over raw HTTP, msgpack both ways; every answer a documented status."""

    def __init__(self, server: Server, key: str) -> None:
        self.http = httpx.Client(
            base_url=server.url,
            timeout=30,
            headers={"authorization": f"Bearer {key}", "content-type": wire.MSGPACK},
        )

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        response = self.http.post(path, content=wire.encode(body, True))
        assert response.status_code < 500, response.text[:300]
        return response.status_code, wire.decode(response.content, wire.MSGPACK)

    def lease_state(self, lease_id: int) -> int:
        return self.http.get(f"/v1/leases/{lease_id}").status_code

    def store(self, tokens: list[int], seed: int) -> None:
        kv = kv_of(len(tokens), seed)
        status, body = self.post("/v1/store", {"tokens": packed(tokens), **wire.kv_to_wire(kv)})
        assert status == 200 and body["stored_tokens"] == len(tokens), body

    def load(self, tokens: list[int]) -> bytes:
        status, body = self.post("/v1/load", {"tokens": packed(tokens)})
        assert status == 200 and body["num_tokens"] == len(tokens), body
        return bytes(body["kv"])

    def close(self) -> None:
        self.http.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("tenant-audit"),
        service={"prefetch_wait_s": 1.0},
        tenants=TENANTS,
    )
    with running(config) as live:
        yield live


# ---- a refused request changes nothing --------------------------------------------------------

REFUSED = [  # fields that make a prefetch or reserve a 400, each checked only by the store
    pytest.param({"ttl_s": 1e9}, id="ttl-past-max"),
    pytest.param({"ttl_s": -1.0}, id="ttl-negative"),
    pytest.param({"tokens": [1, 2, 3, -5]}, id="token-negative"),
    pytest.param({"tokens": [1, 2, 3, 2**40]}, id="token-too-large"),
]


@pytest.mark.parametrize("path", ["/v1/prefetch", "/v1/reserve"])
@pytest.mark.parametrize("bad", REFUSED)
def test_a_refused_prefetch_or_reserve_releases_none_of_its_leases(
    server: Server, path: str, bad: dict[str, Any]
) -> None:
    a = Tenant(server, KEY_A)
    try:
        base = next(BASES)
        tokens = tokens_of(base, 2 * BT)
        a.store(tokens, seed=1)
        status, lease = a.post("/v1/prefetch", {"tokens": packed(tokens)})
        assert status == 200 and lease["num_tokens"] == 2 * BT, lease
        lease_id = lease["lease_id"]
        fresh = packed(tokens_of(base + 500, BT))
        body = {"tokens": fresh, "release": [lease_id], **bad}
        status, refusal = a.post(path, body)
        assert (status, refusal["error"]) in {(400, "invalid_argument"), (400, "invalid_tokens")}
        assert a.lease_state(lease_id) == 200  # still live: the refusal changed nothing
        status, _ = a.post(path, {"tokens": fresh, "release": [lease_id]})
        assert status == 200
        assert a.lease_state(lease_id) == 404  # a good request releases it
    finally:
        a.close()


@pytest.mark.parametrize("path", ["/v1/prefetch", "/v1/reserve"])
def test_over_the_lane_a_refused_request_releases_none_of_its_leases(
    server: Server, path: str
) -> None:
    base = next(BASES)
    tokens = tokens_of(base, 2 * BT)
    owner = Tenant(server, KEY_A)
    owner.store(tokens, seed=2)
    owner.close()
    sock = lane_peer.opened(lane_peer.lane_of(server, AUTH_A))

    def call(lane_path: str, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        body = msgpack.packb(fields, use_bin_type=True)
        lane_peer.send(sock, msgpack.packb([lane_path, AUTH_A, None, body], use_bin_type=True))
        status, reply = lane_peer.read_frame(sock)
        return status, msgpack.unpackb(reply, raw=False)

    try:
        status, lease = call("/v1/prefetch", {"tokens": packed(tokens)})
        assert status == 200 and lease["state"] == "ready", lease
        lease_id = lease["lease_id"]
        fresh = packed(tokens_of(base + 500, BT))
        status, refusal = call(path, {"tokens": fresh, "release": [lease_id], "ttl_s": 1e9})
        assert (status, refusal["error"]) == (400, "invalid_argument"), refusal
        assert "max_ttl_s" in refusal["detail"]
        assert call("/v1/leases", {"lease_id": lease_id})[0] == 200
        assert call(path, {"tokens": fresh, "release": [lease_id]})[0] == 200
        assert call("/v1/leases", {"lease_id": lease_id})[0] == 404
    finally:
        sock.close()


# ---- a quantized host tier ---------------------------------------------------------------------


@pytest.fixture
def int8_server(tmp_path: Path) -> Iterator[Server]:
    """gpu 4 blocks, host int8 (31 payload slots of 2096 bytes in 16 blocks' bytes), write_back,
    an inline mover and no floors: every placement below is deterministic."""
    path = write_config(tmp_path, gpu_blocks=4, host_blocks=16, write="write_back")
    config = yaml.safe_load(path.read_text())
    config["tiers"]["host"]["codec"] = "int8"
    for tier in ("gpu", "host"):
        config["tiers"][tier].update(high_watermark=1.0, low_watermark=1.0)
    config["mover"] = {"background": False}
    no_floor = {"floor": {"gpu": "1B", "host": "1B"}}
    config["tenants"] = {name: {**cfg, **no_floor} for name, cfg in TENANTS.items()}
    path.write_text(yaml.safe_dump(config))
    with running(path) as live:
        yield live


def test_a_reservation_in_a_quantized_host_tier_never_touches_another_tenants_blocks(
    int8_server: Server,
) -> None:
    a, b = Tenant(int8_server, KEY_A), Tenant(int8_server, KEY_B)
    try:
        prefix = tokens_of(5000, 2 * BT)
        a.store(prefix, seed=99)
        b.store(tokens_of(100, 4 * BT), seed=1)  # a's prefix goes down to host (int8)
        status, hit = a.post("/v1/lookup", {"tokens": packed(prefix)})
        assert (status, hit["host_tokens"], hit["gpu_tokens"]) == (200, 2 * BT, 0), hit
        # a reserves 6 blocks below its host-only prefix: before the fix, host payload slots
        # 2..7, with canaries planted at slot * 4096 bytes, i.e. in payload slots 3..15
        first = {"tokens": packed(prefix + tokens_of(7000, 6 * BT))}
        status, reservation = a.post("/v1/reserve", first)
        assert status == 200, reservation
        prompts = [tokens_of(1000 + 100 * i, 2 * BT) for i in range(6)]
        for i, toks in enumerate(prompts):  # b's blocks: host payload slots 8 and on
            b.store(toks, seed=10 + i)
        before = [b.load(toks) for toks in prompts]
        if reservation["reservation_id"]:
            assert a.post("/v1/abort", {"reservation_id": reservation["reservation_id"]})[0] == 200
        # reserved again: before the fix, the slot last freed (7), its canary in 13..15: b's
        status, again = a.post("/v1/reserve", {"tokens": packed(prefix + tokens_of(8000, BT))})
        assert status == 200, again
        assert [b.load(toks) for toks in prompts] == before  # b's KV, to the byte
        # a quantized host tier holds payloads no writer can write: nothing is reserved there
        assert (reservation["num_tokens"], again["num_tokens"]) == (0, 0)
        assert int8_server.admin("/v1/admin/check").json()["ok"] is True
    finally:
        a.close()
        b.close()


# ---- what a tenant's calls leave behind --------------------------------------------------------


def test_leases_and_reservations_ended_early_leave_no_memory_behind() -> None:
    """A tenant that leases and releases (or reserves and aborts) in a loop, with the longest
    ttl, left an expiry entry per call in the store for up to `policy.max_ttl_s` (600 s): memory
    that grew with its rate of calls, beyond any quota. Measured on a real store: the memory
    that 3,000 lease round trips and 1,500 reservation round trips leave allocated."""
    config = parse_config(
        {
            "model": MODEL,
            "block_tokens": BT,
            "tiers": {
                "gpu": {"capacity": 64 * BLOCK_BYTES, "device": "cpu"},
                "host": {"capacity": 128 * BLOCK_BYTES, "pinned": False},
            },
            "mover": {"background": False},
            "tenants": {"a": {}, "b": {}},
        }
    )
    with KVStore(config) as store:
        prefix, extension = tokens_of(100, BT), tokens_of(1000, BT)
        store.store(prefix, kv_of(BT, seed=3), tenant="a")

        def lease_round_trips(n: int) -> None:
            for _ in range(n):
                store.release(store.prefetch(prefix, tenant="a", ttl_s=600.0))

        def reservation_round_trips(n: int) -> None:
            for _ in range(n):
                store.abort(store.reserve(extension, tenant="a", ttl_s=600.0))

        for round_trips, count in ((lease_round_trips, 3000), (reservation_round_trips, 1500)):
            round_trips(count)  # warm: caches and free lists at their steady size
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                round_trips(count)
                gc.collect()
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            assert grown < 160 * 1024, (round_trips.__name__, grown)  # 3000 leases: 465 KiB
        assert store.leases() == [] and len(store.reservations) == 0
        store.check()


# ---- what a refusal tells ----------------------------------------------------------------------


def test_a_prefetch_refused_for_room_tells_nothing_of_another_tenants_use() -> None:
    """a's prefetch that cannot get gpu room named how many gpu slots could be freed: a figure
    that moved with b's reservations (b at its floor in blocks, plus reserved slots). Now a's
    refusal reads the same whatever b holds. (b's blocks are leased: since a tenant's
    reservations come off its floor, b's cached blocks past the floor left would give way.)"""
    config = parse_config(
        {
            "model": MODEL,
            "block_tokens": BT,
            "tiers": {  # a: a quota of 4 gpu blocks, no floor; b: a floor of 4, any gpu quota
                "gpu": {"capacity": 8 * BLOCK_BYTES, "device": "cpu"},
                "host": {"capacity": 16 * BLOCK_BYTES, "pinned": False},
            },
            "mover": {"background": False},
            "tenants": {"a": {"floor": {"gpu": "1B"}}, "b": {"quota": {"gpu": 1.0}}},
        }
    )
    refusals = []
    for b_reserves in (4, 3):
        with KVStore(config) as store:
            prefix = tokens_of(100, 2 * BT)
            store.store(prefix, kv_of(2 * BT, seed=4), tenant="a")
            assert store.evict("gpu", 8) == 2  # the operator's: a's prefix is on host only
            store.store(tokens_of(500, 4 * BT), kv_of(4 * BT, seed=5), tenant="b")  # b's floor
            assert store.prefetch(tokens_of(500, 4 * BT), tenant="b").ready()  # locked
            reservation = store.reserve(tokens_of(900, b_reserves * BT), tenant="b")
            assert (reservation.tier, len(reservation.slots)) == ("gpu", b_reserves)
            with pytest.raises(CapacityError) as refused:
                store.prefetch(prefix, tenant="a")
            refusals.append(str(refused.value))
            store.check()
    assert refusals[0] == refusals[1], refusals
