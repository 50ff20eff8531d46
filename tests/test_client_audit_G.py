"""The clients against a hostile server's HTTP framing and a proxy of the environment (audit G).

Real sockets on threads of the test play the server: each answers every request with the raw
bytes a test gives, so a reply can say what no HTTP library of ours would write.

- A chunked reply whose chunk size is no hex count: `int(line, 16)` (http.client's) reads "-1",
  and the blocking `Client` then read the rest of the connection whole, past `max_reply_bytes`
  (a 300 MiB body under a 1 MiB limit raised its RSS by 600 MiB), or raised a raw `ValueError`
  for another negative size. Now a `TransportError` naming the line, nothing more read.
- A Content-Length of other digits than ASCII ("²": `str.isdigit` takes it, `int` does not) or
  with a control character `str.strip` drops ("51\\x1f"): a raw `ValueError` escaped
  `Client`'s call. Now a `TransportError` naming the header.
- `AsyncClient` (httpx) sent every request to a proxy named by `HTTP_PROXY` / `ALL_PROXY`, for
  a sidecar on 127.0.0.1 too: the proxy got the API key and the KV, and answered for the
  server. `Client` never did. Now both go to the URL itself.
- A `Client` whose construction failed (its server's `/v1/pools` refused) left its connection
  open for as long as the error lived (a caught error's traceback holds it): one socket, and a
  `ResourceWarning`, per failed construction. Now it is closed before the error is raised.
- An `AsyncClient` call cancelled while its new lane connection waited for the server's hello
  left that connection open (the server held it too) for as long as the error lived. Now it
  is closed when the cancellation passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator

import msgpack  # type: ignore[import-untyped]
import pytest
from fake_server import fake_servers

from kvtier.client import AsyncClient, Client, TransportError
from kvtier.client.transport import RequestHeaders, alone_post
from kvtier.errors import ReplyError

TOKENS = list(range(16))
LOOKUP = {"num_tokens": 0, "gpu_tokens": 0, "host_tokens": 0, "disk_tokens": 0}
BODY = msgpack.packb(LOOKUP, use_bin_type=True)
KEY = "audit-g-key-0123456789abcdef"


class RawServer:
    """Answers each request on a connection with `answer(connection)`, the request's head and
    body read first; records the request lines it was sent."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.answer = answer
        self.lines: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            reader = conn.makefile("rb")
            line = reader.readline()
            self.lines.append(line.decode("latin-1"))
            length = 0
            while (header := reader.readline()) not in (b"\r\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            reader.read(length)
            self.answer(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def raw_server(answer: Callable[[socket.socket], None]) -> Iterator[RawServer]:
    server = RawServer(answer)
    try:
        yield server
    finally:
        server.close()


def head(*headers: str) -> bytes:
    lines = ["HTTP/1.1 200 OK", "content-type: application/msgpack", *headers, "", ""]
    return "\r\n".join(lines).encode("latin-1")


# ---- chunk sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [b"-1", b"-85", b"0x10"])
def test_a_chunk_size_that_is_no_hex_count_is_a_transport_error_read_no_further(
    size: bytes,
) -> None:
    """Before: "-1" read the connection to its end (here it stays open: the call's whole
    `timeout_s`, and every byte sent, past `max_reply_bytes`); "-85" a raw `ValueError`."""

    def answer(conn: socket.socket) -> None:
        conn.sendall(head("transfer-encoding: chunked") + size + b"\r\n" + bytes(2 << 20))
        time.sleep(5)  # the connection stays open: only the client's limits end the call

    with raw_server(answer) as server:
        client = Client(server.url, shared_memory=False, timeout_s=3, max_reply_bytes=1 << 20)
        began = time.monotonic()
        with pytest.raises(TransportError, match="chunk size") as raised:
            client.lookup(TOKENS)
        assert time.monotonic() - began < 1.5, "read on, to the call's timeout"
        assert repr(size)[2:-1] in str(raised.value)
        client.close(timeout_s=0.1)


def test_a_well_formed_chunked_reply_is_still_read() -> None:
    """The control: hex sizes (either case, an extension) are read as before."""
    half = len(BODY) // 2
    chunks = b"%x;ext=1\r\n" % half + BODY[:half] + b"\r\n"
    chunks += b"%X\r\n" % (len(BODY) - half) + BODY[half:] + b"\r\n0\r\n\r\n"

    def answer(conn: socket.socket) -> None:
        conn.sendall(head("transfer-encoding: chunked") + chunks)

    with raw_server(answer) as server, Client(server.url, shared_memory=False) as client:
        assert client.lookup(TOKENS).num_tokens == 0


# ---- Content-Length ---------------------------------------------------------------------------


@pytest.mark.parametrize("length", ["\xb2", f"{len(BODY)}\x1f", f"1\xb9{len(BODY)}"])
def test_a_content_length_of_other_than_ascii_digits_is_a_transport_error(length: str) -> None:
    """Before: `str.isdigit` / `str.strip` passed it, `int` did not: a raw `ValueError`."""

    def answer(conn: socket.socket) -> None:
        conn.sendall(head(f"content-length: {length}") + BODY)

    with raw_server(answer) as server:
        client = Client(server.url, shared_memory=False, timeout_s=3)
        with pytest.raises(TransportError, match="Content-Length"):
            client.lookup(TOKENS)
        client.close(timeout_s=0.1)


# ---- proxies of the environment ---------------------------------------------------------------


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[RawServer]:
    """A "proxy" named by every proxy variable httpx reads, answering 502 to what reaches it."""

    def answer(conn: socket.socket) -> None:
        refusal = b'{"error": "proxy", "detail": "the proxy answered"}'
        conn.sendall(
            b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(refusal) + refusal
        )

    with raw_server(answer) as server:
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, server.url)
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        yield server


def test_async_client_goes_to_its_url_not_to_a_proxy_of_the_environment(
    proxy: RawServer,
) -> None:
    """Before: the proxy got the request (the API key in it) and its 502 was the answer."""
    with fake_servers() as fake:
        server = fake(lookup=(200, LOOKUP), release=(200, {}))

        async def calls() -> None:
            async with AsyncClient(server.url, api_key=KEY, shared_memory=False) as client:
                assert (await client.lookup(TOKENS)).num_tokens == 0
            # a give-back after `aclose()` goes on a connection of its own: direct too
            post = alone_post(server.url, RequestHeaders(KEY, None), 1 << 20)
            assert await post("/v1/release", {"request": "0" * 16}, "default", 3.0) == {}

        asyncio.run(calls())
        assert server.paths == ["/v1/lookup", "/v1/release"]
    assert proxy.lines == []


# ---- a construction that fails --------------------------------------------------------------


def test_a_failed_construction_closes_its_connection() -> None:
    """Before: the connection of the refused `/v1/pools` stayed open while the error lived."""
    refused = msgpack.packb({"layout": {"dtype": "no-such-dtype"}, "pools": []})
    ended = threading.Event()

    def answer(conn: socket.socket) -> None:
        conn.sendall(head(f"content-length: {len(refused)}") + refused)
        conn.settimeout(2.0)
        with contextlib.suppress(OSError):
            if conn.recv(1) == b"":  # the client closed its end
                ended.set()

    with raw_server(answer) as server:
        with pytest.raises(ReplyError, match=r"pools\.layout\.dtype") as raised:
            Client(server.url, timeout_s=3)
        assert ended.wait(1.5), "the refused client's connection is still open"
        assert raised.value is not None  # the error (and its traceback) still lives here


# ---- a call cancelled before the lane's hello -----------------------------------------------


def test_a_call_cancelled_before_the_lanes_hello_closes_that_connection() -> None:
    """Before: the cancelled call's lane connection stayed open while its error lived."""
    name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"
    lane = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lane.bind("\0" + name)  # an abstract socket, as the server's lane: it never says hello
    lane.listen(4)
    accepted: list[socket.socket] = []
    ended = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = lane.accept()
            accepted.append(conn)
            conn.settimeout(3.0)
            if conn.recv(1) == b"":  # the client closed its end
                ended.set()

    threading.Thread(target=serve, daemon=True).start()
    layout = {"dtype": "float16", "block_shape": [2, 2, 4, 2, 64], "block_bytes": 4096,
              "block_tokens": 4}  # fmt: skip
    try:
        with fake_servers() as fake:
            server = fake(pools=(200, {"layout": layout, "pools": [], "lane": name}))

            async def cancelled() -> None:
                client = AsyncClient(server.url, timeout_s=3)
                call = asyncio.create_task(client.lookup(TOKENS))
                while not accepted:  # its connection waits for the hello
                    await asyncio.sleep(0.005)
                call.cancel()
                with pytest.raises(asyncio.CancelledError) as raised:
                    await call
                assert await asyncio.to_thread(ended.wait, 1.5), "the connection is still open"
                assert raised.value is not None  # the error (and its traceback) lives here
                await client.aclose(timeout_s=0.5)

            asyncio.run(cancelled())
    finally:
        lane.close()
        for conn in accepted:
            conn.close()
