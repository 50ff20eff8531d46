"""`LaneConnections` (`Client`) and `AsyncLaneConnections` (`AsyncClient`, the same over
asyncio streams): a client's connections to its server's local lane, a Unix socket the data
plane's small calls take past HTTP (`kvtier/service/lane.py` has the frames).

Contract:
- `LaneConnections.of(name, ..., longest)`: `name` comes from the server's `/v1/pools`
  (untrusted): None (no lane) gives None; anything but a lane name (`frames.NAME`) is a
  `ReplyError`. `longest` (its `lane_max_frame_bytes`): a call whose frame is longer takes HTTP,
  unsent (the lane would end the connection unanswered, a `TransportError`; HTTP answers 413).
- `request(path, body, headers)` sends one call of `frames.PATHS` and returns its `Reply`,
  read as an HTTP reply is (`transport.reply_body`), or None when the lane cannot be reached:
  a connection refused, a peer of another user (SO_PEERCRED), or one that does not open with
  the server's hello (a server with every connection answering a call, or another user's).
  Nothing was sent then, so the caller takes HTTP, and so does every call of this client for
  `RETRY_S` (`dead`), when it tries once more (a server that had no connection to spare may
  have one then). Safe from any number of threads: each call holds a connection of its own,
  taken from the idle ones or opened, and at most `MOST_CALLS` calls of a client are on the
  lane at once; one past them waits for a slot or takes HTTP, unsent (`lane_slots.py`), and
  the lane stays the client's (before, a burst of 600 calls of one `AsyncClient` opened 600
  connections, past the server's 256, and each call of that client took HTTP for `RETRY_S`).
- A call has `timeout_s` for the whole of it (sending its frame and reading its whole reply;
  opening a connection, to the server's hello, within it too): a server that drips its reply a
  byte at a time cannot hold it longer. Once a request is sent, every failure (a reset, past
  `timeout_s`, a reply cut short) is a `TransportError` and its connection is closed; a
  request is never sent twice, but for a goodbye: the server's `frames.GOODBYE` read where the
  reply was expected (or, where sending failed, the next bytes on the connection) says the
  server ended the connection between calls and answers none of the request
  (`service/lane.py`: "Goodbye"), so the call is sent once more on a new connection, and
  over HTTP (`None`) where that one cannot be opened or says goodbye too (a server stopping).
  An idle connection the server has closed (it ends one idle for 10 minutes, or the one idle
  longest to make room at its connection bound, its goodbye pending) is found before it is
  used and replaced. A connection is opened only to send a call at once (the server closes one
  that sends none within seconds).
- A connection whose opening is interrupted (a task cancelled, a `KeyboardInterrupt`) before
  the server's hello is closed there and then: before, it stayed open, and the server kept it,
  for as long as the error lived.
- A reply is untrusted: a frame longer than `max_reply_bytes`, or that is not
  `[status, body bytes]`, is a `ReplyError` (no more than the limit is read).
- `retire()`: the lane of a server that is gone (the client re-mapped the pools of a server
  restarted at its URL, which named a lane of its own): its idle connections are closed, and
  it is `dead` for good, so a call that still holds it takes HTTP (never a `ClosedError`); a
  call under way ends as it would, and its connection is closed after.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from typing import Any

from kvtier.client.connections import Reply, TransportError, TransportTimeout, still_open
from kvtier.client.lane_frames import (
    checked_name,
    connect,
    connect_async,
    longest_frame,
    read_frame,
    read_frame_async,
    reply_of,
)
from kvtier.client.lane_slots import WAITING, Slots, wait_turn, wait_turn_async
from kvtier.errors import ClosedError, ReplyError
from kvtier.service import frames, wire

RETRY_S = 30.0
_GOODBYE = object()  # `_send`'s answer where the server ended the connection unread


class _Dead:
    retry_at: float
    longest: int | None = None  # the server's `lane_max_frame_bytes` (None: not said)
    _closed: bool

    def _gone(self) -> bool:
        """Whether a call waiting for a slot stops waiting: the lane dead, or the client closed."""
        return self._closed or self.dead

    def _http(self) -> Reply | None:
        """A call that got no slot: HTTP (None), or `ClosedError` where the client closed."""
        if self._closed:
            raise ClosedError("the client is closed: no request is sent")
        return None

    @property
    def dead(self) -> bool:
        """Whether calls take HTTP for now: the lane was out of reach less than `RETRY_S` ago."""
        return time.monotonic() < self.retry_at

    def too_long(self, data: bytes) -> bool:
        """Whether frame `data` is past what the server's lane reads (it would end the
        connection unanswered): such a call takes HTTP, which answers it."""
        return self.longest is not None and len(data) - frames.LENGTH.size > self.longest


class LaneConnections(_Dead):
    def __init__(self, name: str, timeout_s: float, max_reply_bytes: int) -> None:
        self.address = "\0" + name  # an abstract socket: Linux only
        self.timeout_s, self.limit = timeout_s, max_reply_bytes
        self.calls = 0  # requests answered through the lane
        self.retry_at = 0.0  # while `time.monotonic()` is below it, calls take HTTP
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._slots = Slots()  # under `_lock`

    @classmethod
    def of(
        cls, name: object, timeout_s: float, max_reply_bytes: int, longest: object = None
    ) -> LaneConnections | None:
        checked = checked_name(name)
        if checked is None:
            return None
        lane = cls(checked, timeout_s, max_reply_bytes)
        lane.longest = longest_frame(longest)
        return lane

    def request(self, path: str, body: bytes, headers: dict[str, str]) -> Reply | None:
        deadline = time.monotonic() + self.timeout_s  # the whole call's (module doc)
        short = path not in WAITING
        with self._lock:
            turn = self._slots.queue(deadline)
            try:
                if not wait_turn(self._slots, turn, short, self._lock, self._gone):
                    return self._http()  # unsent: the lane is not out of reach (module doc)
            finally:
                self._slots.leave(turn)
        try:
            return self._request(path, body, headers, deadline)
        finally:
            with self._lock:
                self._slots.give(short)

    def _request(
        self, path: str, body: bytes, headers: dict[str, str], deadline: float
    ) -> Reply | None:
        call = f"POST {path} (lane)"
        request = [path, headers.get("authorization"), headers.get("x-kvtier-tenant"), body]
        data = frames.frame(request)
        if self.too_long(data):
            return None  # HTTP: unsent
        for fresh in (False, True):  # sent again once, on a new connection, after a goodbye
            sock = self._take(fresh, deadline)
            if sock is None:
                return None
            reply = self._send(sock, data, call, deadline)
            if reply is not _GOODBYE:
                self._give(sock)
                status, content = reply_of(reply, call)
                return Reply(status, wire.MSGPACK, content, path)
        return None  # a goodbye on a new connection too (a server stopping): HTTP, unsent

    def _send(self, sock: socket.socket, data: bytes, call: str, deadline: float) -> Any:
        """The reply to `data` on `sock`, whole by `deadline` (monotonic), or `_GOODBYE` (`sock`
        closed) where the server ended the connection between calls and answers none of it
        (module doc)."""
        try:
            left = deadline - time.monotonic()
            if left <= 0:  # spent before a byte went: nothing sent (the server does nothing)
                raise TimeoutError
            try:
                sock.settimeout(left)
                sock.sendall(data)
            except OSError:  # ended, or stalled: said goodbye before it was ended, or not
                if frames.heard_goodbye(sock):
                    sock.close()
                    return _GOODBYE
                raise
            reply = read_frame(sock, self.limit, call, deadline)
        except TimeoutError:
            sock.close()
            raise TransportTimeout(
                f"{call}: TimeoutError: not done within timeout_s ({self.timeout_s} s: sending "
                "and the whole reply)"
            ) from None
        except OSError as exc:
            sock.close()
            raise TransportError(f"{call}: {type(exc).__name__}: {exc}") from None
        except BaseException:
            sock.close()  # interrupted, or a reply too long: its state is unknown
            raise
        if reply == frames.GOODBYE:
            sock.close()
            return _GOODBYE
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._slots.wake_all()  # calls waiting for a slot stop waiting
        for sock in idle:
            sock.close()

    def retire(self) -> None:
        """Dead for good, its idle connections closed (module doc)."""
        with self._lock:
            self.retry_at = math.inf
            idle, self._idle = self._idle, []
            self._slots.wake_all()
        for sock in idle:
            sock.close()

    def _take(self, fresh: bool, deadline: float) -> socket.socket | None:
        """An idle connection the server has not closed, or a new one (`fresh`: always) whose
        hello came by the call's `deadline`."""
        while True:
            with self._lock:
                if self._closed:
                    raise ClosedError("the client is closed: no request is sent")
                if self.dead:
                    return None
                sock = self._idle.pop() if self._idle and not fresh else None
            if sock is None:
                return self._open(deadline)
            if still_open(sock):
                return sock  # the server has not closed it
            sock.close()

    def _open(self, deadline: float) -> socket.socket | None:
        """A connection past the server's hello by `deadline` (monotonic), or None (`dead`)."""
        sock, hello = None, None
        try:
            sock = connect(self.address, deadline)  # room in the accept queue waited for
            if frames.same_user(sock):
                hello = read_frame(sock, 64, "the lane's hello", deadline)
        except (OSError, ReplyError):
            pass
        finally:  # interrupted before the hello, or no lane's: closed, never left open
            if sock is not None and hello != frames.HELLO:
                sock.close()
        if hello != frames.HELLO:  # not there, not our user's, or not a lane
            self.retry_at = time.monotonic() + RETRY_S
            return None
        return sock

    def _give(self, sock: socket.socket) -> None:
        """Keep `sock` for the next request, its request answered (counted in `calls`)."""
        with self._lock:
            self.calls += 1
            if not self._closed and self.retry_at != math.inf:
                self._idle.append(sock)
                return
        sock.close()


class AsyncLaneConnections(_Dead):
    """`LaneConnections` for `AsyncClient`: the same frames, contract and errors over asyncio
    streams (`request` is a coroutine; `aclose` closes the idle connections)."""

    def __init__(self, name: str, timeout_s: float, max_reply_bytes: int) -> None:
        self.address = "\0" + name
        self.timeout_s, self.limit = timeout_s, max_reply_bytes
        self.calls = 0
        self.retry_at = 0.0
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._closed = False
        self._slots = Slots()

    @classmethod
    def of(
        cls, name: object, timeout_s: float, max_reply_bytes: int, longest: object = None
    ) -> AsyncLaneConnections | None:
        checked = checked_name(name)
        if checked is None:
            return None
        lane = cls(checked, timeout_s, max_reply_bytes)
        lane.longest = longest_frame(longest)
        return lane

    async def request(self, path: str, body: bytes, headers: dict[str, str]) -> Reply | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s  # the whole call's, on the loop's clock
        short = path not in WAITING
        turn = self._slots.queue(time.monotonic() + self.timeout_s)
        try:
            if not await wait_turn_async(self._slots, turn, short, self._gone):
                return self._http()  # unsent: the lane is not out of reach (module doc)
        finally:
            self._slots.leave(turn)
        try:
            return await self._request(path, body, headers, deadline)
        finally:
            self._slots.give(short)

    async def _request(
        self, path: str, body: bytes, headers: dict[str, str], deadline: float
    ) -> Reply | None:
        call = f"POST {path} (lane)"
        request = [path, headers.get("authorization"), headers.get("x-kvtier-tenant"), body]
        data = frames.frame(request)
        if self.too_long(data):
            return None  # HTTP: unsent
        for fresh in (False, True):  # sent again once, on a new connection, after a goodbye
            stream = await self._take(fresh, deadline)
            if stream is None:
                return None
            reply = await self._send(stream, data, call, deadline)
            if reply is not _GOODBYE:
                if self._closed or self.retry_at == math.inf:
                    stream[1].close()
                else:
                    self._idle.append(stream)
                self.calls += 1
                status, content = reply_of(reply, call)
                return Reply(status, wire.MSGPACK, content, path)
        return None  # a goodbye on a new connection too (a server stopping): HTTP, unsent

    async def _send(
        self,
        stream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        data: bytes,
        call: str,
        deadline: float,
    ) -> Any:
        """`LaneConnections._send` on a stream, `deadline` on the loop's clock."""
        reader, writer = stream
        try:
            if deadline <= asyncio.get_running_loop().time():
                raise TimeoutError  # spent before a byte went: nothing sent
            async with asyncio.timeout_at(deadline):
                writer.write(data)
                if not writer.is_closing():
                    await writer.drain()
                elif frames.heard_goodbye(writer.get_extra_info("socket")):
                    writer.close()  # the write failed at once, after a goodbye still unread
                    return _GOODBYE
                reply = await read_frame_async(reader, self.limit, call)  # or one read
        except TimeoutError:
            writer.close()
            raise TransportTimeout(
                f"{call}: TimeoutError: not done within timeout_s ({self.timeout_s} s: sending "
                "and the whole reply)"
            ) from None
        except (OSError, EOFError, asyncio.IncompleteReadError) as exc:
            writer.close()
            raise TransportError(f"{call}: {type(exc).__name__}: {exc}") from None
        except BaseException:
            writer.close()
            raise
        if reply == frames.GOODBYE:
            writer.close()
            return _GOODBYE
        return reply

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        self._slots.wake_all()
        for _, writer in idle:
            writer.close()

    def drop(self) -> None:
        """Closed, from another event loop than its streams' (`loops.py`): its idle connections
        are dropped untouched (a closed loop cannot close them: their sockets close as they
        are collected)."""
        self._closed = True
        self._idle = []

    def retire(self) -> None:
        """Dead for good, its idle connections closed (module doc)."""
        self.retry_at = math.inf
        idle, self._idle = self._idle, []
        self._slots.wake_all()
        for _, writer in idle:
            writer.close()

    async def _take(
        self, fresh: bool, deadline: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        if self._closed:
            raise ClosedError("the client is closed: no request is sent")
        while self._idle and not fresh:
            idle = self._idle.pop()
            raw = idle[1].get_extra_info("socket")
            if not idle[0].at_eof() and not idle[1].is_closing() and still_open(raw):
                return idle  # the server has not closed it (seen yet by the loop, or not)
            idle[1].close()
        if self.dead:
            return None
        stream = None
        try:
            async with asyncio.timeout_at(deadline):  # the call's: its hello within it
                stream = await connect_async(self.address, deadline)
                ours = frames.same_user(stream[1].get_extra_info("socket"))
                hello = await read_frame_async(stream[0], 64, "the lane's hello") if ours else None
        except (OSError, EOFError, asyncio.IncompleteReadError, ReplyError):
            hello = None
        except BaseException:  # cancelled before the hello: closed, never left open (module doc)
            if stream is not None:
                stream[1].close()
            raise
        if stream is None or hello != frames.HELLO:  # not there, not our user's, not a lane
            if stream is not None:
                stream[1].close()
            self.retry_at = time.monotonic() + RETRY_S
            return None
        return stream
