"""A floor under the pace of the cluster's replies: a node that sends one byte just inside each
socket timeout cannot hold a call for longer than its reply's size allows.

A socket timeout bounds each read, not a reply: a reply dripped a byte at a time, each inside
the timeout, would hold the call (a `lookup`'s probe, a `load`'s read) for as long as the node
likes. `PacedSocket` wraps a connection's socket; while a reply is read (`start_reply` ..
`end_reply`, around `connection.SplitValueConnection.read_response`) a read fails as a socket
timeout once the reply has taken longer than

    socket timeout + bytes of it received so far / MIN_REPLY_RATE

so a reply of n bytes ends, complete or timed out, within a socket timeout plus
n / MIN_REPLY_RATE (each read waits no longer than what is left of that; past it, a read takes
what has arrived already, and nothing more is waited for). A `Pace` shared by
several replies bounds them together, from its start: the replies of one round trip to several
nodes (`rounds.py`) are all in within one timeout plus their bytes / MIN_REPLY_RATE.

A `Budget` bounds the bytes of a run of replies as the pace bounds their time: while a reply
is read with one, no read asks the socket for more than one byte past what is left of it, and
a read that takes the run past it fails with `ReplyTooLong` before its bytes reach the
parser. So a node that answers a read of one value with a bulk of gigabytes costs the reader
the bytes its commands asked for, not the bulk (redis-py's parser buffers a bulk whole
before returning it). Outside a reply (the pool's check for stale bytes) reads are as the
socket's. Everything else is the socket's own (`__getattr__`).
"""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any

MIN_REPLY_RATE = 2**20
"""Bytes per second: a reply arriving slower than this, past its first socket timeout, is a
timeout (a 2 MiB block over any working link is far faster)."""


class Pace:
    """The time a run of reads may take, begun at its creation: `timeout_s` plus the bytes
    received so far / `MIN_REPLY_RATE`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.received = 0

    def left(self) -> float:
        """Seconds left (<= 0: the reads are late)."""
        spent = time.monotonic() - self.started
        return self.timeout_s + self.received / MIN_REPLY_RATE - spent


class ReplyTooLong(Exception):
    """A node's replies ran past the bytes its commands asked for (`Budget`)."""


class Budget:
    """The bytes a run of replies may take in all (`nbytes`): what their commands asked for."""

    def __init__(self, nbytes: int, bound: str = "asked for") -> None:
        self.nbytes = nbytes
        self.left = nbytes
        self.bound = bound  # what the bound is, for `ReplyTooLong`'s message

    def cap(self, size: int) -> int:
        """What a read of `size` bytes may ask for: one byte past what is left shows excess."""
        return max(1, min(size, self.left + 1))

    def spend(self, count: int) -> None:
        """`count` bytes came in; `ReplyTooLong` once they are more than were asked for."""
        self.left -= count
        if self.left < 0:
            raise ReplyTooLong(f"the replies ran past the {self.nbytes} bytes {self.bound}")


class PacedSocket:
    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self._pace: Pace | None = None  # of the reply being read; None: none is
        self._budget: Budget | None = None  # of the reply being read; None: no bound

    def start_reply(self, pace: Pace | None = None, budget: Budget | None = None) -> None:
        """A reply begins: bounded by `pace` (shared with other replies) or one of its own,
        and in bytes by `budget` (shared with other replies) when given."""
        self._pace = pace if pace is not None else Pace(self.timeout_s)
        self._budget = budget

    def end_reply(self) -> None:
        self._budget = None
        if self._pace is not None:
            self._pace = None
            with contextlib.suppress(OSError):  # closed by a failed reply: nothing to restore
                self.sock.settimeout(self.timeout_s)

    def recv(self, size: int, *flags: int) -> bytes:
        pace = self._check_pace()
        budget = self._budget
        try:
            data = self.sock.recv(size if budget is None else budget.cap(size), *flags)
        except BlockingIOError:  # late, and nothing more has arrived
            raise _late(pace) from None
        if pace is not None:
            pace.received += len(data)
        if budget is not None:
            budget.spend(len(data))
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, *flags: int) -> int:  # hiredis reads so
        pace = self._check_pace()
        budget = self._budget
        if budget is not None:
            nbytes = budget.cap(nbytes or memoryview(buffer).nbytes)
        try:
            count = self.sock.recv_into(buffer, nbytes, *flags)
        except BlockingIOError:
            raise _late(pace) from None
        if pace is not None:
            pace.received += count
        if budget is not None:
            budget.spend(count)
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)

    def _check_pace(self) -> Pace | None:
        pace = self._pace
        if pace is None:
            return None
        # a read waits no longer than the time left; once late, it takes only what has
        # arrived already (the replies of a node read after another that was slow)
        self.sock.settimeout(max(0.0, min(self.timeout_s, pace.left())))
        return pace


def _late(pace: Pace | None) -> TimeoutError:
    received = 0 if pace is None else pace.received
    return TimeoutError(f"reply of {received} bytes so far slower than {MIN_REPLY_RATE} bytes/s")
