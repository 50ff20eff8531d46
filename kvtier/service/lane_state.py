"""The local lane's state (`lane.py`): an open connection's, and the request frame it sends.

    Connection(thread)             answering its hello at first; `answering` while a call is
                                   answered (its frame read and admitted, or refused, to its
                                   reply), else idle `since` a time: the ones the lane may end
    connection.end()               taken off the open ones (by the lane, under its lock): its
                                   wait for room in the budget, if any, cancelled
    LaneCall(conn, length, head)   a frame's first bytes (`head`, `frames.HEAD_BYTES` at most)
                                   read (`started`); `unread` bytes of it still in `conn`;
                                   its `path` once its head is parsed
    call.take(state, nbytes, ...)  the coroutine that holds the body's bytes in `call.hold`
    call.read_rest(deadline)       the rest read after the head: `head` is the whole frame then
    call.release(loop)             the hold given back (idempotent)

Accounting: a frame whose connection is ended mid-body (for room, or by `stop`) holds nothing
after. Its thread, waiting for room, is woken (`end` cancels the wait) and releases the hold;
and a wait granted on the loop after that release (the cancel crossed the grant) gives its
bytes back itself, seeing its connection `ended` (`take`): the budget's held bytes return to 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import threading
import time

from kvtier.service import frames
from kvtier.service.budget import Hold


class Connection:
    """An open connection's thread; `answering` while its hello, or a call from its admission
    (or its refusal) to its reply, is sent, else idle `since` (its hello, last reply or the
    first byte of the frame it sends, while that frame is read: waiting on its peer or on room
    in the budget): the ones the lane ends with `GOODBYE` for room or on `stop`."""

    def __init__(self, thread: threading.Thread) -> None:  # answering its hello at first
        self.thread, self.since, self.answering = thread, time.monotonic(), True
        self.ended = False
        self.reading = False  # a frame begun, not yet admitted: `stop` waits for it, room does not
        self.taking: concurrent.futures.Future[None] | None = None  # its wait for room

    def end(self) -> None:
        """Ended by the lane (under its lock): its wait for room, if any, cancelled."""
        self.ended = True
        if self.taking is not None:
            self.taking.cancel()


class LaneCall:
    """One request frame: its `head` in memory, `unread` bytes of it still in `conn`, and its
    `hold` in the budget once charged."""

    def __init__(self, conn: socket.socket, length: int, head: bytes) -> None:
        self.conn, self.length = conn, length
        self.head: bytes | bytearray = head
        self.unread = length - len(head)
        self.hold: Hold | None = None
        self.answering = False  # its connection marked answering (its frame read, admitted)
        self.path = ""  # its path once its head is read ("": malformed, counted as `other`)
        self.started = time.perf_counter()  # its head read: its time in `kvtier_request_seconds`

    async def take(self, state: Connection, nbytes: int, deadline: float) -> None:
        """Hold `nbytes` in `hold` (on the loop), given back at once when `state` was ended
        meanwhile (its thread may have released the hold before this grant)."""
        hold = self.hold  # (`release` may drop it from the call meanwhile)
        assert hold is not None, "a call's hold is made before its bytes are taken"
        await hold.take(nbytes, deadline)
        if state.ended:
            hold.release()

    def read_rest(self, deadline: float) -> None:
        """The rest of the frame, read after the head (`head`: the whole frame then)."""
        whole = bytearray(self.length)
        whole[: len(self.head)] = self.head
        frames.read_into(self.conn, memoryview(whole)[len(self.head) :], deadline)
        self.head, self.unread = whole, 0

    def release(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Give back the hold (on the loop: the budget is the loop's) once answered."""
        hold, self.hold = self.hold, None
        if hold is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the budget with it
                loop.call_soon_threadsafe(hold.release)
