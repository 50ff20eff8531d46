"""An `AsyncClient` across event loops, and a give-back after close, against a real
`kvtier serve` (audit W).

Pinned here:
- an `AsyncClient` belongs to the event loop of its first call: a call from another loop (a
  second `asyncio.run`) is a `ClosedError` naming the misuse, and sends nothing (before, a raw
  `RuntimeError('Event loop is closed')` came out of every call, over the lane after its frame
  was written, and over HTTP);
- `aclose()` works from any loop: from a second loop it closes the client (every later call a
  `ClosedError`; before, it raised the same raw `RuntimeError` and left the client open, a
  lookup still answered over the lane) and releases what the first loop's loads owed, on
  connections of its own;
- a give-back after close fits in its call's `timeout_s`: a prefetch timed out by a stopped
  server, its client closed meanwhile, ends by `timeout_s` (before, its give-back waited a
  whole `timeout_s` more on a connection of its own), for `AsyncClient` and `Client` alike;
- a grant whose reply is lost to the call's own timeout after close is still given back: that
  give-back has at least `owing.GRACE_S`, so a reachable server ends the lease at once and the
  call ends by `timeout_s + GRACE_S` (before, a call that timed out had no time left, sent
  nothing, and the lease stayed to its ttl), for both clients;
- a cancelled `aclose()` leaves the client closed and what it owed still owed: a second
  `aclose()` gives it back on connections of its own (before, its requests went through the
  closed client's own, refused, and the debt was dropped: the lease stayed to its ttl).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from service_server import ADMIN_KEY, BT, Server, kv_of, running, tokens_of, write_config
from test_lease_leaks import Relay

from kvtier.client import AsyncClient, Client, owing
from kvtier.errors import ClosedError

KEY = "audit-w-key-a-0123456789"
TIMEOUT_S = 1.5  # the stalled calls' bound: a call past ~2x it waited on a give-back


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(tmp_path_factory.mktemp("loops"), tenants={"a": {"api_keys": [KEY]}})
    with running(config) as live:
        yield live


def _held(server: Server) -> dict[str, int]:
    index = server.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    return {kind: index["index"][kind] for kind in ("leases", "reservations")}


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_call_from_another_event_loop_is_a_closed_error_and_sends_nothing(
    server: Server, shared_memory: bool
) -> None:
    tokens, kv = tokens_of(10_000 + 1000 * shared_memory, 2 * BT), kv_of(2 * BT, seed=1)
    client = AsyncClient(server.url, api_key=KEY, shared_memory=shared_memory, timeout_s=5)

    async def first() -> None:
        await client.store(tokens, kv)
        assert (await client.lookup(tokens)).num_tokens == 2 * BT

    asyncio.run(first())
    time.sleep(0.2)  # the first loop's owed release, if any, is past due: none is sent
    before = _held(server)

    async def second() -> list[str]:
        calls: list[Any] = [
            client.lookup(tokens),
            client.store(tokens_of(20_000, BT), kv_of(BT, seed=2)),
            client.load(tokens),
            client.prefetch(tokens),
            client.reserve(tokens_of(30_000, BT)),
            client.status(),
        ]
        shown = []
        for call in calls:
            with pytest.raises(ClosedError) as caught:
                await call
            shown.append(str(caught.value))
        return shown

    for message in asyncio.run(second()):
        assert "event loop of its first call" in message and "no request is sent" in message
    assert _held(server) == before  # nothing prefetched nor reserved
    with Client(server.url, api_key=KEY, shared_memory=False) as other:
        assert other.lookup(tokens_of(20_000, BT)).num_tokens == 0  # that store sent nothing
    asyncio.run(client.aclose())


def test_aclose_from_another_event_loop_closes_the_client(server: Server) -> None:
    tokens = tokens_of(40_000, 2 * BT)
    client = AsyncClient(server.url, api_key=KEY, timeout_s=5)

    async def first() -> None:
        await client.store(tokens, kv_of(2 * BT, seed=3))
        await client.lookup(tokens)  # an idle lane connection of this loop kept

    asyncio.run(first())
    asyncio.run(client.aclose())  # before: RuntimeError('Event loop is closed')

    async def later() -> None:
        with pytest.raises(ClosedError, match="the client is closed"):
            await client.lookup(tokens)  # before: answered over the lane
        await client.aclose()  # again: nothing left to close

    asyncio.run(later())


def test_aclose_from_another_event_loop_releases_what_the_first_owed(server: Server) -> None:
    tokens = tokens_of(50_000, 2 * BT)
    client = AsyncClient(server.url, api_key=KEY, timeout_s=5)

    async def first() -> None:
        await client.store(tokens, kv_of(2 * BT, seed=4))
        assert (await client.load(tokens)).num_tokens == 2 * BT  # its release owed

    before = _held(server)["leases"]
    asyncio.run(first())  # the loop ends before the release falls due
    assert _held(server)["leases"] == before + 1
    asyncio.run(client.aclose(timeout_s=2))
    assert _held(server)["leases"] == before  # released at close, not left to its ttl


def _stalled(server: Server, run: Any) -> float:
    """Seconds from the server's SIGSTOP until `run()` (calls in flight, then a close) ended;
    the server resumed after."""
    server.process.send_signal(signal.SIGSTOP)
    try:
        began = time.monotonic()
        run()
        return time.monotonic() - began
    finally:
        server.process.send_signal(signal.SIGCONT)


def test_a_give_back_after_aclose_fits_in_its_call_timeout(server: Server) -> None:
    tokens = tokens_of(60_000, 2 * BT)

    async def load(client: AsyncClient) -> None:
        with contextlib.suppress(Exception):  # timed out, or closed: its time is what counts
            await client.load(tokens)

    async def main() -> float:
        client = AsyncClient(server.url, api_key=KEY, timeout_s=TIMEOUT_S)
        await client.store(tokens, kv_of(2 * BT, seed=5))
        await client.load(tokens)  # a lane connection kept: the next prefetch is sent on it
        server.process.send_signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            tasks = [asyncio.create_task(load(client)) for _ in range(3)]
            await asyncio.sleep(0.1)
            await client.aclose(timeout_s=0.2)
            await asyncio.gather(*tasks)
            return time.monotonic() - began
        finally:
            server.process.send_signal(signal.SIGCONT)

    took = asyncio.run(main())
    assert took < TIMEOUT_S + 0.8, took  # before: 2 x TIMEOUT_S, a give-back's own bound


def test_a_give_back_after_close_fits_in_its_call_timeout_blocking_client(
    server: Server,
) -> None:
    tokens = tokens_of(70_000, 2 * BT)
    client = Client(server.url, api_key=KEY, timeout_s=TIMEOUT_S)
    client.store(tokens, kv_of(2 * BT, seed=6))
    client.load(tokens)  # a lane connection kept: the next prefetch is sent on it

    def load() -> None:
        with contextlib.suppress(Exception):  # timed out, or closed: its time is what counts
            client.load(tokens)

    def run() -> None:
        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(0.1)
        client.close(timeout_s=0.2)
        thread.join()

    took = _stalled(server, run)
    assert took < TIMEOUT_S + 0.8, took  # before: 2 x TIMEOUT_S, a give-back's own bound


LATE_TIMEOUT_S = 1.0  # the call whose reply is held past it


def _late_reply(server: Server, call: Any, close: Any) -> float:
    """`call(url)` through a relay that holds the server's reply, `close()` once that reply is
    held; the seconds `call` took. The reply held past the call's timeout: lost."""
    relay = Relay(int(server.url.rsplit(":", 1)[1]))
    took: list[float] = []

    def run() -> None:
        began = time.monotonic()
        with contextlib.suppress(Exception):  # timed out, or closed: what it left counts
            call(relay.url)
        took.append(time.monotonic() - began)

    try:
        relay.mode = "hold"
        thread = threading.Thread(target=run)
        thread.start()
        assert relay.replied.wait(10)  # granted: the reply is held
        close()
        thread.join(10)
        assert took
        return took[0]
    finally:
        relay.close()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_grant_whose_reply_timed_out_after_close_is_given_back(
    server: Server, asynchronous: bool
) -> None:
    tokens = tokens_of(80_000 + 1000 * asynchronous, 2 * BT)
    with Client(server.url, api_key=KEY, shared_memory=False) as writer:
        writer.store(tokens, kv_of(2 * BT, seed=7))
    before = _held(server)["leases"]
    loop = asyncio.new_event_loop()
    clients: list[Any] = []

    def call(url: str) -> None:
        if asynchronous:
            client = AsyncClient(url, api_key=KEY, shared_memory=False, timeout_s=LATE_TIMEOUT_S)
            clients.append(client)
            loop.run_until_complete(client.prefetch(tokens, ttl_s=600))
        else:
            clients.append(Client(url, api_key=KEY, shared_memory=False, timeout_s=LATE_TIMEOUT_S))
            clients[0].prefetch(tokens, ttl_s=600)

    def close() -> None:
        time.sleep(0.2)
        if asynchronous:  # from another loop (its own closes httpx's pool: the call fails)
            asyncio.run(clients[0].aclose(timeout_s=0.2))
        else:
            clients[0].close(timeout_s=0.2)

    try:
        took = _late_reply(server, call, close)
    finally:
        loop.close()
    deadline = time.monotonic() + 3.0
    while _held(server)["leases"] != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _held(server)["leases"] == before  # before: the lease held to its 600 s ttl
    assert took < LATE_TIMEOUT_S + owing.GRACE_S + 0.5, took


class Gate(Relay):
    """`Relay` whose requests never reach the server while `shut` is set (swallowed)."""

    def __init__(self, port: int) -> None:
        self.shut = threading.Event()
        super().__init__(port)

    def _copy(self, source: socket.socket, sink: socket.socket) -> None:
        """`Relay._copy` of the client's bytes, swallowed while `shut` is set."""
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not self.shut.is_set():
                    sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_a_give_back_owed_survives_a_cancelled_aclose(server: Server) -> None:
    tokens = tokens_of(90_000, 2 * BT)
    with Client(server.url, api_key=KEY, shared_memory=False) as writer:
        writer.store(tokens, kv_of(2 * BT, seed=8))
    before = _held(server)["leases"]
    gate = Gate(int(server.url.rsplit(":", 1)[1]))

    async def main() -> None:
        client = AsyncClient(gate.url, api_key=KEY, shared_memory=False, timeout_s=5)
        await client.lookup(tokens)  # its connection up
        gate.mode = "hold"
        prefetch = asyncio.create_task(client.prefetch(tokens, ttl_s=600))
        assert await asyncio.to_thread(gate.replied.wait, 10)  # granted: the reply held
        gate.shut.set()  # the give-back now owed never reaches the server
        prefetch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prefetch
        assert _held(server)["leases"] == before + 1
        closing = asyncio.create_task(client.aclose(timeout_s=5))
        await asyncio.sleep(0.3)  # sending the give-back, which hangs
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        with pytest.raises(ClosedError, match="the client is closed"):
            await client.lookup(tokens)
        gate.shut.clear()
        await client.aclose(timeout_s=2)  # before: nothing sent, the give-back dropped

    try:
        asyncio.run(main())
        assert _held(server)["leases"] == before  # before: held to its 600 s ttl
    finally:
        gate.close()
