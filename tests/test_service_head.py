"""A request's head is bounded in size and in time (issue 11, point 7: half-sent requests), on a
real `kvtier serve` (`kvtier/service/protocol.py`).

Before the bound, a client that sent half a request line and stalled held its connection
forever, and a 100 KiB header was read whole; both now get a JSON refusal and a closed
connection, and the server keeps serving. A head's forwarding headers are not trusted either
(the sidecar sits behind no proxy).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from service_server import Server, running, write_config

from kvtier.service.protocol import LINGER_S
from kvtier.service.server import MAX_HEAD_BYTES

TIMEOUT_S = 1.0
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("head"),
        service={"body_timeout_s": TIMEOUT_S, "max_body_bytes": MAX_BODY},
    )
    with running(config) as live:
        yield live


def _connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10 * TIMEOUT_S)
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict[str, str]]:
    """(status, JSON body) of the one answer before the server closes the connection (a
    connection left open runs into the socket's timeout, which fails the test)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def _healthz_reply(sock: socket.socket) -> bytes:
    """One /healthz response read off a kept-alive connection (its head and body may come in
    separate reads)."""
    data = b""
    while b'{"ok":true}' not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {data!r}"
        data += chunk
    return data


def _still_serving(server: Server) -> None:
    assert server.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/look", b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"],
    ids=["nothing", "half a request line", "half the headers"],
)
def test_a_head_that_stalls_is_answered_408_and_closed(server: Server, sent: bytes) -> None:
    with _connect(server) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        status, body = _answer(sock)
        waited = time.monotonic() - started
    assert (status, body["error"]) == (408, "head_timeout"), body
    assert TIMEOUT_S * 0.5 < waited < TIMEOUT_S * 5, waited
    _still_serving(server)


def test_a_head_past_the_limit_is_answered_431_and_closed(server: Server) -> None:
    huge = b"x" * (MAX_HEAD_BYTES + 1024)
    with _connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + huge + b"\r\n\r\n")
        status, body = _answer(sock)
    assert (status, body["error"]) == (431, "head_too_large"), body
    _still_serving(server)


def test_a_keep_alive_connection_gets_a_fresh_deadline_for_each_request(server: Server) -> None:
    with _connect(server) as sock:
        for _ in range(3):  # each request well inside the deadline; together, past it
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            reply = _healthz_reply(sock)
            assert reply.startswith(b"HTTP/1.1 200"), reply
            time.sleep(TIMEOUT_S * 0.6)


def test_headers_just_under_the_limit_are_served(server: Server) -> None:
    near = b"y" * (MAX_HEAD_BYTES - 1024)
    with _connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + near + b"\r\n\r\n")
        reply = _healthz_reply(sock)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_x_forwarded_headers_from_a_local_client_rewrite_nothing(server: Server) -> None:
    """The sidecar sits behind no proxy: a local process's X-Forwarded-Proto / -For must not
    change the scheme or peer the app sees (uvicorn trusted them from 127.0.0.1 by default; a
    redirect then pointed at https, which this server does not speak)."""
    forged = {"x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.9"}
    reply = httpx.get(server.url + "/v1/status/", headers=forged, follow_redirects=False)
    assert reply.status_code == 307
    assert reply.headers["location"] == server.url + "/v1/status"
    _still_serving(server)


def _refused_head(length: int) -> bytes:
    return (
        f"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def test_a_body_refused_by_its_length_can_be_sent_whole_and_the_413_read_after(
    server: Server,
) -> None:
    """The server answers 413 before reading the body, and reads on (lingers) rather than
    closing on unread bytes, which would reset the connection under a client still sending:
    32 MiB sent after the head all arrive, and the answer is there to read."""
    body = b" " * (32 << 20)
    with _connect(server) as sock:
        sock.sendall(_refused_head(len(body)) + body)  # raised a reset before the lingering
        status, answer = _answer(sock)
    assert (status, answer["error"]) == (413, "body_too_large"), answer
    _still_serving(server)


def test_a_refused_client_that_keeps_sending_is_cut_off_after_the_linger(server: Server) -> None:
    """Lingering is bounded: a client that goes on sending after its 413 (slowly, under the
    byte bound) finds the connection reset once `LINGER_S` have passed."""
    with _connect(server) as sock:
        sock.sendall(_refused_head(1 << 40))
        started = time.monotonic()
        cut = None
        while time.monotonic() - started < LINGER_S + 5:
            try:
                sock.sendall(b" " * 16384)
            except OSError:
                cut = time.monotonic() - started
                break
            time.sleep(0.01)
    assert cut is not None and LINGER_S * 0.5 < cut < LINGER_S + 3, cut
    _still_serving(server)


@pytest.mark.parametrize("target", [b"/v1/reset#?tenant=b", b"/v1/lookup?x=1#y", b"/healthz#"])
def test_a_request_target_with_a_fragment_is_refused_400(server: Server, target: bytes) -> None:
    """httptools drops a fragment, and a query written after one: `/v1/reset#?tenant=b` reached
    the route as the caller's own reset, past the edge's check of the query (`guard.py`)."""
    with _connect(server) as sock:
        sock.sendall(
            b"POST " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"
        )
        status, body = _answer(sock)
    assert (status, body["error"]) == (400, "bad_request"), body
    assert "fragment" in body["detail"]
    _still_serving(server)
