"""The sidecar as a real process (`kvtier serve`), driven through its clients and raw HTTP.

One server serves most scenarios here (each keeps to its own token ids); tenants with keys,
restarts and SIGTERM under load get servers of their own. The layout is tiny (fp16, 4 tokens
and 4096 bytes a block, `service_server.py`); gpu holds 64 blocks and host 128, both in
/dev/shm, so a `Client` on this host reads and writes the pools directly.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
import torch
from conftest import same
from prometheus_client.parser import text_string_to_metric_families
from service_server import (
    ADMIN_KEY,
    BLOCK_BYTES,
    BT,
    Server,
    free_port,
    kv_of,
    running,
    serve_command,
    start,
    tokens_of,
    write_config,
)

from kvtier.blocks import Tokens, from_blocks, to_blocks
from kvtier.client import AsyncClient, Client, ServiceError, TransportError
from kvtier.client.pages import store_body
from kvtier.errors import InvalidArgumentError, InvalidKVError, InvalidTokensError, LeaseError
from kvtier.results import Lease, LeaseState, LookupResult, StoreResult

MAX_TOKENS = 64
MAX_BODY = 64 * 1024
PEER = Path(__file__).with_name("service_peer.py")
KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-9876543210"
JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": "application/msgpack"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No auth (every call is tenant `default`), the admin key, small request limits."""
    config = write_config(
        tmp_path_factory.mktemp("service"),
        service={"max_tokens": MAX_TOKENS, "max_body_bytes": MAX_BODY},
    )
    with running(config) as live:
        yield live


def route_counts(server: Server) -> dict[str, float]:
    """Requests answered so far, by route (`kvtier_request_seconds_count`)."""
    return {
        labels["route"]: value
        for name, labels, value in samples(server)
        if name == "kvtier_request_seconds_count"
    }


def samples(server: Server) -> list[tuple[str, dict[str, str], float]]:
    response = server.get("/metrics")
    assert response.status_code == 200
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    ]


def leased_kv(client: Client, lease: Lease) -> torch.Tensor:
    """What the gpu slots of `lease` hold, read from the pool mapped in this process."""
    pool = client.pool_buffer("gpu")
    assert pool is not None
    return from_blocks(pool[list(lease.block_table)])


# ---- round trips --------------------------------------------------------------------------------


def test_store_and_load_through_shared_memory_send_no_kv_over_the_socket(server: Server) -> None:
    tokens, kv = tokens_of(1000, 32), kv_of(32, seed=1)
    with Client(server.url) as client:
        assert client.pool_buffer("gpu") is not None and client.pool_buffer("host") is not None
        before = route_counts(server)
        assert client.store(tokens, kv) == StoreResult(32, 32, 0)
        assert client.lookup(tokens) == LookupResult(32, 32, 0, 0)
        lease = client.prefetch(tokens)
        assert (lease.state, lease.num_tokens, len(lease.block_table)) == (LeaseState.READY, 32, 8)
        assert same(leased_kv(client, lease), kv)
        client.release(lease)
        loaded = client.load([*tokens, *tokens_of(9000, 8)])  # only the cached prefix comes back
        assert loaded.num_tokens == 32 and same(loaded.kv, kv)
    after = route_counts(server)
    assert after.get("/v1/store", 0) == before.get("/v1/store", 0)  # reserve + write + commit
    assert after.get("/v1/load", 0) == before.get("/v1/load", 0)  # prefetch + read + release
    assert after["/v1/reserve"] == before.get("/v1/reserve", 0) + 1
    assert after["/v1/commit"] == before.get("/v1/commit", 0) + 1


@pytest.mark.parametrize(
    "bad",
    [
        np.array([5, 2**32 + 5], dtype=np.int64),  # would wrap to token 5 as uint32
        np.array([5, -1], dtype=np.int64),
        torch.tensor([7, 2**33]),
        [5, 2**32],
    ],
    ids=["int64 past 2**32", "negative", "tensor", "list"],
)
def test_the_client_refuses_token_ids_out_of_range_before_sending(
    server: Server, bad: Tokens
) -> None:
    """As the in-process store does: a typed error naming the id; never a wrapped id that
    would name another prompt's blocks."""
    with Client(server.url) as client:
        before = route_counts(server)
        for call in (client.lookup, client.prefetch, client.load):
            with pytest.raises(InvalidTokensError, match=r"tokens\[1\]: got -?\d+"):
                call(bad)
        with pytest.raises(InvalidTokensError):
            client.store(bad, kv_of(2, seed=4))
    after = route_counts(server)
    for route in ("/v1/lookup", "/v1/prefetch", "/v1/load", "/v1/reserve", "/v1/store"):
        assert after.get(route, 0) == before.get(route, 0), route


def test_kv_stored_through_the_body_loads_through_shared_memory_and_back(server: Server) -> None:
    a, kv_a = tokens_of(2000, 24), kv_of(24, seed=2)
    b, kv_b = tokens_of(2100, 16), kv_of(16, seed=3)
    with Client(server.url, shared_memory=False) as body, Client(server.url) as shared:
        assert body.pool_buffer("gpu") is None
        before = route_counts(server)
        assert body.store(a, kv_a) == StoreResult(24, 24, 0)
        assert same(shared.load(a).kv, kv_a)
        assert shared.store(b, kv_b) == StoreResult(16, 16, 0)
        assert body.lookup(b) == LookupResult(16, 16, 0, 0)
        assert same(body.load(b).kv, kv_b)
    after = route_counts(server)
    assert after["/v1/store"] == before.get("/v1/store", 0) + 1
    assert after["/v1/load"] == before.get("/v1/load", 0) + 1


def test_the_async_client_round_trips_bit_exact_both_ways(server: Server) -> None:
    tokens, kv = tokens_of(3000, 20), kv_of(20, seed=4)

    async def scenario() -> None:
        async with AsyncClient(server.url) as client:
            assert await client.store(tokens, kv) == StoreResult(20, 20, 0)
            assert await client.lookup(tokens) == LookupResult(20, 20, 0, 0)
            lease = await client.prefetch(tokens)
            assert (lease.state, lease.num_tokens) == (LeaseState.READY, 20)
            await client.release(lease)
            with pytest.raises(LeaseError):
                await client.release(lease)  # released already
            loaded = await client.load(tokens)
            assert loaded.num_tokens == 20 and same(loaded.kv, kv)
        async with AsyncClient(server.url, shared_memory=False) as body:
            assert same((await body.load(tokens)).kv, kv)

    asyncio.run(scenario())


@pytest.mark.parametrize("shared_memory", [True, False])
def test_the_clients_load_into_a_callers_out_and_store_pages_in_both_paths(
    server: Server, shared_memory: bool
) -> None:
    base = 11000 if shared_memory else 12000
    tokens, kv = tokens_of(base, 24), kv_of(24, seed=11)
    pages = to_blocks(kv, BT).contiguous()
    with Client(server.url, shared_memory=shared_memory) as client:
        assert (client.pool_buffer("gpu") is not None) == shared_memory
        before = route_counts(server)
        # pages and a last, partly filled one: the full blocks are stored, the rest not
        partial = torch.cat([pages, torch.zeros_like(pages[:1])])
        assert client.store([*tokens, 1, 2], partial, layout="blocks") == StoreResult(24, 24, 0)
        prompt = [*tokens, *tokens_of(base + 100, 6)]  # one more full block, not cached
        out = torch.full((2, 2, 30, 2, 64), 7.0, dtype=torch.float16)
        loaded = client.load(prompt, out=out)
        assert loaded.num_tokens == 24 and loaded.kv.data_ptr() == out.data_ptr()
        assert same(out[:, :, :24], kv) and bool((out[:, :, 24:] == 7).all())
        into = torch.full((7, *pages.shape[1:]), 7.0, dtype=torch.float16)
        loaded = client.load(prompt, out=into, layout="blocks")
        assert same(loaded.kv, pages) and bool((into[6:] == 7).all())
        assert same(client.load(prompt, layout="blocks").kv, pages)  # a new tensor of pages
        with pytest.raises(InvalidKVError, match="out: got shape"):
            client.load(prompt, out=torch.zeros((2, 2, 20, 2, 64), dtype=torch.float16))
        assert client.layout().block_shape == (2, 2, BT, 2, 64)
    after = route_counts(server)
    body_loads = after.get("/v1/load", 0) - before.get("/v1/load", 0)
    assert body_loads == (0 if shared_memory else 3)  # the refused out asked nothing
    # the layout is asked once: when the pools were mapped, or at the first page or `out`
    assert after.get("/v1/pools", 0) == before.get("/v1/pools", 0) + (0 if shared_memory else 1)

    async def scenario() -> None:
        async with AsyncClient(server.url, shared_memory=shared_memory) as client:
            assert (await client.layout()).block_tokens == BT
            pages_out = torch.zeros((6, *pages.shape[1:]), dtype=torch.float16)
            loaded = await client.load(tokens, out=pages_out, layout="blocks")
            assert loaded.num_tokens == 24 and same(pages_out, pages)
            other = tokens_of(base + 200, 8)
            assert (await client.store(other, pages[:2], layout="blocks")).stored_tokens == 8
            assert same((await client.load(other)).kv, kv[:, :, :8])

    asyncio.run(scenario())


@pytest.mark.parametrize("shared_memory", [True, False])
def test_the_clients_load_from_start_only_the_tail_in_both_paths(
    server: Server, shared_memory: bool
) -> None:
    """`load(start=)`: the tail of the cached prefix, whether copied out of the mapped pools
    or sent in the body; a start off a block boundary refused before anything is asked."""
    base = 13000 if shared_memory else 14000
    tokens, kv = tokens_of(base, 24), kv_of(24, seed=12)
    prompt = [*tokens, *tokens_of(base + 100, 6)]  # one more full block, not cached
    with Client(server.url, shared_memory=shared_memory) as client:
        assert client.store(tokens, kv).stored_tokens == 24
        for at in (0, 8, 24, 28):
            got = client.load(prompt, start=at)
            assert got.num_tokens == 24 and same(got.kv, kv[:, :, at:24]), at
        out = torch.full((2, 2, 30 - 8, 2, 64), 7.0, dtype=torch.float16)  # the tail's room
        assert same(client.load(prompt, start=8, out=out).kv, kv[:, :, 8:24])
        assert bool((out[:, :, 16:] == 7).all())
        pages = client.load(prompt, start=4, layout="blocks").kv
        assert same(pages, to_blocks(kv, BT)[1:])
        before = route_counts(server)
        with pytest.raises(InvalidArgumentError, match="start: got 3"):
            client.load(prompt, start=3)
        after = route_counts(server)  # (an owed release may go out meanwhile: not counted)
        for route in ("/v1/load", "/v1/prefetch", "/v1/lookup"):
            assert after.get(route, 0) == before.get(route, 0), route

    async def scenario() -> None:
        async with AsyncClient(server.url, shared_memory=shared_memory) as client:
            got = await client.load(prompt, start=12)
            assert got.num_tokens == 24 and same(got.kv, kv[:, :, 12:24])

    asyncio.run(scenario())


def test_a_load_from_start_sends_only_the_tail_and_a_bad_start_is_a_400(server: Server) -> None:
    tokens = tokens_of(15000, 16)
    with Client(server.url, shared_memory=False) as client:
        assert client.store(tokens, kv_of(16, seed=13)).stored_tokens == 16
    packed = torch.tensor(tokens, dtype=torch.int32).numpy().tobytes()
    reply = server.post(
        "/v1/load", content=msgpack.packb({"tokens": packed, "start": 8}), headers=MSGPACK
    )
    body = msgpack.unpackb(reply.content)
    assert reply.status_code == 200 and body["num_tokens"] == 16
    assert body["shape"] == [2, 2, 8, 2, 64] and len(body["kv"]) == 2 * 2 * 8 * 2 * 64 * 2
    for bad in (3, -4, 20, "8", 8.0):
        reply = server.post(
            "/v1/load", content=msgpack.packb({"tokens": packed, "start": bad}), headers=MSGPACK
        )
        assert reply.status_code == 400, (bad, reply.text)
        body = msgpack.unpackb(reply.content)
        assert body["error"] == "invalid_argument" and "start" in body["detail"]


def test_a_reservation_is_invisible_until_committed_and_an_abort_leaves_nothing(
    server: Server,
) -> None:
    full, kv = tokens_of(4000, 24), kv_of(24, seed=5)
    with Client(server.url) as client:
        assert client.store(full[:16], kv[:, :, :16]) == StoreResult(16, 16, 0)
        reservation = client.reserve(full)
        cached, new, tier = reservation.cached_tokens, reservation.num_tokens, reservation.tier
        assert (cached, new, tier, len(reservation.slots)) == (16, 8, "gpu", 2)
        assert client.lookup(full) == LookupResult(16, 16, 0, 0)  # the new blocks: not yet
        pool = client.pool_buffer("gpu")
        assert pool is not None
        pool[list(reservation.slots)] = to_blocks(kv[:, :, 16:], BT)
        assert client.commit(reservation) == StoreResult(24, 8, 0)
        assert same(client.load(full).kv, kv)
        with pytest.raises(LeaseError):
            client.commit(reservation)  # committed already
        assert client.reserve(full).num_tokens == 0  # all cached: nothing to reserve

        other = tokens_of(4100, 8)
        aborted = client.reserve(other)
        assert aborted.num_tokens == 8
        client.abort(aborted)
        assert client.lookup(other) == LookupResult(0, 0, 0, 0)
        with pytest.raises(LeaseError):
            client.abort(aborted)
    assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}


def test_leases_of_two_sequences_share_the_slots_of_their_common_prefix(server: Server) -> None:
    common = tokens_of(5000, 8)
    a, b = [*common, *tokens_of(5100, 8)], [*common, *tokens_of(5200, 12)]
    kv_a, kv_b = kv_of(16, seed=6), kv_of(20, seed=7)
    kv_b[:, :, :8] = kv_a[:, :, :8]  # the KV of a prefix depends on the prefix only
    with Client(server.url) as client:
        assert client.store(a, kv_a) == StoreResult(16, 16, 0)
        assert client.store(b, kv_b) == StoreResult(20, 12, 0)
        lease_a, lease_b = client.prefetch(a), client.prefetch(b)
        assert lease_a.block_table[:2] == lease_b.block_table[:2]
        assert len({*lease_a.block_table, *lease_b.block_table}) == 2 + 2 + 3
        assert same(leased_kv(client, lease_a), kv_a)
        assert same(leased_kv(client, lease_b), kv_b)
        client.release(lease_a)
        client.release(lease_b)


def test_a_second_process_shares_the_pools_in_both_directions(server: Server) -> None:
    ours, theirs = tokens_of(6000, 32), tokens_of(6100, 32)
    with Client(server.url) as client:
        assert client.store(ours, kv_of(32, seed=60)) == StoreResult(32, 32, 0)
        before = route_counts(server)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PEER.parent), *sys.path]))
        done = subprocess.run(
            [sys.executable, str(PEER), server.url, "6000", "60", "6100", "61", "32"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {
            "mapped": True,
            "loaded_tokens": 32,
            "loaded_same": True,
            "stored": [32, 32, 0, 0],
        }
        loaded = client.load(theirs)
        assert loaded.num_tokens == 32 and same(loaded.kv, kv_of(32, seed=61))
    after = route_counts(server)
    assert after.get("/v1/store", 0) == before.get("/v1/store", 0)
    assert after.get("/v1/load", 0) == before.get("/v1/load", 0)


# ---- bad input ----------------------------------------------------------------------------------


def _kv_body(tokens: list[int], dtype: str, shape: list[int], nbytes: int) -> bytes:
    packed = msgpack.packb(
        {
            "tokens": torch.tensor(tokens, dtype=torch.int32).numpy().tobytes(),
            "kv": bytes(nbytes),
            "dtype": dtype,
            "shape": shape,
        },
        use_bin_type=True,
    )
    assert isinstance(packed, bytes)
    return packed


TENANT_Z = {**JSON, "x-kvtier-tenant": "z"}
TOKENS_65 = json.dumps({"tokens": list(range(65))}).encode()
KV_INT8 = _kv_body([1, 2, 3, 4], "int8", [2, 2, 4, 2, 64], 2048)
KV_FLOAT32 = _kv_body([1, 2, 3, 4], "float32", [2, 2, 4, 2, 64], 8192)  # the layout's shape
KV_3_TOKENS = _kv_body([1, 2, 3, 4], "float16", [2, 2, 3, 2, 64], 3072)
KV_SHORT = _kv_body([1, 2, 3, 4], "float16", [2, 2, 4, 2, 64], 100)  # bytes short of the shape
BAD_REQUESTS: list[tuple[str, str, bytes, dict[str, str], int, str]] = [
    ("not JSON", "/v1/lookup", b"{tokens", JSON, 400, "malformed_body"),
    ("not msgpack", "/v1/lookup", b"\xc1", MSGPACK, 400, "malformed_body"),
    ("not a map", "/v1/lookup", b"[1, 2]", JSON, 400, "malformed_body"),
    ("tokens a string", "/v1/lookup", b'{"tokens": "abc"}', JSON, 400, "invalid_tokens"),
    ("a negative token", "/v1/lookup", b'{"tokens": [-1]}', JSON, 400, "invalid_tokens"),
    ("a load in JSON", "/v1/load", b'{"tokens": [1, 2, 3, 4]}', JSON, 400, "invalid_argument"),
    ("no lease id", "/v1/release", b"{}", JSON, 400, "invalid_argument"),
    ("unknown lease", "/v1/release", b'{"lease_id": 7}', JSON, 404, "unknown_lease"),
    ("unknown reservation", "/v1/commit", b'{"reservation_id": 7}', JSON, 404, "unknown_lease"),
    ("unknown tenant", "/v1/lookup", b'{"tokens": [1]}', TENANT_Z, 403, "unknown_tenant"),
    ("65 tokens", "/v1/lookup", TOKENS_65, JSON, 413, "too_many_tokens"),
    ("body too large", "/v1/lookup", b" " * (MAX_BODY + 1), JSON, 413, "body_too_large"),
    ("dtype int8", "/v1/store", KV_INT8, MSGPACK, 422, "invalid_kv"),
    ("float32 kv", "/v1/store", KV_FLOAT32, MSGPACK, 422, "invalid_kv"),
    ("kv of 3 tokens", "/v1/store", KV_3_TOKENS, MSGPACK, 422, "invalid_kv"),
    ("kv bytes short", "/v1/store", KV_SHORT, MSGPACK, 400, "invalid_kv"),
]


@pytest.mark.parametrize(
    ("path", "content", "headers", "status", "kind"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_a_bad_request_is_refused_with_its_status_and_an_error_body(
    server: Server, path: str, content: bytes, headers: dict[str, str], status: int, kind: str
) -> None:
    response = server.post(path, content=content, headers=headers)
    assert response.status_code == status, response.text
    if headers["content-type"] == "application/json":
        assert response.headers["content-type"] == "application/json"
        body = response.json()
    else:
        assert response.headers["content-type"] == "application/msgpack"
        body = msgpack.unpackb(response.content)
    assert set(body) == {"error", "detail"} and body["error"] == kind and body["detail"]


def test_a_body_streamed_without_a_length_is_measured_as_it_is_read(server: Server) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY // 1024 + 1):
            yield b" " * 1024

    response = server.post("/v1/lookup", content=chunks(), headers=JSON)
    assert "content-length" not in response.request.headers
    assert response.status_code == 413 and response.json()["error"] == "body_too_large"


def test_the_clients_raise_typed_errors_for_what_the_server_refuses(server: Server) -> None:
    with Client(server.url, shared_memory=False) as body, Client(server.url) as shared:
        whole = store_body(tokens_of(7000, 64), kv_of(64, seed=70), 0, "layers", 0)
        with pytest.raises(ServiceError) as too_large:  # 64 KiB of KV, and the tokens
            body._post("/v1/store", whole)  # as one request: what `store` no longer sends
        assert (too_large.value.status, too_large.value.kind) == (413, "body_too_large")
        assert body.store(tokens_of(8800, 64), kv_of(64, seed=70)).stored_tokens == 64  # pieces
        with pytest.raises(ServiceError) as too_many:
            shared.lookup(tokens_of(7000, MAX_TOKENS + 1))
        assert (too_many.value.status, too_many.value.kind) == (413, "too_many_tokens")
        assert shared.lookup(tokens_of(7000, MAX_TOKENS)) == LookupResult(0, 0, 0, 0)
        for client in (body, shared):
            with pytest.raises(InvalidKVError, match="dtype"):
                client.store(tokens_of(7100, 8), kv_of(8, seed=71).float())
            with pytest.raises(InvalidKVError, match="shape"):
                client.store(tokens_of(7100, 8), kv_of(4, seed=71))
            with pytest.raises(LeaseError):
                client.release(12345)
            assert client.lookup(tokens_of(7100, 8)) == LookupResult(0, 0, 0, 0)


def test_a_body_far_over_the_limit_is_a_413_for_both_clients(server: Server) -> None:
    """4 MiB against 64 KiB: the server answers before it has read the body; it lingers
    (`protocol.py`), so the clients read that answer rather than a reset (the blocking client
    raised a broken pipe, httpx a `ReadError`)."""
    whole = store_body(tokens_of(7000, 4096), kv_of(4096, seed=72), 0, "layers", 0)
    with Client(server.url, shared_memory=False) as client:
        with pytest.raises(ServiceError) as refused:
            client._post("/v1/store", whole)  # one request (`store` sends pieces)
        assert (refused.value.status, refused.value.kind) == (413, "body_too_large")
        assert client.lookup(tokens_of(7000, 8)) == LookupResult(0, 0, 0, 0)  # still served

    async def scenario() -> None:
        async with AsyncClient(server.url, shared_memory=False) as client:
            with pytest.raises(ServiceError) as refused:
                await client._post("/v1/store", whole)
            assert (refused.value.status, refused.value.kind) == (413, "body_too_large")

    asyncio.run(scenario())


def test_the_async_client_raises_transport_errors_as_the_blocking_one() -> None:
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"

        async def scenario() -> None:
            async with AsyncClient(url, shared_memory=False) as client:
                with pytest.raises(TransportError, match="POST /v1/lookup: ConnectError"):
                    await client.lookup([1, 2, 3])

        asyncio.run(scenario())


def test_bad_requests_leave_what_was_stored_intact(server: Server) -> None:
    tokens, kv = tokens_of(8000, 32), kv_of(32, seed=80)
    with Client(server.url) as client:
        assert client.store(tokens, kv) == StoreResult(32, 32, 0)
        for _, path, content, headers, status, _ in BAD_REQUESTS:
            assert server.post(path, content=content, headers=headers).status_code == status
        assert client.lookup(tokens) == LookupResult(32, 32, 0, 0)
        assert same(client.load(tokens).kv, kv)
    with Client(server.url, shared_memory=False) as body:
        assert same(body.load(tokens).kv, kv)
    assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}


# ---- figures ------------------------------------------------------------------------------------


Sample = tuple[str, tuple[tuple[str, str], ...]]


def test_metrics_agree_with_the_status(server: Server) -> None:
    def tiers(found: dict[Sample, float]) -> dict[Sample, float]:
        return {key: value for key, value in found.items() if key[0].startswith("kvtier_tier_")}

    def scrape() -> dict[Sample, float]:
        return {
            (name, tuple(sorted(labels.items()))): value for name, labels, value in samples(server)
        }

    with Client(server.url) as client:
        client.store(tokens_of(9000, 16), kv_of(16, seed=90))
        client.lookup(tokens_of(9000, 16))
        # the mover thread may demote (gpu over its watermark) between two reads: compare a
        # status with the scrapes on both sides of it once they agree, i.e. nothing moved
        for _ in range(50):
            before, status, found = scrape(), client.status(), scrape()
            if tiers(before) == tiers(found):
                break
        assert tiers(before) == tiers(found), "the tiers never stood still for a status"
    assert found[("kvtier_ready", ())] == 1
    for tier in ("gpu", "host"):
        label = (("tier", tier),)
        figures = status["tiers"][tier]
        assert found[("kvtier_tier_used_bytes", label)] == figures["used_bytes"]
        assert found[("kvtier_tier_blocks", label)] == figures["blocks"]
        assert found[("kvtier_tier_free_slots", label)] == figures["free_slots"]
        assert found[("kvtier_tier_capacity_bytes", label)] == figures["capacity_bytes"]
        assert figures["used_bytes"] == figures["blocks"] * BLOCK_BYTES > 0
    assert found[("kvtier_tier_capacity_bytes", (("tier", "gpu"),))] == 64 * BLOCK_BYTES
    assert found[("kvtier_ops_total", (("op", "lookups"),))] == status["ops"]["lookups"]
    assert found[("kvtier_index_blocks", ())] == status["index"]["blocks"]


def test_kvtier_status_prints_the_tiers_of_a_running_server(server: Server) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "status", "--url", server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "model tiny: float16, 4 tokens = 4KiB per block; write policy write_through"
    assert lines[1].split() == [
        "tier", "location", "capacity", "slots", "used", "blocks", "reserved"
    ]  # fmt: skip
    rows = {line.split()[0]: line for line in lines[2:4]}
    assert set(rows) == {"gpu", "host"}
    assert " 64 " in rows["gpu"] and " 128 " in rows["host"]  # slots
    assert any(line.startswith("ops: ") for line in lines)


# ---- tenants and keys ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Tenants `a` (a literal key) and `b` (a key from the environment), and the admin key."""
    config = write_config(
        tmp_path_factory.mktemp("auth"),
        tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": ["env:KVTIER_TEST_KEY_B"]}},
    )
    with running(config, env={"KVTIER_TEST_KEY_B": KEY_B}) as live:
        yield live


def test_a_tenant_sees_nothing_of_another_tenants_cache(auth_server: Server) -> None:
    url = auth_server.url
    tokens, kv = tokens_of(100, 16), kv_of(16, seed=100)
    with (
        Client(url, api_key=KEY_A) as a,
        Client(url, api_key=KEY_B) as b,
        Client(url, api_key=KEY_B, shared_memory=False) as b_body,
    ):
        assert a.store(tokens, kv) == StoreResult(16, 16, 0)
        assert b.lookup(tokens) == LookupResult(0, 0, 0, 0)
        assert b.load(tokens).num_tokens == 0
        assert b_body.load(tokens).num_tokens == 0
        lease = a.prefetch(tokens)
        assert (lease.tenant, lease.num_tokens) == ("a", 16)
        with pytest.raises(LeaseError):
            b.release(lease)  # B's key, whatever the lease says
        peek = auth_server.get(
            f"/v1/leases/{lease.lease_id}", headers={"authorization": f"Bearer {KEY_B}"}
        )
        assert peek.status_code == 404
        a.release(lease)  # still A's, still live
        assert b.store(tokens, kv_of(16, seed=101)) == StoreResult(16, 16, 0)  # B's own blocks
        assert same(a.load(tokens).kv, kv)
        assert same(b.load(tokens).kv, kv_of(16, seed=101))
    with Client(url, api_key=KEY_A, tenant="b", shared_memory=False) as named:
        assert same(named.load(tokens).kv, kv)  # the key decides; a named tenant does not


def test_a_request_without_a_key_is_401_and_with_an_unknown_key_403(
    auth_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVTIER_API_KEY", raising=False)
    lookup = json.dumps({"tokens": [1, 2, 3, 4]}).encode()
    for headers, status, kind in [
        (JSON, 401, "unauthorized"),
        ({**JSON, "authorization": "Bearer not-a-key-of-anyone"}, 403, "forbidden"),
        ({**JSON, "authorization": KEY_A}, 401, "unauthorized"),  # not "Bearer <key>"
        ({**JSON, "authorization": f"Bearer {ADMIN_KEY}"}, 403, "forbidden"),  # admin only
    ]:
        response = auth_server.post("/v1/lookup", content=lookup, headers=headers)
        assert response.status_code == status
        assert response.json() == {"error": kind, "detail": response.json()["detail"]}
    with pytest.raises(ServiceError) as missing:
        Client(auth_server.url)  # mapping the pools needs a key too
    assert missing.value.status == 401
    with pytest.raises(ServiceError) as wrong:
        Client(auth_server.url, api_key="not-a-key-of-anyone", shared_memory=False).lookup([1])
    assert wrong.value.status == 403


def test_admin_endpoints_need_the_admin_key_and_clear_drops_one_tenants_blocks(
    auth_server: Server,
) -> None:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert auth_server.post("/v1/admin/clear", headers=admin).status_code == 200  # a clean start
    with Client(auth_server.url, api_key=KEY_A) as a, Client(auth_server.url, api_key=KEY_B) as b:
        assert a.store(tokens_of(200, 16), kv_of(16, seed=200)) == StoreResult(16, 16, 0)
        assert a.store(tokens_of(300, 8), kv_of(8, seed=201)) == StoreResult(8, 8, 0)
        assert b.store(tokens_of(200, 8), kv_of(8, seed=202)) == StoreResult(8, 8, 0)
        for key in (None, KEY_A, "not-a-key-of-anyone"):
            headers = {} if key is None else {"authorization": f"Bearer {key}"}
            for path in ("/v1/admin/check", "/v1/admin/clear", "/v1/admin/persist"):
                response = auth_server.post(path, headers=headers)
                assert response.status_code == 403
                assert response.json()["error"] == "forbidden"
        assert a.lookup(tokens_of(200, 16)).num_tokens == 16  # nothing was cleared
        assert auth_server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}
        cleared = auth_server.admin("/v1/admin/clear", params={"tenant": "a"})
        assert cleared.json() == {"dropped_blocks": 6}
        assert a.lookup(tokens_of(200, 16)) == LookupResult(0, 0, 0, 0)
        assert a.lookup(tokens_of(300, 8)) == LookupResult(0, 0, 0, 0)
        assert b.lookup(tokens_of(200, 8)) == LookupResult(8, 8, 0, 0)
        assert a.status()["tiers"]["gpu"]["blocks"] == 0  # a tenant's status: its own blocks
        assert b.status()["tiers"]["gpu"]["blocks"] == 2
    unknown = auth_server.post("/v1/admin/clear", headers=admin, params={"tenant": "nobody"})
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_tenant"
    no_disk = auth_server.post("/v1/admin/persist", headers=admin)
    assert no_disk.status_code == 400 and "tiers.disk" in no_disk.json()["detail"]


def test_no_key_appears_in_the_config_status_or_metrics(auth_server: Server) -> None:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}  # with keys on, config and metrics need it
    config = auth_server.get("/v1/config", headers=admin)
    assert config.status_code == 200
    assert {tenant: c["api_keys"] for tenant, c in config.json()["tenants"].items()} == {
        "a": ["<redacted>"],
        "b": ["<redacted>"],
    }
    assert config.json()["service"]["admin_key"] == "<redacted>"
    status = auth_server.get("/v1/status", headers={"authorization": f"Bearer {KEY_A}"})
    assert status.status_code == 200
    metrics = auth_server.get("/metrics", headers=admin)
    assert metrics.status_code == 200
    for text in (config.text, status.text, metrics.text):
        for key in (KEY_A, KEY_B, ADMIN_KEY):
            assert key not in text
    assert KEY_A not in auth_server.output() and KEY_B not in auth_server.output()


def test_the_server_refuses_a_public_address_without_auth(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    done = subprocess.run(
        serve_command(config, free_port(), "--host", "0.0.0.0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "service.host" in done.stderr and "0.0.0.0" in done.stderr
    assert not (tmp_path / "state" / "secret").exists()  # refused before anything started


# ---- restarts -----------------------------------------------------------------------------------


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_restart_recovers_what_was_persisted_with_the_same_block_ids(tmp_path: Path) -> None:
    config = write_config(tmp_path, disk="1MiB", write="write_back")
    a, kv_a = tokens_of(100, 32), kv_of(32, seed=1)
    b, kv_b = tokens_of(200, 16), kv_of(16, seed=2)
    late = tokens_of(300, 8)
    with running(config) as first, Client(first.url) as client:
        assert client.store(a, kv_a) == StoreResult(32, 32, 0)
        assert client.store(b, kv_b) == StoreResult(16, 16, 0)
        assert first.admin("/v1/admin/persist").json() == {"persisted_blocks": 12, "left_blocks": 0}
        assert client.store(late, kv_of(8, seed=3)) == StoreResult(8, 8, 0)  # memory only
    secret = tmp_path / "state" / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_size == 32
    first_secret = secret.read_bytes()
    with running(config) as second, Client(second.url) as client:
        assert client.lookup(a) == LookupResult(32, 0, 0, 32)
        assert client.lookup(b) == LookupResult(16, 0, 0, 16)
        assert client.lookup(late) == LookupResult(0, 0, 0, 0)  # a stop does not persist
        assert same(client.load(a).kv, kv_a)  # through shared memory: disk -> gpu, then read
        with Client(second.url, shared_memory=False) as body:
            assert same(body.load(b).kv, kv_b)
        # the disk's reads, in the status and in the metrics
        busy = client.status()["tiers"]["disk"]["recent_bytes_per_s"]
        found = {(name, tuple(labels.items())): v for name, labels, v in samples(second)}
        scraped = found[("kvtier_tier_bandwidth_bytes_per_second", (("tier", "disk"),))]
        assert busy > 0 and scraped > 0
        assert second.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}
    assert secret.read_bytes() == first_secret


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_sigterm_during_transfers_exits_0_and_the_restart_recovers(tmp_path: Path) -> None:
    """Two clients (shared memory and body) store, prefetch and load sequences of 6 blocks into
    tiers of 24 and 32 blocks, so the mover demotes to disk all along; SIGTERM mid-stream. Each
    client stops at its first error, which must come after the signal. The gpu tier holds the
    worst overlap (one client's lease and the other's prefetch in flight and store: 18 blocks):
    with 16, a loaded machine saw a rightful CapacityError before the signal."""
    config = write_config(tmp_path, gpu_blocks=24, host_blocks=32, disk="2MiB", write="write_back")
    server = start(config)
    done: list[int] = []
    failures: list[tuple[float, BaseException]] = []

    def hammer(shared_memory: bool, first: int) -> None:
        try:
            with Client(server.url, shared_memory=shared_memory, timeout_s=30) as client:
                for seq in range(first, first + 10_000, 2):
                    tokens = tokens_of(seq * 100, 24)
                    client.store(tokens, kv_of(24, seed=seq))
                    client.release(client.prefetch(tokens_of((seq - 2) * 100, 24)))
                    client.load(tokens_of((seq - 4) * 100, 24))
                    done.append(seq)
        except Exception as exc:
            failures.append((time.monotonic(), exc))

    threads = [
        threading.Thread(target=hammer, args=(shm, 10 + i)) for i, shm in enumerate((True, False))
    ]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(done) < 40 and not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(done) >= 40 and not failures, failures
    finally:
        signalled = time.monotonic()
        status = server.stop(timeout_s=30)  # AssertionError past 30 s
    assert status == 0, server.output()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    assert all(when >= signalled for when, _ in failures), failures  # none before the signal
    for _, exc in failures:  # the connection went away, or the store had closed
        assert isinstance(exc, TransportError) or (
            isinstance(exc, ServiceError) and exc.status == 503
        ), failures

    with running(config) as again, Client(again.url) as client:
        assert again.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}
        recovered = 0
        for seq in sorted(set(done)):
            found = client.lookup(tokens_of(seq * 100, 24)).num_tokens
            if found:
                recovered += 1
                loaded = client.load(tokens_of(seq * 100, 24))
                assert same(loaded.kv, kv_of(24, seed=seq)[:, :, : loaded.num_tokens])
        assert recovered > 0  # what reached the disk before the stop
