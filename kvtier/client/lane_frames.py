"""The frames of the local lane as a client reads them (`lane.py`): the lane's name and frame
bound from the server's `/v1/pools`, a connection opened (`connect`, `connect_async`), and a
reply frame read whole within its bounds.

A connect waits for room in the server's accept queue until the call's deadline: a socket with
a timeout (non-blocking) failed at once with EAGAIN on a queue full for a moment (a burst of
connects, or another user's process flooding the abstract socket, which any local user can
reach), and the client took HTTP for `lane.RETRY_S` (audit AW). A refused connect (no lane
there) fails at once.

Every byte is the server's, so untrusted: a name that is not a lane's, or a frame longer than
the caller's limit (unread), not msgpack, or not `[status, body bytes]`, is a `ReplyError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
import time
from typing import Any

from kvtier.client.connections import reply_too_long
from kvtier.errors import ReplyError
from kvtier.service import flat, frames, wire


def longest_frame(value: object) -> int | None:
    """`/v1/pools`' `lane_max_frame_bytes` (untrusted: only which path a call takes hangs on
    it), or None where it is not a positive int (a server before it: no bound is known)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def checked_name(name: object) -> str | None:
    """A lane name from `/v1/pools` (untrusted), None for none (or no Unix sockets here);
    anything but a lane name is a `ReplyError`."""
    if name is None or not hasattr(socket, "AF_UNIX"):
        return None
    if not isinstance(name, str) or frames.NAME.fullmatch(name) is None:
        raise ReplyError(
            f"GET /v1/pools: lane {name!r:.80}, expected kvtier-lane-<pid>-<8 hex> or null"
        )
    return name


async def read_frame_async(reader: asyncio.StreamReader, limit: int, call: str) -> Any:
    """`read_frame` on a stream."""
    (length,) = frames.LENGTH.unpack(await reader.readexactly(frames.LENGTH.size))
    if length > limit:
        raise reply_too_long(limit, call)
    return decoded(await reader.readexactly(length), call)


def read_frame(sock: socket.socket, limit: int, call: str, deadline: float) -> Any:
    """The next frame's decoded value, whole by `deadline` (monotonic; `TimeoutError` past
    it); `ReplyError` for one longer than `limit` (unread) or not msgpack; `OSError` (EOF
    included) when the connection ends first. Its memory grows with the bytes that came
    (`STEP_BYTES` ahead of them at most), as `read_frame_async`'s: before, the length alone
    took that much zeroed memory at once, and a peer that named 1 GiB (`max_reply_bytes`)
    and sent nothing more held 1 GiB of each call's until its `timeout_s` (audit BJ: 4
    threads' lookups, 3 GiB)."""
    (length,) = frames.LENGTH.unpack(frames.read_exactly(sock, frames.LENGTH.size, deadline))
    if length > limit:
        raise reply_too_long(limit, call)
    payload = bytearray()
    while len(payload) < length:
        payload += frames.read_exactly(sock, min(length - len(payload), STEP_BYTES), deadline)
    return decoded(payload, call)


STEP_BYTES = 1 << 20
"""The most `read_frame` reads ahead of what came (a lane's replies are KiBs)."""


def decoded(payload: bytes | bytearray, call: str) -> Any:
    try:
        return flat.loads_reply(payload, wire.MSGPACK)  # in bounded memory
    except flat.Malformed as exc:
        raise ReplyError(f"{call}: a reply that is not msgpack ({exc})") from None


def reply_of(reply: Any, call: str) -> tuple[int, bytes]:
    """A decoded reply frame's `(status, body bytes)`, else `ReplyError`. A frame past
    `flat.SMALL` (64 KiB) is decoded in place, its body bytes a `memoryview` of it: taken as
    bytes too. Before, such a reply (a reservation or lease of some 20,000 slots, a prompt of
    80,000 tokens of 4-token blocks) was "not [status, body bytes]": over the lane, a store or
    load of a long prompt failed with a `ReplyError` where HTTP answered it (audit BJ)."""
    with contextlib.suppress(TypeError, ValueError):
        status, content = reply
        if type(status) is int and 100 <= status <= 599 and isinstance(content, bytes | memoryview):
            return status, bytes(content)
    raise ReplyError(f"{call}: a reply frame that is not [status, body bytes]")


CONNECT_RETRY_S = 0.005
"""How often an `AsyncLaneConnections` connect tries again while the accept queue is full."""


def connect(address: str, deadline: float) -> socket.socket:
    """A socket connected to `address`, waiting for room in its accept queue up to `deadline`
    (monotonic; a blocking connect bounded by SO_SNDTIMEO, which Linux waits for that room
    under), its timeout then what is left. `OSError` where it cannot be (refused, or no room by
    the deadline: EAGAIN)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        left = max(deadline - time.monotonic(), 1e-3)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
        sock.connect(address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0.0))
        sock.settimeout(max(deadline - time.monotonic(), 1e-6))
    except BaseException:
        sock.close()
        raise
    return sock


async def connect_async(
    address: str, deadline: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """`connect` on the running loop (`deadline` on its clock): a non-blocking connect, tried
    again every `CONNECT_RETRY_S` while the accept queue is full (EAGAIN; asyncio's own connect
    took that for a connection made) up to `deadline`; refused, or no lane there, at once."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        while (failed := sock.connect_ex(address)) == errno.EAGAIN:
            if loop.time() + CONNECT_RETRY_S >= deadline:
                break
            await asyncio.sleep(CONNECT_RETRY_S)
        if failed:
            raise OSError(failed, os.strerror(failed))
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
