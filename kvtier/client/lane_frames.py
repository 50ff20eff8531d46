"""The frames of the local lane as a client reads them (`lane.py`): the lane's name and frame
bound from the server's `/v1/pools`, and a reply frame read whole within its bounds.

Every byte is the server's, so untrusted: a name that is not a lane's, or a frame longer than
the caller's limit (unread), not msgpack, or not `[status, body bytes]`, is a `ReplyError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
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
    included) when the connection ends first."""
    (length,) = frames.LENGTH.unpack(frames.read_exactly(sock, frames.LENGTH.size, deadline))
    if length > limit:
        raise reply_too_long(limit, call)
    return decoded(frames.read_exactly(sock, length, deadline), call)


def decoded(payload: bytes, call: str) -> Any:
    try:
        return flat.loads_reply(payload, wire.MSGPACK)  # in bounded memory
    except flat.Malformed as exc:
        raise ReplyError(f"{call}: a reply that is not msgpack ({exc})") from None


def reply_of(reply: Any, call: str) -> tuple[int, bytes]:
    with contextlib.suppress(TypeError, ValueError):
        status, content = reply
        if type(status) is int and 100 <= status <= 599 and isinstance(content, bytes):
            return status, content
    raise ReplyError(f"{call}: a reply frame that is not [status, body bytes]")
