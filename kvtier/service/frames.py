"""The local lane's wire, both ends of it (`service/lane.py` serves it, `client/lane.py` calls
it): its name, hello and calls, a frame (a 4-byte little-endian length, then msgpack), the
bounded read of one, and the check each end makes of the other (the peer's uid).

    frame(data) -> bytes                  one frame of `data`
    read_exactly(sock, n, deadline=None)  n bytes; `ConnectionResetError` when the peer ends
                                          first, `TimeoutError` past `deadline` (monotonic;
                                          None: the socket's own timeout, per read)
    same_user(sock)                       whether the peer runs as this process's user
"""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]

LENGTH = struct.Struct("<I")
HELLO = b"kvtier-lane 1"
"""The server's first frame on a connection, which the client checks."""
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
NAME = re.compile(r"kvtier-lane-[1-9][0-9]{0,9}-[0-9a-f]{8}")
"""A lane's name: an abstract Unix socket's, `kvtier-lane-<pid>-<8 hex>`."""


def frame(data: Any) -> bytes:
    body: bytes = msgpack.packb(data, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def read_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytes:
    buffer = bytearray(count)
    view, got = memoryview(buffer), 0
    while got < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("a frame slower than its deadline")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("the lane closed mid-frame")
        got += n
    return bytes(buffer)


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
