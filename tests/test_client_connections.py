"""The blocking client's keep-alive connections (`kvtier/client/connections.py`) against real
HTTP servers on loopback: connections reused across calls and threads, an idle connection the
server closed replaced before it is used, and every way a call can fail at the transport as a
`TransportError` naming the call. Both clients against a server whose reply never ends: a
`ReplyError` at `max_reply_bytes`, with no more than that read."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.client import Client, TransportError
from kvtier.client.connections import Connections
from kvtier.errors import ClosedError, ReplyError


class Echo(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive: answers each request with its method, path and body; closes the
    connection after `close_after` requests on it without saying so (as a server closes one
    idle too long)."""

    protocol_version = "HTTP/1.1"
    close_after = 0  # 0: never
    connections: list[int] = []  # noqa: RUF012 (one list per test: `echo` resets it)

    def setup(self) -> None:
        super().setup()
        type(self).connections.append(id(self))
        self.served = 0

    def answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        reply = f"{self.command} {self.path} ".encode() + body
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
        self.served += 1
        if self.close_after and self.served >= self.close_after:
            self.close_connection = True

    do_GET = do_POST = answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo() -> Iterator[tuple[str, type[Echo]]]:
    handler = type("EchoOnce", (Echo,), {"connections": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_calls_reuse_a_connection_and_threads_each_take_their_own(
    echo: tuple[str, type[Echo]],
) -> None:
    url, handler = echo
    conns = Connections(url, 10.0)
    for i in range(5):
        reply = conns.request("POST", f"/a/{i}", b"x" * i, {"content-type": "text/plain"})
        assert (reply.status, reply.content, reply.path) == (
            200,
            f"POST /a/{i} ".encode() + b"x" * i,
            f"/a/{i}",
        )
    assert len(handler.connections) == 1  # one connection, kept alive

    errors: list[BaseException] = []

    def hammer(t: int) -> None:
        try:
            for i in range(40):
                body = f"{t}-{i}".encode()
                reply = conns.request("POST", f"/t/{t}", body, {})
                assert reply.content == f"POST /t/{t} ".encode() + body  # its own reply
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert 1 < len(handler.connections) <= 7  # at most one more per thread in flight
    conns.close()
    with pytest.raises(ClosedError, match="the client is closed"):
        conns.request("GET", "/after", None, {})


def test_an_idle_connection_the_server_closed_is_replaced_before_it_is_used(
    echo: tuple[str, type[Echo]],
) -> None:
    url, handler = echo
    handler.close_after = 1  # the server hangs up after each answer, saying nothing
    conns = Connections(url, 10.0)
    for i in range(4):
        time.sleep(0.05)  # the close reaches the client's socket
        assert conns.request("GET", f"/{i}", None, {}).content == f"GET /{i} ".encode()
    assert len(handler.connections) == 4  # a fresh connection each time, none sent dead


def _one_shot_server(answer: bytes | None) -> tuple[str, socket.socket]:
    """A listener that reads one request and sends `answer` (None: nothing, ever) on it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        request = b""  # the whole request: a close with bytes unread would reset, not end
        while b"\r\n\r\n" not in request:
            request += conn.recv(65536)
        head, _, body = request.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += conn.recv(65536)
        if answer is not None:
            conn.sendall(answer)
            conn.close()
        else:
            time.sleep(3)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


@pytest.mark.parametrize(
    ("answer", "why"),
    [(b"hello, this is not HTTP\r\n\r\n", "BadStatusLine"), (b"", "RemoteDisconnected"),
     (None, "TimeoutError")],
)  # fmt: skip
def test_a_failed_call_is_a_transport_error_naming_it(answer: bytes | None, why: str) -> None:
    url, listener = _one_shot_server(answer)
    conns = Connections(url, 0.5)
    with pytest.raises(TransportError, match=f"POST /v1/lookup: .*{why}"):
        conns.request("POST", "/v1/lookup", b"{}", {})
    listener.close()


def test_a_client_of_a_server_that_is_not_there_raises_a_transport_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free, and nobody listens once it is closed
    with pytest.raises(TransportError, match="GET /v1/pools: ConnectionRefusedError"):
        Client(f"http://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="expected http://host:port"):
        Connections("ftp://127.0.0.1:1", 1.0)


def test_an_answer_sent_before_the_body_was_read_is_returned_not_the_broken_pipe() -> None:
    """A server that refuses a body by its length (413), answers at once and closes with the
    body unread: the kernel resets the connection and the client's send fails. The answer is
    there to read all the same, and is what the call returns."""
    listener = socket.create_server(("127.0.0.1", 0))
    answer = b"HTTP/1.1 413 Too Large\r\ncontent-length: 4\r\nconnection: close\r\n\r\nbig!"

    def refuse() -> None:
        conn, _ = listener.accept()
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
        conn.sendall(answer)
        conn.close()  # with the body unread: a reset

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    conns = Connections(f"http://127.0.0.1:{listener.getsockname()[1]}", 10.0)
    reply = conns.request("POST", "/v1/store", b"x" * (64 << 20), {"content-type": "a/b"})
    assert (reply.status, reply.content) == (413, b"big!")
    thread.join(5)
    listener.close()
    conns.close()


# ---- a reply longer than the client's bound ----------------------------------------------


class EndlessReply:
    """A hostile HTTP server on a raw socket: each request gets a 200 whose body is `size`
    bytes (then the connection closes) or, with `size` None, never ends; framed by a
    Content-Length (a lying one, 1 TiB, when endless), by chunks, or by the close alone."""

    def __init__(self, framing: str, size: int | None) -> None:
        self.framing, self.size = framing, size
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(4096)
                with contextlib.suppress(OSError):  # the client stopped reading: as it should
                    self.answer(conn)

    def answer(self, conn: socket.socket) -> None:
        length = {"length": f"content-length: {self.size or 1 << 40}\r\n"}.get(self.framing, "")
        chunked = "transfer-encoding: chunked\r\n" if self.framing == "chunks" else ""
        conn.sendall(
            f"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\n{length}{chunked}"
            "connection: close\r\n\r\n".encode()
        )
        piece = b"\x90" * 65536
        left = self.size if self.size is not None else 1 << 62
        while left > 0:
            data = piece[: min(left, len(piece))]
            conn.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            self.sent += len(data)
            left -= len(data)
        if chunked:
            conn.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.listener.close()


LIMIT = 1 << 20


@pytest.mark.parametrize("framing", ["length", "chunks", "close"])
def test_a_reply_past_max_reply_bytes_is_refused_having_read_no_more(framing: str) -> None:
    """Both clients against a server whose reply never ends (with a Content-Length of 1 TiB,
    in chunks, or until the connection closes): a `ReplyError` naming `max_reply_bytes`,
    soon, with no more than the bound held in memory; a reply of exactly the bound is read
    whole (one byte more is refused)."""
    import asyncio
    import tracemalloc

    from kvtier.client import AsyncClient

    endless = EndlessReply(framing, None)
    tracemalloc.start()
    started = time.monotonic()
    client = Client(endless.url, shared_memory=False, timeout_s=10, max_reply_bytes=LIMIT)
    with pytest.raises(ReplyError, match=r"GET /v1/status: a reply of .*max_reply_bytes"):
        client.status()
    client.close()

    async def status() -> None:
        async with AsyncClient(
            endless.url, shared_memory=False, timeout_s=10, max_reply_bytes=LIMIT
        ) as aclient:
            await aclient.status()

    with pytest.raises(ReplyError, match=r"GET /v1/status: a reply of .*max_reply_bytes"):
        asyncio.run(status())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - started < 5
    assert peak < 8 * LIMIT, peak  # the bound, not what the server would send
    endless.close()

    for size, refused in ((LIMIT, False), (LIMIT + 1, True)):
        server = EndlessReply(framing, size)
        for read in (read_blocking, read_async):
            if refused:
                with pytest.raises(ReplyError, match="max_reply_bytes"):
                    read(server.url)
            else:
                assert read(server.url) == b"\x90" * LIMIT
        server.close()


def read_blocking(url: str) -> bytes:
    connections = Connections(url, 10, LIMIT)
    try:
        return connections.request("GET", "/x", None, {}).content
    finally:
        connections.close()


def read_async(url: str) -> bytes:
    import asyncio

    import httpx

    from kvtier.client.transport import httpx_send

    async def send() -> bytes:
        async with httpx.AsyncClient(base_url=url) as http:
            reply = await httpx_send(http, http.build_request("GET", "/x"), LIMIT)
        return reply.content

    return asyncio.run(send())
