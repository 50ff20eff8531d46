"""An audit of the clients against a hostile server (`fake_server.py`), past `test_client_trust`.

Every figure a server sends is checked against what the client asked before a caller sees it:
no more tokens than the prompt had (lookup, load, prefetch, store, commit), the lease waited on
and no other, a tenant the client can name in its next request's header, and a success only
from a 2xx status (a redirect is not followed, and not taken for an answer). Both clients, where
their code differs. The KV of a load reply is checked against the layout before it reaches the
caller, and a segment name that is a FIFO or a directory is never mapped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from fake_server import FakeServer, Reply, fake_servers, host_reservation, ready_lease
from service_server import BLOCK_BYTES, BT, DIM, HEADS, LAYERS, kv_of, tokens_of

from kvtier.client import AsyncClient, Client, ServiceError
from kvtier.client.transport import WaitPacer
from kvtier.errors import ReplyError
from kvtier.results import LeaseState, StoreResult
from kvtier.service import wire
from kvtier.tiers.shm import SHM_DIR, create_shared

SLOTS = 8
TOKENS = tokens_of(0, 2 * BT)
KV = kv_of(2 * BT, 1)
LAYOUT = {
    "dtype": "float16",
    "block_shape": [LAYERS, 2, BT, HEADS, DIM],
    "block_bytes": BLOCK_BYTES,
    "block_tokens": BT,
}
LEASE = ready_lease(BT, LAYERS)
RESERVATION = host_reservation(BT)
STORED = {
    "cached_tokens": 2 * BT,
    "stored_tokens": 2 * BT,
    "dropped_tokens": 0,
    "pending_tokens": 0,
}
LOOKUP = {"num_tokens": 2 * BT, "gpu_tokens": 2 * BT, "host_tokens": 0, "disk_tokens": 0}


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeServer]]:
    with fake_servers() as make:
        yield make


@pytest.fixture
def segments() -> Iterator[Callable[[str], str]]:
    """`make(tier)`: a true segment of that tier's pool, as a kvtier server makes one."""
    made: list[str] = []

    def make(tier: str) -> str:
        name = f"kvtier-{os.getpid()}-{secrets.token_hex(4)}-{tier}"
        create_shared(name, SLOTS * BLOCK_BYTES).close()
        made.append(name)
        return name

    yield make
    for name in made:
        os.unlink(SHM_DIR / name)


def pools(name: str | None = None, tier: str = "host") -> Reply:
    pool = {"tier": tier, "num_slots": SLOTS, "shared_memory": name}
    return 200, {"layout": LAYOUT, "pools": [pool]}


def call(
    url: str, method: str, *args: Any, asynchronous: bool = False, shared: bool = True, **kw: Any
) -> Any:
    """`method(*args, **kw)` on a `Client` (or an `AsyncClient`) of `url`; its result."""
    if not asynchronous:
        with Client(url, shared_memory=shared) as client:
            return getattr(client, method)(*args, **kw)

    async def run() -> Any:
        async with AsyncClient(url, shared_memory=shared) as client:
            return await getattr(client, method)(*args, **kw)

    return asyncio.run(run())


BOTH = pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])


# ---- no more tokens than asked ---------------------------------------------------------------


@BOTH
@pytest.mark.parametrize(
    ("mapped", "num_tokens"),
    [(False, 5 * BT), (True, 3 * BT), (True, BT + 1)],
    ids=["no-layout-more-blocks", "layout-more-blocks", "layout-part-block"],
)
def test_a_load_in_the_body_of_more_tokens_than_asked_is_a_reply_error(
    fake: Callable[..., FakeServer],
    segments: Callable[[str], str],
    asynchronous: bool,
    mapped: bool,
    num_tokens: int,
) -> None:
    """No `out` and no gpu pool mapped: the KV in the body is the result itself, and it is
    still a prefix of the prompt, in whole blocks when the layout is known."""
    body = {"num_tokens": num_tokens, **wire.kv_to_wire(kv_of(num_tokens, 5))}
    server = fake(pools=pools(segments("host")), load=(200, body))
    with pytest.raises(ReplyError, match=r"load\.num_tokens"):
        call(server.url, "load", TOKENS, asynchronous=asynchronous, shared=mapped)


@BOTH
@pytest.mark.parametrize("num_tokens", [3 * BT, 1 << 40])
def test_a_lookup_of_more_tokens_than_asked_is_a_reply_error(
    fake: Callable[..., FakeServer], asynchronous: bool, num_tokens: int
) -> None:
    lookup = {**LOOKUP, "num_tokens": num_tokens, "gpu_tokens": num_tokens}
    server = fake(lookup=(200, lookup))
    with pytest.raises(ReplyError, match=r"lookup\.num_tokens"):
        call(server.url, "lookup", TOKENS, asynchronous=asynchronous, shared=False)


@BOTH
@pytest.mark.parametrize(
    "result",
    [
        {**STORED, "cached_tokens": 1 << 40},
        {**STORED, "stored_tokens": 3 * BT, "cached_tokens": 3 * BT},
        {**STORED, "dropped_tokens": 2 * BT},  # 8 cached and 8 dropped of 8 sent
    ],
    ids=["cached-2**40", "stored-more", "adds-up-past"],
)
def test_a_store_result_of_more_tokens_than_sent_is_a_reply_error(
    fake: Callable[..., FakeServer], asynchronous: bool, result: dict[str, int]
) -> None:
    server = fake(store=(200, result), pools=pools())  # a store asks the layout first
    with pytest.raises(ReplyError, match=r"store"):
        call(server.url, "store", TOKENS, KV, asynchronous=asynchronous, shared=False)


def test_a_commit_result_of_more_tokens_than_reserved_is_a_reply_error(
    fake: Callable[..., FakeServer], segments: Callable[[str], str]
) -> None:
    result = {**STORED, "cached_tokens": 3 * BT, "stored_tokens": 3 * BT}
    server = fake(pools=pools(segments("host")), reserve=(200, RESERVATION), commit=(200, result))
    with pytest.raises(ReplyError, match=r"store\.cached_tokens"):
        call(server.url, "store", TOKENS, KV)
    assert "/v1/commit" in server.paths  # the shared-memory path, refused at its last reply


@BOTH
@pytest.mark.parametrize("mapped", [False, True], ids=["no-pool", "gpu-pool"])
def test_a_prefetch_lease_of_more_tokens_than_asked_is_a_reply_error(
    fake: Callable[..., FakeServer],
    segments: Callable[[str], str],
    asynchronous: bool,
    mapped: bool,
) -> None:
    """The engine reads `block_table` into its own cache: a lease of more blocks than its
    prompt would overrun it (`load` checks this; a bare prefetch must too)."""
    lease = {**LEASE, "num_tokens": 3 * BT, "block_table": [0, 1, 2]}
    server = fake(pools=pools(segments("gpu"), "gpu"), prefetch=(200, lease), release=(200, {}))
    with pytest.raises(ReplyError, match=r"lease\.num_tokens"):
        call(server.url, "prefetch", TOKENS, asynchronous=asynchronous, shared=mapped)


# ---- the lease waited on, and tenants that go back in a header ---------------------------------


@BOTH
@pytest.mark.parametrize(
    "fresh",
    [{"lease_id": 10}, {"block_table": [5, 6]}, {"num_tokens": BT, "block_table": [0]}],
    ids=["other-id", "other-slots", "other-size"],
)
def test_waiting_on_a_lease_answers_with_that_lease_or_a_reply_error(
    fake: Callable[..., FakeServer],
    segments: Callable[[str], str],
    asynchronous: bool,
    fresh: dict[str, Any],
) -> None:
    server = fake(
        pools=pools(segments("gpu"), "gpu"),
        prefetch=(200, {**LEASE, "state": "pending"}),
        **{"leases/9": (200, {**LEASE, **fresh})},
    )
    with pytest.raises(ReplyError, match=r"lease: got lease"):
        call(server.url, "prefetch", TOKENS, asynchronous=asynchronous)
    assert "/v1/leases/9" in server.paths


@BOTH
def test_a_server_that_answers_pending_at_once_is_asked_at_a_growing_pause(
    fake: Callable[..., FakeServer], asynchronous: bool
) -> None:
    """A wait asks the server to hold it; a PENDING answer that comes back at once (a server
    that does not wait: broken, hostile, or one with a tiny `prefetch_wait_s`) is asked again
    after a pause that doubles (`WaitPacer`), not in a loop as fast as the server answers."""
    pending = {**LEASE, "state": "pending"}
    server = fake(prefetch=(200, pending), **{"leases/9": (200, pending)})

    def wait_blocking() -> Any:
        with Client(server.url, shared_memory=False) as client:
            return client.wait_for(client.prefetch(TOKENS, wait=False), timeout_s=1.0)

    async def wait_async() -> Any:
        async with AsyncClient(server.url, shared_memory=False) as client:
            return await client.wait_for(await client.prefetch(TOKENS, wait=False), 1.0)

    started = time.monotonic()
    lease = asyncio.run(wait_async()) if asynchronous else wait_blocking()
    took = time.monotonic() - started
    asks = server.paths.count("/v1/leases/9")
    assert lease.state is LeaseState.PENDING and 0.95 <= took < 5.0
    assert 3 <= asks <= 15, asks  # pauses of 1, 2, 4 ... 512 ms: about 11 asks in 1 s


@BOTH
def test_a_lease_whose_wait_fails_is_released_not_left_to_its_ttl(
    fake: Callable[..., FakeServer], asynchronous: bool
) -> None:
    """The server granted a lease and the wait for it failed (here a 503): the lease is still
    the client's, and it is released (by the flusher, within moments), not held to its ttl."""
    pending = {**LEASE, "state": "pending"}
    busy = (503, {"error": "not_ready", "detail": "busy"})
    server = fake(prefetch=(200, pending), release=(200, {}), **{"leases/9": busy})
    with pytest.raises(ServiceError):
        call(server.url, "prefetch", TOKENS, asynchronous=asynchronous, shared=False)
    assert "/v1/release" in server.paths  # at the latest by close()


def test_a_cancelled_async_wait_releases_its_lease() -> None:
    """An engine cancels a task waiting on its prefetch: the lease is released soon."""
    pending = {**LEASE, "state": "pending"}
    with fake_servers() as fake:
        server = fake(prefetch=(200, pending), release=(200, {}), **{"leases/9": (200, pending)})

        async def run() -> None:
            async with AsyncClient(server.url, shared_memory=False) as client:
                task = asyncio.ensure_future(client.prefetch(TOKENS))
                await asyncio.sleep(0.2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.sleep(0.3)  # the flusher's 50 ms, then its request
                assert "/v1/release" in server.paths  # before close(), not only at it

        asyncio.run(run())


def test_the_wait_pacer_resets_after_a_held_answer_and_never_passes_the_deadline() -> None:
    pacer = WaitPacer(deadline=None)
    now = time.monotonic()
    pauses = [pacer.after(now, 30.0) for _ in range(12)]
    assert pauses[:3] == [0.001, 0.002, 0.004] and pauses[-1] == WaitPacer.MOST_S
    assert pacer.after(time.monotonic() - 1.0, 30.0) == 0.0  # held for a second: a real wait
    assert pacer.after(time.monotonic(), 30.0) == 0.001  # and the pauses start again
    assert pacer.after(time.monotonic(), 0.0) == 0.0  # no wait asked: none expected
    soon = WaitPacer(deadline=time.monotonic() + 0.01)
    assert all(soon.after(time.monotonic(), 30.0) <= 0.01 for _ in range(12))


@BOTH
@pytest.mark.parametrize("tenant", ["\u2603", "a\r\nx-kvtier-tenant: b"])
def test_a_lease_tenant_that_cannot_be_sent_back_is_a_reply_error(
    fake: Callable[..., FakeServer], asynchronous: bool, tenant: str
) -> None:
    """A pending lease is waited on as its tenant (a header): one that is no header value is
    refused where it arrives, not left to the HTTP library's UnicodeEncodeError/ValueError."""
    pending = {**LEASE, "state": "pending", "tenant": tenant}
    server = fake(prefetch=(200, pending), **{"leases/9": (200, LEASE)})
    with pytest.raises(ReplyError, match=r"lease\.tenant"):
        call(server.url, "prefetch", TOKENS, asynchronous=asynchronous, shared=False)
    assert "/v1/leases/9" not in server.paths


def test_a_reservation_tenant_that_cannot_be_sent_back_is_refused_before_the_write(
    fake: Callable[..., FakeServer], segments: Callable[[str], str]
) -> None:
    name = segments("host")
    reservation = {**RESERVATION, "tenant": "\u2603"}
    server = fake(pools=pools(name), reserve=(200, reservation), commit=(200, STORED))
    with pytest.raises(ReplyError, match=r"reservation\.tenant"):
        call(server.url, "store", TOKENS, KV)
    assert (SHM_DIR / name).read_bytes() == bytes(SLOTS * BLOCK_BYTES)


# ---- statuses and bodies -----------------------------------------------------------------------


@contextlib.contextmanager
def redirecting(status: int, location: str, body: dict[str, Any]) -> Iterator[str]:
    """A server answering every request with `status`, `Location: location` and `body` as
    JSON (a success's body: a lookup's counts, a release's `{}`); its URL."""

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("location", location + self.path)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = answer

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}"
    finally:
        http.shutdown()
        http.server_close()


@BOTH
@pytest.mark.parametrize("status", [302, 307, 308])
@pytest.mark.parametrize(
    ("method", "args", "reply"),
    [("lookup", (TOKENS,), LOOKUP), ("release", (9,), {})],
)
def test_a_redirect_is_a_service_error_and_is_not_followed(
    fake: Callable[..., FakeServer],
    asynchronous: bool,
    status: int,
    method: str,
    args: tuple[Any, ...],
    reply: dict[str, Any],
) -> None:
    """A 3xx whose body reads as a success (a release's `{}`) is no success: the call was not
    done. Nor is the redirect followed to the other server it names."""
    elsewhere = fake(lookup=(200, LOOKUP), release=(200, {}))
    with redirecting(status, elsewhere.url, reply) as url, pytest.raises(ServiceError) as refused:
        call(url, method, *args, asynchronous=asynchronous, shared=False)
    assert refused.value.status == status
    assert elsewhere.paths == []


def test_a_200_carrying_an_error_body_is_a_reply_error_not_that_error(
    fake: Callable[..., FakeServer], segments: Callable[[str], str]
) -> None:
    """A load whose prefetch is refused for capacity goes through the body; a 200 saying
    "capacity" is no refusal, and must not send the load there."""
    refusal = {"error": "capacity", "detail": "no room"}
    server = fake(
        pools=pools(segments("gpu"), "gpu"),
        prefetch=(200, refusal),
        load=(200, {"num_tokens": 0, **wire.kv_to_wire(kv_of(0, 1))}),
    )
    with pytest.raises(ReplyError, match=r"lease\.state"):
        call(server.url, "load", TOKENS)
    assert "/v1/load" not in server.paths


@pytest.mark.parametrize(
    "kv",
    [kv_of(2 * BT, 3).float(), kv_of(2 * BT, 3)[:, :, :, :1].contiguous()],
    ids=["other-dtype", "other-heads"],
)
def test_a_load_kv_of_another_layout_never_lands_in_the_callers_out(
    fake: Callable[..., FakeServer], kv: torch.Tensor
) -> None:
    server = fake(pools=pools(None), load=(200, {"num_tokens": 2 * BT, **wire.kv_to_wire(kv)}))
    out = torch.full((LAYERS, 2, 2 * BT, HEADS, DIM), 7.0, dtype=torch.float16)
    with Client(server.url) as client, pytest.raises(ReplyError, match=r"load\.kv"):
        client.load(TOKENS, out=out)
    assert bool((out == 7).all())


@BOTH
def test_a_load_kv_shape_past_int64_is_a_reply_error(
    fake: Callable[..., FakeServer], asynchronous: bool
) -> None:
    body = {"num_tokens": 0, "kv": b"", "dtype": "float16", "shape": [0, 1 << 63]}
    server = fake(load=(200, body))
    with pytest.raises(ReplyError, match=r"load"):
        call(server.url, "load", TOKENS, asynchronous=asynchronous, shared=False)


@pytest.mark.parametrize("method", ["prefetch", "reserve"])
def test_an_expiry_past_a_floats_range_is_a_reply_error(
    fake: Callable[..., FakeServer], method: str
) -> None:
    reserved = {**RESERVATION, "num_tokens": 0, "slots": []}
    server = fake(prefetch=(200, LEASE), reserve=(200, reserved))
    expiry = {"expires_at": 10**400}  # JSON has integers of any size
    server.replies[f"/v1/{method}"] = (200, {**server.replies[f"/v1/{method}"][1], **expiry})
    with pytest.raises(ReplyError, match=r"expires_at"):
        call(server.url, method, TOKENS, shared=False)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_segment_name_that_is_no_regular_file_stays_unmapped(
    fake: Callable[..., FakeServer], kind: str
) -> None:
    name = f"kvtier-{os.getpid()}-{secrets.token_hex(4)}-host"
    path = SHM_DIR / name
    os.mkfifo(path, 0o600) if kind == "fifo" else path.mkdir(0o700)
    try:
        server = fake(pools=pools(name), store=(200, STORED))
        with Client(server.url) as client:
            assert client.pool_buffer("host") is None
            client.store(TOKENS, KV)
        assert server.paths == ["/v1/pools", "/v1/store"]  # the KV went in the body
    finally:
        os.rmdir(path) if kind == "directory" else path.unlink()


def test_an_async_client_whose_first_pools_call_failed_maps_them_at_the_next(
    fake: Callable[..., FakeServer], segments: Callable[[str], str]
) -> None:
    """An engine that starts beside its sidecar meets a 503 first: the pools are asked again at
    the next call, not given up for the body path for good (the sync client asks in its
    constructor, which fails as a whole)."""
    server = fake(
        pools=(503, {"error": "not_ready", "detail": "starting"}),
        reserve=(200, RESERVATION),
        commit=(200, STORED),
        store=(200, STORED),
    )

    async def run() -> None:
        async with AsyncClient(server.url) as client:
            with pytest.raises(ServiceError, match="starting"):
                await client.store(TOKENS, KV)
            server.replies["/v1/pools"] = pools(segments("host"))
            assert await client.store(TOKENS, KV) == StoreResult(**STORED)

    asyncio.run(run())
    assert server.paths == ["/v1/pools", "/v1/pools", "/v1/reserve", "/v1/commit"]
