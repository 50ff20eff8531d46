"""A client's calls past its `MOST_CALLS` slots of the lane (`client/lane_slots.py`): a short
call waits for a slot, first come first served, up to `SLOT_WAIT_S` within its `timeout_s`,
then takes HTTP; a call the server may hold for seconds (`WAITING`) never waits, nor does a
short call while those hold every slot. Before, every call past the 64 took HTTP at once (a
burst of 500 async lookups: 0.8-1.0 s, mostly over HTTP).

A lane server of the test's own (a real abstract Unix socket speaking the lane's frames, each
call answered after a delay its path sets) counts the calls it holds at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import msgpack  # type: ignore[import-untyped]
import pytest

from kvtier.client.lane import AsyncLaneConnections, LaneConnections
from kvtier.client.lane_slots import MOST_CALLS, SLOT_WAIT_S
from kvtier.errors import ClosedError
from kvtier.service import frames


class LaneServer:
    """Answers each call `[200, path]` after `delays[path]` seconds; `most` is the most calls
    it held at once, `answered` how many it answered."""

    def __init__(self, delays: dict[str, float]) -> None:
        self.name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"
        self.delays = delays
        self.held = self.most = self.answered = 0
        self.lock = threading.Lock()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.name)
        self.listener.listen(1024)
        self.open: list[socket.socket] = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                sock, _ = self.listener.accept()
                self.open.append(sock)
                threading.Thread(target=self.serve, args=(sock,), daemon=True).start()

    def serve(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(frames.frame(frames.HELLO))
            while True:
                (length,) = frames.LENGTH.unpack(frames.read_exactly(sock, frames.LENGTH.size))
                path = msgpack.unpackb(frames.read_exactly(sock, length))[0]
                with self.lock:
                    self.held += 1
                    self.most = max(self.most, self.held)
                time.sleep(self.delays[path])
                with self.lock:
                    self.held -= 1
                    self.answered += 1
                sock.sendall(frames.frame([200, path.encode()]))

    def close(self) -> None:
        self.listener.close()
        for sock in self.open:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@contextlib.contextmanager
def lane_server(**delays: float) -> Iterator[LaneServer]:
    server = LaneServer({f"/v1/{path}": delay for path, delay in delays.items()})
    try:
        yield server
    finally:
        server.close()


def _burst(lane: LaneConnections, path: str, calls: int) -> list[object]:
    replies: list[object] = [None] * calls
    start = threading.Barrier(calls)

    def call(i: int) -> None:
        start.wait()
        replies[i] = lane.request(path, b"", {})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return replies


@contextlib.contextmanager
def all_slots_held(path: str, **delays: float) -> Iterator[tuple[LaneServer, LaneConnections]]:
    """A lane whose calls of `path` the server holds for their delay, and a client with all
    `MOST_CALLS` of its slots held by such calls (a thread's), for the block."""
    with lane_server(**delays) as server:
        lane = LaneConnections(server.name, timeout_s=30.0, max_reply_bytes=1 << 20)
        holders = threading.Thread(target=_burst, args=(lane, path, MOST_CALLS))
        holders.start()
        try:
            deadline = time.monotonic() + 30
            while server.held < MOST_CALLS and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.held == MOST_CALLS
            yield server, lane
        finally:
            holders.join(timeout=30)
            lane.close()


def test_a_burst_past_the_slots_waits_for_the_lane_from_threads() -> None:
    with lane_server(lookup=0.01) as server:
        lane = LaneConnections(server.name, timeout_s=30.0, max_reply_bytes=1 << 20)
        try:
            replies = _burst(lane, "/v1/lookup", 200)
        finally:
            lane.close()
    assert all(reply is not None for reply in replies)  # was: ~136 of them None (HTTP)
    assert server.answered == 200 and lane.calls == 200
    assert server.most <= MOST_CALLS


def test_a_burst_past_the_slots_waits_for_the_lane_from_tasks() -> None:
    async def burst(name: str) -> list[object]:
        lane = AsyncLaneConnections(name, timeout_s=30.0, max_reply_bytes=1 << 20)
        try:
            return list(
                await asyncio.gather(*(lane.request("/v1/lookup", b"", {}) for _ in range(500)))
            )
        finally:
            await lane.aclose()

    with lane_server(lookup=0.005) as server:
        replies = asyncio.run(burst(server.name))
    assert all(reply is not None for reply in replies)
    assert server.answered == 500 and server.most <= MOST_CALLS


def test_calls_that_wait_on_the_server_never_hold_short_calls_in_line() -> None:
    with all_slots_held("/v1/leases", leases=1.5, lookup=0.0) as (server, lane):
        for path in ("/v1/lookup", "/v1/leases"):
            began = time.monotonic()
            assert lane.request(path, b"", {}) is None  # HTTP at once, unsent
            assert time.monotonic() - began < 0.2, path
    assert server.answered == MOST_CALLS


@pytest.mark.parametrize("timeout_s", [30.0, 0.3])
def test_a_short_call_waits_at_most_its_bound_then_takes_http(timeout_s: float) -> None:
    with all_slots_held("/v1/lookup", lookup=1.6) as (server, held):
        held.timeout_s = timeout_s
        began = time.monotonic()
        assert held.request("/v1/lookup", b"", {}) is None
        waited = time.monotonic() - began
    bound = min(SLOT_WAIT_S, timeout_s)
    assert bound - 0.05 <= waited <= bound + 0.5, waited
    assert server.answered == MOST_CALLS  # the one past them was never sent


def test_a_cancel_that_comes_with_the_slot_cancels_the_waiting_call() -> None:
    """A slot freed (the waiter's future done) and the task cancelled before it ran again:
    `asyncio.wait_for` on Python 3.11 returned the result and the call went on (review 1)."""

    async def main() -> tuple[bool, int]:
        lane = AsyncLaneConnections("kvtier-lane-1-00000000", timeout_s=5.0, max_reply_bytes=64)
        slots = lane._slots
        slots.busy = slots.short = MOST_CALLS  # every slot held
        call = asyncio.create_task(lane.request("/v1/lookup", b"", {}))
        await asyncio.sleep(0.05)  # it waits in line
        assert len(slots.line) == 1
        slots.give(True)  # a slot frees: its future is done
        call.cancel()  # before it runs again
        try:
            await call
        except asyncio.CancelledError:
            return True, slots.busy
        return False, slots.busy

    cancelled, busy = asyncio.run(main())
    assert cancelled  # was: the call went on, its cancel lost
    assert busy == MOST_CALLS - 1  # the slot it did not take is free


@pytest.mark.parametrize("how", ["retire", "close"])
def test_calls_in_line_stop_waiting_when_the_lane_is_retired_or_closed(how: str) -> None:
    outcome: list[object] = []
    with all_slots_held("/v1/lookup", lookup=1.5) as (_, lane):

        def waiter() -> None:
            try:
                outcome.append(lane.request("/v1/lookup", b"", {}))
            except ClosedError as exc:
                outcome.append(exc)

        began = time.monotonic()
        waiting = threading.Thread(target=waiter)
        waiting.start()
        time.sleep(0.1)
        getattr(lane, how)()
        waiting.join(timeout=5)
        took = time.monotonic() - began
    assert took < 0.5, took  # was: its whole wait (1 s)
    if how == "retire":
        assert outcome == [None]  # HTTP, unsent
    else:
        assert len(outcome) == 1 and isinstance(outcome[0], ClosedError)
