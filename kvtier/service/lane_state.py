"""The local lane's state (`lane.py`): an open connection's, and the request frame it sends.

    Connection(thread)             answering its hello at first; `answering` while a call is
                                   answered (its frame read and admitted, or refused, to its
                                   reply), else idle `since` a time: the ones the lane may end;
                                   `stalled` `since` its reply found its peer's buffer full
    connection.idle(now)           whether the lane may end it for room: not answering, or
                                   stalled for `STALL_S` (a peer that does not read its replies)
    connection.end()               taken off the open ones (by the lane, under its lock): its
                                   wait for room in the budget, if any, cancelled
    LaneCall(conn, length, head)   a frame's first bytes (`head`, `frames.HEAD_BYTES` at most)
                                   read (`started`); `unread` bytes of it still in `conn`;
                                   its `path` once its head is parsed
    call.take(state, nbytes, ...)  the coroutine that holds the body's bytes in `call.hold`
    call.wait_for_room(state, ...) that coroutine run on the lane's loop, waited for; cancelled
                                   by `state.end`
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

from kvtier.service import frames, wire
from kvtier.service.budget import Hold

STALL_S = 1.0
"""How long a reply may wait on a peer that does not read it before its connection counts as
idle (an honest client reads a reply as it comes: one past the socket's buffer, some 200 KB,
drains in milliseconds)."""


class Connection:
    """An open connection's thread; `answering` while its hello, or a call from its admission
    (or its refusal) to its reply, is sent, else idle `since` (its hello, last reply or the
    first byte of the frame it sends, while that frame is read: waiting on its peer or on room
    in the budget): the ones the lane ends with `GOODBYE` for room or on `stop`."""

    def __init__(self, thread: threading.Thread) -> None:  # answering its hello at first
        self.thread, self.since, self.answering = thread, time.monotonic(), True
        self.ended = False
        self.reading = False  # a frame begun, not yet admitted: `stop` waits for it, room does not
        self.stalled = False  # its reply waits on a peer that does not read: room may end it
        self.taking: concurrent.futures.Future[None] | None = None  # its wait for room

    def idle(self, now: float) -> bool:
        """Whether the lane may end it for room (`now`: monotonic): not answering a call, or
        answering one whose reply its peer has left unread for `STALL_S` (ended then without
        `GOODBYE`, its reply cut: a peer that stops reading cannot hold a connection)."""
        return not self.answering or (self.stalled and now - self.since >= STALL_S)

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

    def wait_for_room(
        self,
        state: Connection,
        nbytes: int,
        where: tuple[asyncio.AbstractEventLoop, threading.Lock],
        timeout_s: float,
        slack_s: float,
    ) -> None:
        """Take `nbytes` in `hold` on the loop of `where` (waiting for room up to `timeout_s`;
        `slack_s` more for the loop to answer), its wait in `state.taking` under the lane's lock
        of `where`, so that `state.end` cancels it: `ConnectionResetError` then, or where the
        wait was not begun; `ConnectionAbortedError` when the loop is closed or does not answer."""
        loop, lock = where
        taking = self.take(state, nbytes, time.monotonic() + timeout_s)
        try:
            taken = asyncio.run_coroutine_threadsafe(taking, loop)
        except RuntimeError:  # the loop is closed: the server is stopping
            taking.close()
            raise ConnectionAbortedError("the server is stopping") from None
        try:
            with lock:  # `end` cancels it from now, or it was ended already
                state.taking = taken
                if state.ended:
                    taken.cancel()
            taken.result(timeout_s + slack_s)
        except concurrent.futures.CancelledError:  # by room-making or `stop`: ended
            raise ConnectionResetError("ended while it waited for room") from None
        except concurrent.futures.TimeoutError:  # the loop is stopping: nothing will answer
            taken.cancel()
            raise ConnectionAbortedError("the event loop did not answer") from None

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


class Gone(Exception):
    """The connection ended (or was ended for room, or the loop stopped) mid-call."""


def refusal(status: int, kind: str, detail: str) -> tuple[int, bytes]:
    """A refused call's status and body, `{error, detail}` as HTTP's refusals."""
    return status, wire.encode({"error": kind, "detail": detail}, True)
