"""What requests hold in memory at once (`kvtier/service/budget.py`, `service.max_inflight_bytes`)
and loads answered in parts (`service/plane.py`, `client/pages.py`).

Measured before the budget, on `kvtier serve` (a 128 MiB cached prefix, loads through the body):
one load raised the peak RSS by 129 MiB, six concurrent loads by 770 MiB; nothing bounded how
many a tenant could run. Here:

- `Budget` on its own: calls within the bounds go at once, one over the total or its tenant's
  share waits and goes when room frees, one past its deadline is refused 503 busy holding
  nothing, a cancelled waiter holds nothing, and `check()` holds after every step of a random
  schedule;
- a real `kvtier serve` with a 40 MiB budget answers eight concurrent loads of a 16 MiB prefix
  bit-exact with its peak RSS growing by less than the budget and a margin (the loads without
  a budget: about 8 x 16 MiB and their copies);
- a prefix longer than `max_body_bytes` comes back in several replies (`truncated`), joined by
  both clients bit-exact; a server that says `truncated` without moving on is a `ReplyError`;
- a tenant holding its share with a half-sent body waits and is refused 503 busy with its next
  body, while another tenant's store goes through at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack  # type: ignore[import-untyped]
import pytest
import torch
from service_server import (
    ADMIN_KEY,
    BT,
    DIM,
    HEADS,
    LAYERS,
    Server,
    kv_of,
    peak_rss_mib,
    reset_peak,
    running,
    tokens_of,
    write_config,
)

from kvtier.blocks import KVLayout
from kvtier.client import AsyncClient, Client, ServiceError
from kvtier.client.pages import LoadPages, StorePieces
from kvtier.errors import ReplyError
from kvtier.results import LoadResult, StoreResult
from kvtier.service.budget import Budget
from kvtier.service.replies import Pools
from kvtier.service.wire import WireError

MIB = 1 << 20
KEY_A = "budget-tenant-a-0123456789"
KEY_B = "budget-tenant-b-0123456789"
SLOW_ASYNC = pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite


# ---- the budget on its own ------------------------------------------------------------------


def test_calls_wait_for_room_and_are_refused_at_their_deadline() -> None:
    async def scenario() -> None:
        budget = Budget(total=100, share=60)
        a1, a2, b = budget.hold("a"), budget.hold("a"), budget.hold("b")
        await a1.take(50, time.monotonic() + 1)
        later = asyncio.ensure_future(a2.take(20, time.monotonic() + 5))  # over a's share
        await asyncio.sleep(0)
        await b.take(50, time.monotonic() + 1)  # b is not held back by a's waiter
        assert budget.held == 100 and not later.done()
        budget.check()
        a1.shrink(40)  # a2's 20 fits a's share now, not the total
        await asyncio.sleep(0)
        assert not later.done() and budget.held == 90
        b.release()
        await asyncio.wait_for(later, 1)
        a1.shrink(10)
        assert budget.held == 30 and budget.by_tenant == {"a": 30} and budget.waits == 1
        budget.check()
        with pytest.raises(WireError) as refused:
            await budget.hold("a").take(50, time.monotonic() + 0.05)  # over a's share, forever
        assert (refused.value.status, refused.value.kind) == (503, "busy")
        assert budget.held == 30 and budget.refused == 1 and not budget._waiting
        with pytest.raises(WireError) as too_large:
            await budget.hold("c").take(61, time.monotonic() + 1)
        assert too_large.value.status == 413
        waiter = asyncio.ensure_future(budget.hold("a").take(50, time.monotonic() + 5))
        await asyncio.sleep(0.01)
        waiter.cancel()  # the client hung up while it waited
        with pytest.raises(asyncio.CancelledError):
            await waiter
        a1.release()
        a2.release()
        assert budget.held == 0 and budget.by_tenant == {} and not budget._waiting
        budget.check()

    asyncio.run(scenario())


def test_a_random_schedule_keeps_the_budget_whole() -> None:
    async def scenario(seed: int) -> None:
        rng = random.Random(seed)
        budget = Budget(total=1000, share=600)
        done: list[int] = []

        async def call(i: int) -> None:
            hold = budget.hold(rng.choice("abc"))
            try:
                await hold.take(rng.randrange(1, 600), time.monotonic() + rng.random() * 0.05)
                budget.check()
                await asyncio.sleep(rng.random() * 0.01)
                hold.shrink(rng.randrange(0, 300))
                budget.check()
                await asyncio.sleep(rng.random() * 0.01)
                done.append(i)
            except WireError as exc:
                assert exc.kind == "busy"
            finally:
                hold.release()
                budget.check()

        await asyncio.gather(*(call(i) for i in range(200)))
        assert budget.held == 0 and not budget._waiting and done
        assert len(done) + budget.refused == 200

    for seed in range(5):
        asyncio.run(scenario(seed))


# ---- a real server --------------------------------------------------------------------------


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_concurrent_loads_hold_no_more_than_the_budget(tmp_path: Path) -> None:
    """Loads of 36 MiB: past malloc's largest mmap threshold (32 MiB), each is its own mapping
    and leaves the process when freed, so the peak RSS shows what was held at once."""
    tokens, kv = tokens_of(10_000, 36 * 1024), kv_of(36 * 1024, seed=3)
    service = {"max_body_bytes": 40 * MIB, "max_inflight_bytes": 80 * MIB}
    config = write_config(tmp_path, gpu_blocks=9300, host_blocks=9300, service=service)
    with running(config) as server, Client(server.url, shared_memory=False) as client:
        client.store(tokens, kv)
        reset_peak(server.process.pid)
        before = peak_rss_mib(server.process.pid)
        results: list[bool] = []

        def load() -> None:
            with Client(server.url, shared_memory=False) as own:
                loaded = own.load(tokens)
                results.append(loaded.num_tokens == len(tokens) and torch.equal(loaded.kv, kv))

        threads = [threading.Thread(target=load) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        grown = peak_rss_mib(server.process.pid) - before
        assert results == [True] * 8
        assert grown < 80 + 32, f"peak RSS grew by {grown:.0f} MiB under an 80 MiB budget"
        figures = metrics(server)
        assert figures["kvtier_inflight_limit_bytes"] == 80 * MIB
        assert figures["kvtier_inflight_bytes"] == 0  # every hold given back
        assert figures["kvtier_inflight_waits_total"] >= 1  # 8 x 36 MiB did not fit at once


def metrics(server: Server) -> dict[str, float]:
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("kvtier_inflight")
    }


def slow_load(server: Server, tokens: list[int], key: str | None = None) -> socket.socket:
    """A load whose client reads nothing yet, through a 4 KiB receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    body = msgpack.packb({"tokens": tokens}, use_bin_type=True)
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST /v1/load HTTP/1.1\r\nhost: 127.0.0.1\r\n{auth}content-type: "
            f"application/msgpack\r\ncontent-length: {len(body)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    return sock


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_client_that_stops_reading_is_cut_off_and_holds_nothing(tmp_path: Path) -> None:
    tokens, kv = tokens_of(50_000, 16 * 1024), kv_of(16 * 1024, seed=7)  # 16 MiB
    service = {"max_body_bytes": 16 * MIB, "body_timeout_s": 1.0}
    config = write_config(tmp_path, gpu_blocks=4200, host_blocks=4200, service=service)
    with running(config) as server:
        with Client(server.url) as near:
            near.store(tokens, kv)
        sock = slow_load(server, tokens)
        time.sleep(0.5)
        assert metrics(server)["kvtier_inflight_bytes"] == 16 * MIB  # the reply, held
        time.sleep(1.5)  # no chunk taken for body_timeout_s: cut off
        assert metrics(server)["kvtier_inflight_bytes"] == 0
        got = 0
        with contextlib.suppress(OSError):  # a reset, once what was buffered is read
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
        sock.close()
        assert got < 16 * MIB
        assert "ASGI" not in server.output() and "Traceback" not in server.output()
        with Client(server.url, shared_memory=False) as far:
            assert torch.equal(far.load(tokens).kv, kv)  # the server serves on


@pytest.mark.parametrize(
    "asynchronous",
    [False, pytest.param(True, marks=SLOW_ASYNC)],  # the async client's pieces: `pytest -m slow`
    ids=["Client", "AsyncClient"],
)
def test_a_long_prefix_comes_back_in_several_replies(tmp_path: Path, asynchronous: bool) -> None:
    tokens, kv = tokens_of(20_000, 1000), kv_of(1000, seed=4)  # 1,000 KiB, 62 KiB a reply
    config = write_config(tmp_path, gpu_blocks=300, host_blocks=300,
                          service={"max_body_bytes": 62 * 1024})  # fmt: skip
    with running(config) as server:
        with Client(server.url) as near:  # the shared-memory path: no body to bound
            assert near.store(tokens, kv).stored_tokens == 1000
        body = msgpack.packb({"tokens": tokens}, use_bin_type=True)
        raw = msgpack.unpackb(server.post("/v1/load", content=body, headers=MSGPACK).content)
        assert raw["num_tokens"] == 60 and raw["truncated"] is True  # 15 blocks of 4 KiB
        if asynchronous:
            loaded = asyncio.run(_async_load(server.url, tokens))
        else:
            with Client(server.url, shared_memory=False) as far:
                loaded = far.load(tokens)
        assert loaded.num_tokens == 1000 and torch.equal(loaded.kv, kv)
        with Client(server.url, shared_memory=False) as far:
            tail = far.load(tokens, start=400)
        assert tail.num_tokens == 1000 and torch.equal(tail.kv, kv[:, :, 400:])
        assert server.admin("/v1/admin/check").status_code == 200


MSGPACK = {"content-type": "application/msgpack"}


@pytest.mark.parametrize(
    "asynchronous",
    [False, pytest.param(True, marks=SLOW_ASYNC)],  # the async client's pieces: `pytest -m slow`
    ids=["Client", "AsyncClient"],
)
def test_a_long_prefix_is_stored_through_the_body_in_pieces(
    tmp_path: Path, asynchronous: bool
) -> None:
    """1,000 KiB of KV against a `max_body_bytes` of 62 KiB: the client stores it in pieces of
    whole blocks (the server's limit from `/v1/pools`), each from where the last ended."""
    tokens, kv = tokens_of(40_000, 1000), kv_of(1000, seed=9)
    config = write_config(tmp_path, gpu_blocks=300, host_blocks=300,
                          service={"max_body_bytes": 62 * 1024})  # fmt: skip
    with running(config) as server:
        before = requests_of(server, "/v1/store")
        if asynchronous:
            result = asyncio.run(_async_store(server.url, tokens, kv))
        else:
            with Client(server.url, shared_memory=False) as far:
                result = far.store(tokens, kv)
        assert result == StoreResult(1000, 1000, 0, 0)
        assert requests_of(server, "/v1/store") - before >= 1000 * 1024 // (62 * 1024)
        with Client(server.url) as near:
            assert torch.equal(near.load(tokens).kv, kv)
        assert server.admin("/v1/admin/check").status_code == 200


def requests_of(server: Server, route: str) -> float:
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    prefix = f'kvtier_request_seconds_count{{route="{route}"}} '
    return next(
        (float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix)), 0.0
    )


async def _async_store(url: str, tokens: list[int], kv: torch.Tensor) -> StoreResult:
    async with AsyncClient(url, shared_memory=False) as client:
        return await client.store(tokens, kv)


def test_a_piece_left_short_ends_the_store_and_counts_the_rest_dropped() -> None:
    layout = KVLayout("tiny", LAYERS, HEADS, DIM, "float16", BT)  # `service_server`'s
    served = Pools(layout, (), None, 64 * 1024)  # room for about 14 blocks of 4 KiB a piece
    tokens, kv = tokens_of(1, 400), kv_of(400, seed=1)
    pieces = StorePieces(tokens, kv, 0, "layers", served)
    first = pieces.next()
    assert first is not None and first["start"] == 0 and pieces.sent % 4 == 0 < pieces.sent < 400
    sent = pieces.sent
    pieces.add({"cached_tokens": sent, "stored_tokens": sent, "dropped_tokens": 0,
                "pending_tokens": 0})  # fmt: skip
    second = pieces.next()
    assert second is not None and second["start"] == sent
    pieces.add({"cached_tokens": sent, "stored_tokens": 0, "dropped_tokens": pieces.sent - sent,
                "pending_tokens": 0})  # fmt: skip  # no room for it
    assert pieces.next() is None
    assert pieces.result == StoreResult(sent, sent, 400 - sent, 0)
    with pytest.raises(ReplyError, match="store"):
        StorePieces(tokens, kv, 0, "layers", served).add({"cached_tokens": 10**9,
            "stored_tokens": 0, "dropped_tokens": 0, "pending_tokens": 0})  # fmt: skip


async def _async_load(url: str, tokens: list[int]) -> LoadResult:
    async with AsyncClient(url, shared_memory=False) as client:
        return await client.load(tokens)


def test_a_server_that_never_moves_on_is_a_reply_error() -> None:
    packed = b"\x00" * 4 * 64
    pages = LoadPages(packed, 16)
    assert pages.next() == {"tokens": packed, "start": 16}
    with pytest.raises(ReplyError, match=r"load\.num_tokens"):
        pages.add({"num_tokens": 16, "truncated": True})  # no progress
    for bad in ({"num_tokens": 64, "truncated": True}, {"num_tokens": 8, "truncated": True},
                {"num_tokens": "32", "truncated": True}, {"truncated": 1}):  # fmt: skip
        with pytest.raises(ReplyError):
            LoadPages(packed, 16).add(bad)
    pages = LoadPages(packed, 0)
    pages.add({"num_tokens": 32, "truncated": True})
    assert pages.next() == {"tokens": packed, "start": 32}
    pages.add({"num_tokens": 48})
    assert pages.next() is None and [start for start, _ in pages.replies] == [0, 32]


@pytest.fixture
def two_tenants(tmp_path: Path) -> Iterator[Server]:
    service = {"max_body_bytes": 17 * MIB, "max_inflight_bytes": 34 * MIB, "body_timeout_s": 1.5}
    tenants = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
    config = write_config(tmp_path, gpu_blocks=4400, host_blocks=4400, service=service,
                          tenants=tenants)  # fmt: skip
    with running(config) as server:
        yield server


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_tenant_at_its_share_waits_and_another_does_not(two_tenants: Server) -> None:
    """a's share is 17 MiB (34 MiB over two tenants): a 16 MiB reply that a's client reads
    slowly (a chunk of 1 MiB in well under body_timeout_s, the whole in some 5 s) holds it."""
    server = two_tenants
    tokens, kv = tokens_of(60_000, 16 * 1024), kv_of(16 * 1024, seed=8)
    with Client(server.url, api_key=KEY_A, shared_memory=False) as a:
        a.store(tokens, kv)
    sock = slow_load(server, tokens, KEY_A)
    reader = threading.Thread(target=_read_slowly, args=(sock,))
    reader.start()
    time.sleep(0.5)
    small, small_kv = tokens_of(90_000, 2048), kv_of(2048, seed=6)  # 2 MiB: over a's share
    started = time.monotonic()
    with Client(server.url, api_key=KEY_B, shared_memory=False) as b:
        assert b.store(small, small_kv).stored_tokens == 2048
    assert time.monotonic() - started < 1.0  # b did not wait for a
    started = time.monotonic()
    with (
        Client(server.url, api_key=KEY_A, shared_memory=False) as a,
        pytest.raises(ServiceError) as refused,
    ):
        a.store(small, small_kv)
    assert (refused.value.status, refused.value.kind) == (503, "busy")
    assert time.monotonic() - started >= 1.4  # it waited for room, body_timeout_s
    reader.join(30)
    assert metrics(server)["kvtier_inflight_busy_total"] == 1
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    inflight = server.get("/v1/status", headers=admin).json()["inflight"]
    assert inflight["waits"] >= 1
    assert inflight == {"held_bytes": 0, "limit_bytes": 34 * MIB, "share_bytes": 17 * MIB,
                        "waits": inflight["waits"], "busy": 1}  # fmt: skip
    own = server.get("/v1/status", headers={"authorization": f"Bearer {KEY_A}"}).json()
    assert own["inflight"] == {"held_bytes": 0, "limit_bytes": 17 * MIB}  # a's own, no others'
    shown = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "status", "--url", server.url, "--key", ADMIN_KEY],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "1 refused busy" in shown, shown
    with Client(server.url, api_key=KEY_A, shared_memory=False) as a:  # room again
        assert a.store(small, small_kv).stored_tokens == 2048
    assert server.admin("/v1/admin/check").status_code == 200


def _read_slowly(sock: socket.socket) -> None:
    """1 MiB every 0.3 s, to the end."""
    with sock:
        while True:
            got = 0
            while got < MIB:
                chunk = sock.recv(MIB - got)
                if not chunk:
                    return
                got += len(chunk)
            time.sleep(0.3)
