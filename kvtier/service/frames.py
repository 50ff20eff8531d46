"""The local lane's wire, both ends of it (`service/lane.py` serves it, `client/lane.py` calls
it): its name, hello and calls, a frame (a 4-byte little-endian length, then msgpack), the
bounded read of one, and the check each end makes of the other (the peer's uid).

    frame(data) -> bytes                  one frame of `data`
    request_head(head, length) -> Head    a request's path, key, tenant and where its body
                                          lies, from its first bytes (`HEAD_BYTES` at most)
    read_exactly(sock, n, deadline=None)  n bytes; `ConnectionResetError` when the peer ends
                                          first, `TimeoutError` past `deadline` (monotonic;
                                          None: the socket's own timeout, per read)
    read_into(sock, view, deadline=None)  the same into `view`
    skip(sock, n, deadline)               n bytes read and dropped (a refused frame's rest)
    say_goodbye(sock)                     `GOODBYE` written without waiting (not at all when
                                          it cannot be at once), then `sock` shut down
    heard_goodbye(sock) -> bool           whether `GOODBYE` is readable on `sock` now (read)
    same_user(sock)                       whether the peer runs as this process's user
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import time
from typing import Any, NamedTuple

import msgpack  # type: ignore[import-untyped]

LENGTH = struct.Struct("<I")
HELLO = b"kvtier-lane 1"
"""The server's first frame on a connection, which the client checks."""
GOODBYE = b"kvtier-lane goodbye"
"""The server's last frame on a connection it ends while no call is under way on it (idle, for
room, silent after its hello, or the server stopping): it answers no request on it after, so
a client that reads it where it expected a reply sends that call again."""
PATHS = frozenset(
    (
        "/v1/lookup", "/v1/prefetch", "/v1/release", "/v1/reserve", "/v1/commit", "/v1/abort",
        "/v1/leases",
    )
)  # fmt: skip
"""The calls the lane carries: the small ones, each as its POST is over HTTP; `/v1/leases` is
`GET /v1/leases/{id}?wait_s=` with `{lease_id, wait_s}` in the body (a client waiting on a
lease still PENDING past the prefetch's own wait). A store or load whose KV travels in the body
stays on HTTP."""


def longest(max_tokens: int) -> int:
    """The longest request frame a lane reads: `max_tokens` tokens, and 1 MiB of fields. The
    server names it in `/v1/pools` (`lane_max_frame_bytes`), so that a client sends a longer
    call over HTTP, which answers it (413) where the lane could only end the connection."""
    return 4 * max_tokens + (1 << 20)


HEAD_BYTES = 1 << 16
"""A request's first bytes, read before it is admitted: the whole frame when it is no longer,
else they must hold its path, key, tenant and the body's header (a client's take some 100)."""
SHAPE = "[path: str, authorization: str | nil, tenant: str | nil, body: bytes]"
NAME = re.compile(r"kvtier-lane-[1-9][0-9]{0,9}-[0-9a-f]{8}")
"""A lane's name: an abstract Unix socket's, `kvtier-lane-<pid>-<8 hex>`."""


def frame(data: Any) -> bytes:
    body: bytes = msgpack.packb(data, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


GOODBYE_FRAME = frame(GOODBYE)


def say_goodbye(sock: socket.socket) -> None:
    """Write `GOODBYE_FRAME` on `sock` without waiting, through a duplicate of its descriptor
    set non-blocking (`sock.send` waits out its timeout where the peer reads nothing), and shut
    it down both ways; a peer that reads after the shutdown reads the frame, then the end."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(sock.fileno())) as now:
        now.settimeout(0)
        now.send(GOODBYE_FRAME)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def heard_goodbye(sock: socket.socket) -> bool:
    """Whether the next bytes readable on `sock` now, without waiting, are `GOODBYE_FRAME`
    (read: the caller closes `sock`); `sock` may be an asyncio transport's."""
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as now:
            now.settimeout(0)
            return now.recv(len(GOODBYE_FRAME)) == GOODBYE_FRAME
    except OSError:
        return False


class Head(NamedTuple):
    """A request frame's fields before its body, and where the body lies in the frame."""

    path: str
    authorization: str | None
    tenant: str | None
    body_at: int
    body_length: int


_ARRAY4 = (b"\x94", b"\xdc\x00\x04", b"\xdd\x00\x00\x00\x04")  # an array of 4, as msgpack has it
_LONG = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}  # str8-32, bin8-32
_STR, _BIN = (0xD9, 0xDA, 0xDB), (0xC4, 0xC5, 0xC6)


def request_head(head: bytes | bytearray, length: int) -> Head:
    """The head of a request frame of `length` bytes whose first bytes are `head`; `ValueError`
    naming what is wrong where the frame is not `SHAPE` (its fields past `head`, a body that
    does not end the frame)."""
    at = next((len(a) for a in _ARRAY4 if head.startswith(a)), 0)
    if not at:
        raise ValueError(f"expected {SHAPE}: not a msgpack array of 4")
    fields: list[str | None] = []
    for name in ("path", "authorization", "tenant"):
        kind = head[at] if at < len(head) else None
        if kind == 0xC0 and name != "path":
            fields.append(None)
            at += 1
            continue
        size, at = _sized(head, at, name, _STR)
        try:
            fields.append(head[at : at + size].decode())
        except UnicodeDecodeError:
            raise ValueError(f"expected {SHAPE}: {name} is not UTF-8") from None
        at += size
    size, at = _sized(head, at, "body", _BIN)
    if at + size != length:
        raise ValueError(f"expected {SHAPE}: a body of {size} bytes in {length - at}")
    return Head(fields[0] or "", fields[1], fields[2], at, size)  # (the path is a str)


def _sized(head: bytes | bytearray, at: int, name: str, kinds: tuple[int, ...]) -> tuple[int, int]:
    """The length of the str (or bin, `kinds`) at `at` and where its bytes start, all in `head`."""
    kind = head[at] if at < len(head) else None
    start, size = at + 1, 0
    if kinds == _STR and kind is not None and 0xA0 <= kind <= 0xBF:
        size = kind & 0x1F
    elif kind in kinds:
        fmt = _LONG[kind]
        start += struct.calcsize(fmt)
        if start <= len(head):
            (size,) = struct.unpack_from(fmt, head, at + 1)
    else:
        what = "past the first bytes" if kind is None else f"type byte 0x{kind:02x}"
        raise ValueError(f"expected {SHAPE}: {name} {what}")
    if start > len(head) or (kinds == _STR and start + size > len(head)):
        raise ValueError(f"expected {SHAPE}: {name} past the first {len(head)} bytes")
    return size, start


def read_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytes:
    buffer = bytearray(count)
    read_into(sock, memoryview(buffer), deadline)
    return bytes(buffer)


def read_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from `sock` (`read_exactly`'s errors)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("a frame slower than its deadline")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("the lane closed mid-frame")
        got += n


def skip(sock: socket.socket, count: int, deadline: float) -> None:
    """Read `count` bytes from `sock` and drop them, in memory of `HEAD_BYTES` at most."""
    scratch = memoryview(bytearray(min(count, HEAD_BYTES)))
    while count:
        read_into(sock, scratch[: min(count, len(scratch))], deadline)
        count -= min(count, len(scratch))


def same_user(sock: socket.socket) -> bool:
    """Whether the peer of the Unix socket `sock` runs as this process's user (SO_PEERCRED:
    pid, uid, gid): what each end of the lane asks of the other, the boundary of the 0600
    shared-memory pools."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    uid: int = struct.unpack("3i", creds)[1]
    return uid == os.geteuid()
