"""Audit R: what a slow, endless or short reply does to both clients (`kvtier/client/`).

Pins, against a raw server on real sockets (a thread of the test; no kvtier server code):
- a reply dripped a byte at a time (its body, or its status line), and an endless stream of
  `100 Continue` interim replies, end the call at `timeout_s` with a `TransportError` naming the
  path and the bound: `Client` and `AsyncClient` over HTTP, `LaneConnections` over the lane
  (before, `timeout_s` bounded each read, so such a server held a call for ever);
- `close()` / `aclose()` end within their bound while the flusher's give-back is being dripped
  (before, they waited for the flush, 21 s in the audit's run);
- a reply cut short of its Content-Length, or with a negative one, is a `TransportError` from
  `Client` as from `AsyncClient` (before, `Client` returned the short body);
- a truncated load reply that does not end on a block boundary is a `ReplyError` naming it
  (before, a server answering a token a reply made a load take a request a token).

Every call runs on a thread the test waits for a bounded time, so on the old code a test fails
rather than hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from kvtier.client import AsyncClient, Client
from kvtier.client.connections import TransportError
from kvtier.client.lane import LaneConnections
from kvtier.client.pages import LoadPages
from kvtier.errors import ReplyError
from kvtier.service import frames

Answer = Callable[[socket.socket, "threading.Event"], None]
"""What the raw server does with a connection once it has read a request: writes its reply."""

TIMEOUT_S = 0.5
GRACE_S = 1.0  # what a call may take past its bound (a loaded CI machine)
LOOKUP = {"num_tokens": 0, "gpu_tokens": 0, "host_tokens": 0, "disk_tokens": 0}
LAYERS, HEADS, DIM, BT = 1, 1, 2, 4
POOLS: dict[str, Any] = {
    "layout": {
        "dtype": "float32",
        "block_shape": [LAYERS, 2, BT, HEADS, DIM],
        "block_tokens": BT,
        "block_bytes": LAYERS * 2 * BT * HEADS * DIM * 4,
        "model": "served",
    },
    "pools": [],
    "lane": None,
}


def http(body: bytes, length: int | None = None, status: str = "200 OK") -> bytes:
    length = len(body) if length is None else length
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/msgpack\r\ncontent-length: {length}"
    return head.encode() + b"\r\n\r\n" + body


def sent(data: bytes, then_close: bool = False) -> Answer:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(data)
        if then_close:
            conn.close()

    return answer


def dripped(data: bytes, head: int = 0) -> Answer:
    """`data`'s first `head` bytes at once, then a byte every 0.1 s (a 60-byte body: 6 s)."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(data[:head])
        for i in range(head, len(data)):
            if stop.wait(0.1):
                return
            conn.sendall(data[i : i + 1])

    return answer


def continuing(conn: socket.socket, stop: threading.Event) -> None:
    """`100 Continue` every 0.05 s, and never a reply."""
    while not stop.wait(0.05):
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")


def unanswered(conn: socket.socket, stop: threading.Event) -> None:
    conn.close()


class RawServer:
    """HTTP/1.1 on a thread: each request read whole (head, Content-Length body), its path
    recorded in `paths`, then answered by `answers[path]`; keep-alive until an answer closes."""

    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = answers
        self.paths: list[str] = []
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            data = b""
            while not self.stop.is_set():
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, data = data.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                length = next(
                    (int(v) for k, _, v in (x.partition(":") for x in lines[1:])
                     if k.strip().lower() == "content-length"),
                    0,
                )  # fmt: skip
                while len(data) < length:
                    data += conn.recv(65536)
                data = data[length:]
                path = lines[0].split(" ")[1].split("?")[0]
                self.paths.append(path)
                self.answers.get(path, unanswered)(conn, self.stop)
                if conn.fileno() < 0:
                    return

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[[dict[str, Answer]], RawServer]]:
    servers: list[RawServer] = []

    def start(answers: dict[str, Answer]) -> RawServer:
        servers.append(RawServer(answers))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def within(bound_s: float, call: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds taken, what `call` returned or raised), run on a thread waited for `bound_s`:
    an `AssertionError` if it is still running then (it is left behind, a daemon)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # the test inspects it
            out.append(exc)

    began = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    taken = time.monotonic() - began
    assert not thread.is_alive(), f"still running after {taken:.1f} s (bound {bound_s} s)"
    return taken, out[0]


def in_loop(make: Callable[[], Coroutine[Any, Any, Any]]) -> Callable[[], Any]:
    return lambda: asyncio.run(make())


def lookup_blocking(url: str) -> Any:
    client = Client(url, shared_memory=False, timeout_s=TIMEOUT_S)
    try:
        return client.lookup(list(range(8)))
    finally:
        client.close()


async def lookup_async(url: str) -> Any:
    async with AsyncClient(url, shared_memory=False, timeout_s=TIMEOUT_S) as client:
        return await client.lookup(list(range(8)))


LOOKERS: dict[str, Callable[[str], Any]] = {
    "Client": lookup_blocking,
    "AsyncClient": lambda url: asyncio.run(lookup_async(url)),
}
SLOW: dict[str, Answer] = {
    "body dripped": dripped(http(msgpack.packb({**LOOKUP, "x" * 40: 1})), head=80),
    "status line dripped": dripped(http(msgpack.packb(LOOKUP))),
    "100 Continue for ever": continuing,
}


@pytest.mark.parametrize("client", LOOKERS)
@pytest.mark.parametrize("answer", SLOW)
def test_a_slow_reply_ends_the_call_at_timeout_s(
    serve: Callable[[dict[str, Answer]], RawServer], client: str, answer: str
) -> None:
    server = serve({"/v1/lookup": SLOW[answer]})
    taken, result = within(TIMEOUT_S + GRACE_S, lambda: LOOKERS[client](server.url))
    assert isinstance(result, TransportError), result
    assert "/v1/lookup" in str(result) and "timeout_s (0.5 s" in str(result), str(result)
    assert taken >= TIMEOUT_S - 0.05


SHORT: dict[str, Answer] = {
    "cut short of its Content-Length": sent(http(msgpack.packb(LOOKUP), length=1000), True),
    "a negative Content-Length": sent(http(msgpack.packb(LOOKUP), length=-5), True),
}


@pytest.mark.parametrize("client", LOOKERS)
@pytest.mark.parametrize("answer", SHORT)
def test_a_reply_short_of_its_length_is_a_transport_error(
    serve: Callable[[dict[str, Answer]], RawServer], client: str, answer: str
) -> None:
    server = serve({"/v1/lookup": SHORT[answer]})
    _, result = within(TIMEOUT_S + GRACE_S, lambda: LOOKERS[client](server.url))
    assert isinstance(result, TransportError), result
    assert "/v1/lookup" in str(result)


def test_a_lane_reply_dripped_ends_the_call_at_timeout_s() -> None:
    """The blocking client's lane (`AsyncLaneConnections` was bounded already)."""
    name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(4)
    stop = threading.Event()

    def serve_lane() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.sendall(frames.frame(frames.HELLO))
                (length,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
                conn.recv(length, socket.MSG_WAITALL)
                dripped(frames.frame([200, msgpack.packb({**LOOKUP, "x" * 40: 1})]))(conn, stop)

    threading.Thread(target=serve_lane, daemon=True).start()
    lane = LaneConnections(name, TIMEOUT_S, 1 << 20)
    try:
        _, result = within(
            TIMEOUT_S + GRACE_S, lambda: lane.request("/v1/lookup", msgpack.packb({}), {})
        )
    finally:
        stop.set()
        listener.close()
    assert isinstance(result, TransportError), result
    assert "/v1/lookup" in str(result) and "timeout_s (0.5 s" in str(result), str(result)


RELEASE_DRIPPED = {
    "/v1/prefetch": unanswered,  # the reply lost: a give-back owed, sent by the flusher at once
    "/v1/release": dripped(http(msgpack.packb({"x" * 60: 1})), head=80),
}


def wait_for_path(server: RawServer, path: str) -> None:
    end = time.monotonic() + 3.0
    while path not in server.paths:
        assert time.monotonic() < end, f"{path} never asked: {server.paths}"
        time.sleep(0.01)


def test_close_ends_within_its_bound_while_a_give_back_is_dripped(
    serve: Callable[[dict[str, Answer]], RawServer],
) -> None:
    server = serve(RELEASE_DRIPPED)
    client = Client(server.url, shared_memory=False, timeout_s=TIMEOUT_S)
    with pytest.raises(TransportError):
        client.prefetch(list(range(8)), wait=False)
    wait_for_path(server, "/v1/release")
    _, result = within(2 * TIMEOUT_S + GRACE_S, client.close)
    assert result is None


def test_aclose_ends_within_its_bound_while_a_give_back_is_dripped(
    serve: Callable[[dict[str, Answer]], RawServer],
) -> None:
    server = serve(RELEASE_DRIPPED)

    async def run() -> None:
        client = AsyncClient(server.url, shared_memory=False, timeout_s=TIMEOUT_S)
        with pytest.raises(TransportError):
            await client.prefetch(list(range(8)), wait=False)
        while "/v1/release" not in server.paths:
            await asyncio.sleep(0.01)
        await client.aclose()

    _, result = within(3.0 + 2 * TIMEOUT_S + GRACE_S, in_loop(run))
    assert result is None


def one_token(conn: socket.socket, stop: threading.Event) -> None:
    """A load reply of one token, truncated (its start unread: always one token from 0 on)."""
    kv = struct.pack("<f", 1.0) * (LAYERS * 2 * HEADS * DIM)
    body = {"num_tokens": 1, "truncated": True, "kv": kv, "dtype": "float32"}
    conn.sendall(http(msgpack.packb({**body, "shape": [LAYERS, 2, 1, HEADS, DIM]})))


def test_a_truncated_load_reply_off_a_block_boundary_is_a_reply_error(
    serve: Callable[[dict[str, Answer]], RawServer],
) -> None:
    server = serve({"/v1/pools": sent(http(msgpack.packb(POOLS))), "/v1/load": one_token})

    async def run() -> Any:
        async with AsyncClient(server.url, shared_memory=False, timeout_s=5.0) as client:
            return await client.load(list(range(4 * BT)))

    _, result = within(5.0, in_loop(run))
    assert isinstance(result, ReplyError), result
    assert "load.num_tokens: got 1" in str(result) and f"of {BT} tokens" in str(result)
    assert server.paths.count("/v1/load") == 1


def test_load_pages_refuse_a_truncated_page_off_a_block_boundary() -> None:
    pages = LoadPages(struct.pack("<16i", *range(16)), 0, block_tokens=BT)
    pages.add({"num_tokens": BT, "truncated": True})  # a whole block: asked on from it
    assert pages.next() == {"tokens": pages.packed, "start": BT}
    with pytest.raises(ReplyError, match=rf"got {BT + 1} in a truncated reply from {BT}"):
        pages.add({"num_tokens": BT + 1, "truncated": True})
