"""A raw peer of the local lane (`kvtier/service/lane.py`) for the tests that play one: frames
as the wire has them (a little-endian uint32 length, then msgpack), no kvtier client code."""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]
from service_server import Server

from kvtier.service import frames

GOODBYE = b"kvtier-lane goodbye"
"""The server's last frame on a connection it ends between calls, as the wire has it (a
literal, so a test run against older code fails on what it reads)."""
GOODBYE_FRAME = struct.pack("<I", len(msgpack.packb(GOODBYE))) + msgpack.packb(GOODBYE)


def lane_of(server: Server, auth: str) -> str:
    """The name of `server`'s lane, as `/v1/pools` gives it to a caller with `auth`."""
    name = server.get("/v1/pools", headers={"authorization": auth}).json()["lane"]
    assert isinstance(name, str) and frames.NAME.fullmatch(name), name
    return name


def connect(name: str, timeout_s: float = 10.0) -> socket.socket:
    """A connection to the lane named `name` (abstract), before its hello."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect("\0" + name)
    return sock


def read_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError(f"the lane closed after {len(data)} of {count} bytes")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> Any:
    (length,) = struct.unpack("<I", read_exactly(sock, 4))
    return msgpack.unpackb(read_exactly(sock, length), raw=False)


def send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def opened(name: str, timeout_s: float = 10.0) -> socket.socket:
    """A lane connection past its hello."""
    sock = connect(name, timeout_s)
    assert read_frame(sock) == frames.HELLO
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock`: its end, after a `GOODBYE` frame (a connection
    ended idle) or none."""
    try:
        data = sock.recv(len(GOODBYE_FRAME))
        if data == GOODBYE_FRAME:
            data = sock.recv(1)
        return data == b""
    except ConnectionResetError:
        return True
