"""A floor under the pace of the cluster's replies: a node that sends one byte just inside each
socket timeout cannot hold a call for longer than its reply's size allows.

A socket timeout bounds each read, not a reply: a reply dripped a byte at a time, each inside
the timeout, would hold the call (a `lookup`'s probe, a `load`'s read) for as long as the node
likes. `PacedSocket` wraps a connection's socket; while a reply is read (`start_reply` ..
`end_reply`, around `connection.SplitValueConnection.read_response`) a read fails as a socket
timeout once the reply has taken longer than

    socket timeout + bytes of it received so far / MIN_REPLY_RATE

so a reply of n bytes ends, complete or timed out, within two socket timeouts plus
n / MIN_REPLY_RATE. Outside a reply (the pool's check for stale bytes) reads are as the socket's.
Everything else is the socket's own (`__getattr__`).
"""

from __future__ import annotations

import socket
import time
from typing import Any

MIN_REPLY_RATE = 2**20
"""Bytes per second: a reply arriving slower than this, past its first socket timeout, is a
timeout (a 2 MiB block over any working link is far faster)."""


class PacedSocket:
    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self._started: float | None = None  # when the reply being read began; None: none is
        self._received = 0

    def start_reply(self) -> None:
        self._started, self._received = time.monotonic(), 0

    def end_reply(self) -> None:
        self._started = None

    def recv(self, size: int, *flags: int) -> bytes:
        self._check_pace()
        data = self.sock.recv(size, *flags)
        self._received += len(data)
        return data

    def recv_into(self, buffer: Any, *args: int) -> int:  # hiredis reads with it
        self._check_pace()
        count = self.sock.recv_into(buffer, *args)
        self._received += count
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)

    def _check_pace(self) -> None:
        if self._started is None:
            return
        allowed = self.timeout_s + self._received / MIN_REPLY_RATE
        if time.monotonic() - self._started > allowed:
            raise TimeoutError(
                f"reply of {self._received} bytes so far slower than {MIN_REPLY_RATE} bytes/s"
            )
