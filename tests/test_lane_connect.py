"""A client's connect to the lane waits for room in the server's accept queue, within its call's
`timeout_s` (`client/lane_frames.connect`): before, the socket had a timeout (so it was
non-blocking) and a queue full for a moment failed the connect at once with EAGAIN, and the
client took HTTP for `RETRY_S` (30 s). A full queue comes of a burst of connects, or of another
user's processes flooding the abstract socket, which any local user can reach (audit AW: a
real `Client` made 0 of 2,073 lookups over the lane under two such processes).

The lane here is the test's own (a real abstract Unix socket with a backlog of 1, which
accepts nothing until `opens` is set, then answers the lane's hello and each call)."""

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
from kvtier.service import frames


@contextlib.contextmanager
def full_lane() -> Iterator[tuple[str, threading.Event]]:
    """A lane whose accept queue is full (its backlog taken by raw connects) until `opens` is
    set; then it accepts, says hello and answers every call `[200, path]`."""
    name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    fillers: list[socket.socket] = []
    while True:  # fill the queue: the next connect finds no room (EAGAIN)
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        filler.setblocking(False)
        try:
            filler.connect("\0" + name)
        except BlockingIOError:
            filler.close()
            break
        fillers.append(filler)
    opens = threading.Event()
    taken: list[socket.socket] = []

    def serve(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(frames.frame(frames.HELLO))
            while True:
                (length,) = frames.LENGTH.unpack(frames.read_exactly(sock, frames.LENGTH.size))
                path = msgpack.unpackb(frames.read_exactly(sock, length))[0]
                sock.sendall(frames.frame([200, path.encode()]))

    def accept() -> None:
        opens.wait()
        with contextlib.suppress(OSError):
            while True:
                sock, _ = listener.accept()
                taken.append(sock)
                threading.Thread(target=serve, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield name, opens
    finally:
        opens.set()
        listener.close()
        for sock in fillers + taken:
            sock.close()


def _open_later(opens: threading.Event, after_s: float) -> None:
    threading.Timer(after_s, opens.set).start()


def test_a_connect_to_a_full_queue_waits_for_room_within_the_call() -> None:
    with full_lane() as (name, opens):
        lane = LaneConnections(name, timeout_s=5.0, max_reply_bytes=1 << 20)
        try:
            _open_later(opens, 0.3)
            began = time.monotonic()
            reply = lane.request("/v1/lookup", b"", {})
            assert reply is not None and reply.content == b"/v1/lookup"  # was None: HTTP
            assert 0.25 <= time.monotonic() - began < 4.0
            assert not lane.dead
        finally:
            lane.close()


def test_a_connect_to_a_queue_full_past_the_call_takes_http_within_its_timeout() -> None:
    with full_lane() as (name, _):
        lane = LaneConnections(name, timeout_s=0.4, max_reply_bytes=1 << 20)
        try:
            began = time.monotonic()
            assert lane.request("/v1/lookup", b"", {}) is None  # unsent: HTTP
            assert 0.3 <= time.monotonic() - began < 2.0
            assert lane.dead
        finally:
            lane.close()


def test_an_async_connect_to_a_full_queue_waits_for_room_within_the_call() -> None:
    async def main(name: str, opens: threading.Event) -> tuple[object, float, bool]:
        lane = AsyncLaneConnections(name, timeout_s=5.0, max_reply_bytes=1 << 20)
        try:
            _open_later(opens, 0.3)
            began = time.monotonic()
            reply = await lane.request("/v1/lookup", b"", {})
            return reply, time.monotonic() - began, lane.dead
        finally:
            await lane.aclose()

    with full_lane() as (name, opens):
        reply, took, dead = asyncio.run(main(name, opens))
    assert reply is not None and not dead
    assert 0.25 <= took < 4.0


@pytest.mark.parametrize("kind", ["blocking", "async"])
def test_a_lane_that_is_not_there_is_given_up_at_once(kind: str) -> None:
    name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"  # nothing listens on it
    began = time.monotonic()
    if kind == "blocking":
        lane = LaneConnections(name, timeout_s=5.0, max_reply_bytes=1 << 20)
        assert lane.request("/v1/lookup", b"", {}) is None
    else:
        alane = AsyncLaneConnections(name, timeout_s=5.0, max_reply_bytes=1 << 20)
        assert asyncio.run(alane.request("/v1/lookup", b"", {})) is None
    assert time.monotonic() - began < 0.5  # refused: no wait for room
