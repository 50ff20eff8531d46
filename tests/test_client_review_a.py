"""A lane call's `timeout_s` covers a new connection's hello, and nothing is sent past it.

A review of the whole-call deadline found that, after a goodbye, the new connection's hello had
a fresh `timeout_s` of its own and the frame was then sent with the call's deadline already spent:
the server received and ran the call while the caller was told it had timed out. Now the hello
waits only for what is left of the call's deadline, and a call whose deadline is spent sends
nothing. A real Unix socket plays the server: a hello, a goodbye just before the bound, then a
hello that comes too late.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
import time

import msgpack  # type: ignore[import-untyped]

from kvtier.client import TransportError
from kvtier.client.lane import LaneConnections
from kvtier.service import frames

TIMEOUT_S = 0.5


def _read_call(conn: socket.socket) -> None:
    (size,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
    conn.recv(size, socket.MSG_WAITALL)


def test_a_hello_after_the_calls_deadline_gets_no_frame() -> None:
    name = f"kvtier-lane-test-{os.getpid()}-{secrets.token_hex(3)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(4)
    received: list[float] = []
    start = time.monotonic()

    def serve() -> None:
        first, _ = listener.accept()
        first.sendall(frames.frame(frames.HELLO))
        _read_call(first)
        time.sleep(0.4)  # just before the bound: a goodbye, the call not answered
        first.sendall(frames.GOODBYE_FRAME)
        first.shutdown(socket.SHUT_RDWR)
        first.close()
        second, _ = listener.accept()
        time.sleep(0.45)  # the new connection's hello, past the call's bound
        second.settimeout(2)
        try:
            second.sendall(frames.frame(frames.HELLO))
            _read_call(second)
            received.append(time.monotonic() - start)
            second.sendall(frames.frame([200, msgpack.packb({"num_tokens": 0})]))
        except OSError:
            pass  # the client gave the connection up: nothing sent

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    lane = LaneConnections(name, TIMEOUT_S, 1 << 20)
    try:
        try:
            reply = lane.request("/v1/lookup", msgpack.packb({}), {})
        except TransportError:
            reply = None
        took = time.monotonic() - start
        server.join(3)
        assert received == [], f"the frame reached the server at {received} s, past the bound"
        assert reply is None  # given up unsent: the caller may send it over HTTP
        assert took < TIMEOUT_S + 0.25, took
    finally:
        lane.close()
        listener.close()
