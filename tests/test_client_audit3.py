"""A third audit of the clients' data plane: paged loads, mapped stores over a quota, waits.

- A load through the body comes back in pages (`client/pages.py`), each a load of its own on
  the server, so the prefix may be evicted between two: a later page then ends before its own
  start. The result is the contiguous KV the pages delivered, `num_tokens` its exact end, in
  every form (a new tensor, the caller's `out`, blocks), never a count that disagrees with the
  KV nor a torch `RuntimeError`; a page whose KV disagrees with its count is a `ReplyError`.
  A hostile server (a small HTTP server of the test, whose answer depends on the page's start)
  makes the eviction certain; a real `kvtier serve` evicting under a running load shows it
  happen for real.
- A mapped `store` whose reservation the server refuses (a tenant's gpu quota, the tier) goes
  through the body, as `load` does, and stores what the body store stores.
- A wait on a lease that a server keeps PENDING for ever (`prefetch(wait=True)`, a mapped
  `load`) ends on the client's own bound (`WaitPacer.MOST_WAIT_S`) with a `WaitTimeoutError`
  naming the lease, and the lease is released, not left to its ttl.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import torch
from fake_server import ready_lease
from service_server import BLOCK_BYTES, BT, DIM, HEADS, LAYERS, kv_of, running, write_config

from kvtier.client import AsyncClient, Client, WaitTimeoutError
from kvtier.client.transport import WaitPacer
from kvtier.errors import KVTierError, QuotaError, ReplyError
from kvtier.results import LoadResult, StoreResult
from kvtier.tiers.shm import SHM_DIR, create_shared

LAYOUT = {
    "dtype": "float16",
    "block_shape": [LAYERS, 2, BT, HEADS, DIM],
    "block_bytes": BLOCK_BYTES,
    "block_tokens": BT,
}
SLOTS = 8
PROMPT = list(range(4 * BT))  # 16 tokens: the hostile server answers the first 8 in page one
BOTH = pytest.mark.parametrize("asynchronous", [False, True], ids=["Client", "AsyncClient"])

Handler = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]]]


@contextlib.contextmanager
def scripted(handler: Handler) -> Iterator[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    """A server on a thread of the test that answers each request with `handler(path, body)`
    (the request's msgpack body decoded): its URL, and the requests it was sent."""
    calls: list[tuple[str, dict[str, Any]]] = []

    class Answer(BaseHTTPRequestHandler):
        def answer(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            body = msgpack.unpackb(raw, raw=False) if raw else {}
            path = self.path.split("?")[0]
            calls.append((path, body))
            status, data = handler(path, body)
            out = msgpack.packb(data, use_bin_type=True)
            self.send_response(status)
            self.send_header("content-type", "application/msgpack")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = answer

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=http.serve_forever, args=(0.02,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}", calls
    finally:
        http.shutdown()
        http.server_close()


def pools(*offers: dict[str, Any]) -> dict[str, Any]:
    return {"layout": LAYOUT, "pools": list(offers), "max_body_bytes": 1 << 30}


def kv_wire(kv: torch.Tensor) -> dict[str, Any]:
    return {"kv": kv.numpy().tobytes(), "dtype": "float16", "shape": list(kv.shape)}


def call(url: str, asynchronous: bool, method: str, *args: Any, **kw: Any) -> Any:
    """`method(*args, **kw)` on a `Client` (or an `AsyncClient`) of `url`; its result."""
    if not asynchronous:
        with Client(url) as client:
            return getattr(client, method)(*args, **kw)

    async def run() -> Any:
        async with AsyncClient(url) as client:
            return await getattr(client, method)(*args, **kw)

    return asyncio.run(run())


# ---- F1: a page that ends before its start ends the load there --------------------------------

FIRST = kv_of(2 * BT, 1)  # what page one (tokens 0..8) holds


def evicted_between_pages(second: dict[str, Any]) -> Handler:
    """A server whose prefix is evicted after the first page of a load: page one answers 8 of
    the 16 tokens (truncated), page two (from token 8) answers `second`."""

    def handler(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if path == "/v1/pools":
            return 200, pools()
        if path == "/v1/load" and body.get("start", 0) == 0:
            return 200, {"num_tokens": 2 * BT, "truncated": True, **kv_wire(FIRST)}
        if path == "/v1/load":
            return 200, second
        return 404, {"error": "not_found", "detail": path}

    return handler


GONE = {"num_tokens": BT, "truncated": False, **kv_wire(kv_of(0, 2))}  # the prefix: 1 block now


@BOTH
@pytest.mark.parametrize("form", ["new", "out", "blocks"])
def test_a_page_that_ends_before_its_start_ends_the_load_where_the_pages_before_ended(
    asynchronous: bool, form: str
) -> None:
    """Page two says the prefix is 4 tokens now (evicted since page one): the load is the 8
    tokens page one delivered, `num_tokens` 8 and exactly their KV, in every form. Before: a
    `LoadResult(4)` holding 8 tokens, or a torch `RuntimeError` copying into `out`/blocks."""
    out = torch.full((LAYERS, 2, len(PROMPT), HEADS, DIM), -1.0, dtype=torch.float16)
    kw: dict[str, Any] = {"out": out} if form == "out" else {}
    if form == "blocks":
        kw["layout"] = "blocks"
    with scripted(evicted_between_pages(GONE)) as (url, calls):
        result: LoadResult = call(url, asynchronous, "load", PROMPT, **kw)
    assert [body.get("start", 0) for path, body in calls if path == "/v1/load"] == [0, 2 * BT]
    assert result.num_tokens == 2 * BT
    if form == "blocks":  # [blocks, layers, 2, block_tokens, heads, dim]
        assert result.kv.shape[0] == 2
        got = result.kv.permute(1, 2, 0, 3, 4, 5).reshape(LAYERS, 2, 2 * BT, HEADS, DIM)
        assert torch.equal(got, FIRST)
        return
    assert tuple(result.kv.shape) == (LAYERS, 2, 2 * BT, HEADS, DIM)
    assert torch.equal(result.kv, FIRST)
    if form == "out":
        assert torch.equal(out[:, :, : 2 * BT], FIRST)
        assert bool((out[:, :, 2 * BT :] == -1.0).all())  # nothing past what was delivered


@BOTH
@pytest.mark.parametrize(
    ("second", "field"),
    [
        ({"num_tokens": BT, "truncated": False, **kv_wire(kv_of(2 * BT, 2))}, "load.kv"),
        ({"num_tokens": 4 * BT, "truncated": False, **kv_wire(kv_of(BT, 2))}, "load.kv"),
        ({"num_tokens": 2 * BT, "truncated": True, **kv_wire(kv_of(0, 2))}, "load.num_tokens"),
        ({"num_tokens": 5 * BT, "truncated": False, **kv_wire(kv_of(3 * BT, 2))}, "num_tokens"),
    ],
    ids=["kv-past-its-count", "count-past-its-kv", "truncated-at-its-start", "past-the-prompt"],
)
def test_a_later_page_that_disagrees_with_itself_is_a_reply_error_naming_the_field(
    asynchronous: bool, second: dict[str, Any], field: str
) -> None:
    """A hostile page two: KV of other than the tokens its `num_tokens` says from its start,
    a truncated reply that does not go past its start, more tokens than the prompt. Each is a
    `ReplyError` naming the field, never a result nor a torch error."""
    out = torch.zeros(LAYERS, 2, len(PROMPT), HEADS, DIM, dtype=torch.float16)
    for kw in ({}, {"out": out}):
        with scripted(evicted_between_pages(second)) as (url, _), pytest.raises(ReplyError) as e:
            call(url, asynchronous, "load", PROMPT, **kw)
        assert field in str(e.value), str(e.value)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_paged_load_under_eviction_on_a_real_server_is_always_its_delivered_prefix(
    tmp_path: Path,
) -> None:
    """A real `kvtier serve` with a small `max_body_bytes` (2 blocks a reply) and no shared
    memory: a load of 8 blocks takes 4 pages while another client stores new prompts that evict
    it. Every load is a prefix of what was stored, `num_tokens` equal to its KV's tokens, and
    nothing but a `KVTierError` is raised."""
    config = write_config(
        tmp_path,
        gpu_blocks=12,
        host_blocks=12,
        service={"shared_memory": False, "max_body_bytes": 9000},
    )
    stop = threading.Event()
    odd: list[str] = []
    loads = 0
    with running(config) as server:

        def evict() -> None:
            with Client(server.url) as other:
                k = 0
                while not stop.is_set():
                    k += 1
                    with contextlib.suppress(KVTierError):
                        other.store([900_000 + 100 * k + j for j in range(8)], kv_of(8, k))

        evictor = threading.Thread(target=evict, daemon=True)
        evictor.start()
        try:
            with Client(server.url) as client:
                end = time.monotonic() + 8.0
                k = 0
                while time.monotonic() < end and not odd:
                    k += 1
                    tokens, kv = [1000 * k + j for j in range(32)], kv_of(32, k)
                    with contextlib.suppress(KVTierError):
                        client.store(tokens, kv)
                    for out in (None, torch.zeros(LAYERS, 2, 32, HEADS, DIM, dtype=kv.dtype)):
                        try:
                            got = client.load(tokens, out=out)
                        except KVTierError:
                            continue
                        except Exception as exc:  # the bug: a torch error
                            odd.append(f"{type(exc).__name__}: {exc}")
                            continue
                        loads += 1
                        n = got.num_tokens
                        if got.kv.shape[2] != n or not torch.equal(got.kv, kv[:, :, :n]):
                            odd.append(f"num_tokens {n}, kv {list(got.kv.shape)}")
        finally:
            stop.set()
            evictor.join(30)
    assert not odd, odd[:3]
    assert loads > 10


# ---- F2: a mapped store over the tenant's gpu quota goes through the body ---------------------


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@BOTH
def test_a_mapped_store_whose_reservation_is_over_the_quota_stores_through_the_body(
    tmp_path: Path, asynchronous: bool
) -> None:
    """Two tenants share 8 gpu blocks (a quota of 4 each); a store of 6 blocks on an empty
    server cannot be reserved (`QuotaError`) but the body store takes it. The mapped store now
    stores what the body store stores on a server in the same state (before: `QuotaError`),
    and loads back the same bytes."""
    tenants: dict[str, Any] = {"a": {}, "b": {}}
    tokens, kv = list(range(1000, 1000 + 6 * BT)), kv_of(6 * BT, 7)
    body_config = write_config(tmp_path / "body", gpu_blocks=8, tenants=tenants)
    with running(body_config) as server, Client(server.url, shared_memory=False) as body:
        expected = body.store(tokens, kv, tenant="a")
    assert expected == StoreResult(6 * BT, 6 * BT, 0, 0)
    with running(write_config(tmp_path / "mapped", gpu_blocks=8, tenants=tenants)) as server:
        with Client(server.url) as mapped:
            assert mapped.pool_buffer("gpu") is not None  # the mapped path is the one tried
            with pytest.raises(QuotaError):  # what the store's reservation meets
                mapped.reserve(tokens, tenant="a")
        got: StoreResult = call(server.url, asynchronous, "store", tokens, kv, tenant="a")
        assert got == expected
        with Client(server.url) as client:
            assert client.lookup(tokens, tenant="a").num_tokens == 6 * BT
            loaded = client.load(tokens, tenant="a")
    assert loaded.num_tokens == 6 * BT and torch.equal(loaded.kv, kv)


# ---- F3: a wait on a lease kept PENDING for ever ends on the client's bound -------------------

PENDING = ready_lease(BT, LAYERS, expires_at=1.0, state="pending", layers_ready=0)


@pytest.fixture
def gpu_segment() -> Iterator[str]:
    """A true /dev/shm segment of a gpu pool, made as a kvtier server makes one."""
    name = f"kvtier-{os.getpid()}-{secrets.token_hex(4)}-gpu"
    create_shared(name, SLOTS * BLOCK_BYTES).close()
    yield name
    os.unlink(SHM_DIR / name)


def pending_for_ever(segment: str | None) -> Handler:
    """A server that answers every prefetch and every wait PENDING (at once), and offers a
    gpu pool in `segment` (None: no pool)."""
    offer = {"tier": "gpu", "num_slots": SLOTS, "shared_memory": segment}

    def handler(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if path == "/v1/pools":
            return 200, pools(offer) if segment else pools()
        if path == "/v1/prefetch" or path.startswith("/v1/leases"):
            return 200, PENDING
        return 200, {}  # a release

    return handler


def bounded(asynchronous: bool, url: str, method: str, within_s: float) -> BaseException | str:
    """`method(PROMPT)` on a client of `url`, given `within_s` to end: what it raised, or a
    line saying it returned or was still waiting."""
    if asynchronous:

        async def run() -> BaseException | str:
            try:
                async with AsyncClient(url) as client:
                    await getattr(client, method)(PROMPT[: 2 * BT])
            except Exception as exc:  # a `WaitTimeoutError` is a `TimeoutError`: told apart
                return exc
            return "returned"

        try:
            return asyncio.run(asyncio.wait_for(run(), within_s))
        except asyncio.TimeoutError:
            return "still waiting"
    ended: list[BaseException | str] = []

    def run_blocking() -> None:
        try:
            with Client(url) as client:
                getattr(client, method)(PROMPT[: 2 * BT])
            ended.append("returned")
        except Exception as exc:
            ended.append(exc)

    thread = threading.Thread(target=run_blocking, daemon=True)  # left behind if it never ends
    thread.start()
    thread.join(within_s)
    return ended[0] if ended else "still waiting"


@BOTH
@pytest.mark.parametrize("method", ["prefetch", "load"])
def test_a_lease_pending_for_ever_ends_the_wait_with_a_wait_timeout_error(
    monkeypatch: pytest.MonkeyPatch, gpu_segment: str, asynchronous: bool, method: str
) -> None:
    """`prefetch(wait=True)` and a mapped `load` (a gpu pool mapped: the load leases first)
    against a server that answers PENDING for ever: the wait ends past the client's bound
    (0.5 s here) with a `WaitTimeoutError` naming the lease; the lease is released. Before:
    the call never returned."""
    monkeypatch.setattr(WaitPacer, "MOST_WAIT_S", 0.5)
    with scripted(pending_for_ever(gpu_segment)) as (url, calls):
        started = time.monotonic()
        ended = bounded(asynchronous, url, method, 20.0)
        took = time.monotonic() - started
        assert isinstance(ended, WaitTimeoutError), ended
        assert isinstance(ended, TimeoutError)  # a caller catching the builtin catches it
        assert "lease 9" in str(ended) and "pending" in str(ended), str(ended)
        assert 0.5 <= took < 10.0
        assert any(path.startswith("/v1/leases") for path, _ in calls)
        released = [body for path, body in calls if path == "/v1/release"]
        assert {"lease_id": 9} in released or any(9 in b.get("release", []) for b in released)


@BOTH
def test_a_wait_with_the_callers_timeout_still_returns_the_lease_pending(
    monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """The client's bound is for waits without a timeout: `wait_for(lease, timeout_s)` past
    that bound still returns the lease pending after the caller's timeout, as before."""
    monkeypatch.setattr(WaitPacer, "MOST_WAIT_S", 0.2)
    with scripted(pending_for_ever(None)) as (url, _):
        if asynchronous:

            async def run() -> Any:
                async with AsyncClient(url, shared_memory=False) as client:
                    lease = await client.prefetch(PROMPT[: 2 * BT], wait=False)
                    return await client.wait_for(lease, 0.6)

            lease = asyncio.run(run())
        else:
            with Client(url, shared_memory=False) as client:
                lease = client.wait_for(client.prefetch(PROMPT[: 2 * BT], wait=False), 0.6)
    assert lease.state.value == "pending" and lease.lease_id == 9
