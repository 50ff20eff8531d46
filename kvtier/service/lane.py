"""The local lane: the data plane's small calls over a Unix socket, past HTTP.

An engine calls the sidecar on every request (lookup; prefetch, which a shared-memory load is;
reserve and commit, which a shared-memory store is; release), and each call's latency is added
to its time to first token. Over HTTP a lookup took 0.64-0.89 ms on this project's machine:
0.26 ms of CPU in the client's `http.client`, 0.4 ms in the server's uvicorn, Starlette and
FastAPI layers and its hop to a worker thread, while a Unix-socket round trip of a msgpack frame
took 0.03 ms. A client that maps the server's pools (same host, same user:
`service.shared_memory`) reaches this lane too: the server names it in `GET /v1/pools`
(`lane`), and a client that cannot reach it stays on HTTP (`kvtier/client/lane.py`).

    Lane(service, handlers).start() -> name    listens; `stop()` closes it and its connections,
                                               the calls in progress answered first

Where: an abstract Unix socket (Linux: no file, nothing left behind by a SIGKILL), named
`kvtier-lane-<pid>-<8 hex>` (`frames.NAME`), with a backlog of `BACKLOG` connects (at 64, four
clients opening their 64 connections at once had most refused, EAGAIN, and took HTTP). Who: a
peer whose uid (SO_PEERCRED) is not the server's is closed before a byte is read or sent: the
trust boundary of the /dev/shm segments (mode 0600, the server's user), which such a peer could
map anyway. Auth and tenants are the HTTP routes': each request carries its key, admitted as a
header would be (`admission.py`).

How: a thread per connection (at most `MAX_CONNECTIONS`), blocked in `recv` between requests,
runs each call's handler itself (`plane.py`'s, prefetch waiting for its lease there): no event
loop, no hop to a worker thread. The store is thread-safe, as the HTTP routes' worker threads
already rely on.

Frames: a 4-byte little-endian length, then msgpack.
    the server's hello, once, on accepting:  "kvtier-lane 1" (`frames.HELLO`)
    request                                  [path, authorization, tenant, body]
                                             (str; str or nil; str or nil; msgpack bytes)
    reply                                    [status, body]  (int; the HTTP reply's body bytes)
    the server's goodbye, last, on a connection it ends between calls: "kvtier-lane goodbye"
                                             (`frames.GOODBYE`)
A request is answered as its POST is over HTTP (`/v1/leases`: as `GET /v1/leases/{id}`, the id
and `wait_s` in the body; `frames.PATHS`): the same handler, body limit
(`service.max_body_bytes`: 413), decoding, typed errors (`wire.classify`) and metrics, so a
client reads a lane reply as it reads an HTTP one.

Admitted on its head, held before its body: a frame's first `frames.HEAD_BYTES` (64 KiB, or the
whole frame when shorter) are read first, and its path, key and tenant (which a longer frame
must hold there) are admitted as HTTP admits headers: a malformed head (400), a path the lane
does not carry (404), a key refused (401, 403), a body past `max_body_bytes` (413), a tenant
not listed (without keys; 403) is answered before another byte is read. A longer frame's body
is then held in `service.max_inflight_bytes` as HTTP holds a `Content-Length` (`budget.py`, on
the event loop the lane started on: waits for room, 503 busy past `body_timeout_s`), read, and
given back once answered (or once its connection is ended mid-body). So a peer without a key
holds at most `HEAD_BYTES` a connection, and a tenant no more than its share. The rest of a
frame refused before it was read is read and dropped (in `HEAD_BYTES` of memory) after the
refusal is sent: the connection goes on. (A frame of at most `HEAD_BYTES`, as a lookup of up to
some 16,000 tokens is, is not charged: 16 MiB at most over `MAX_CONNECTIONS`, as HTTP's headers
are not; a charged one costs a hop to the event loop, some 0.06 ms.)

Time and room: a frame has `service.body_timeout_s` from its first byte to its head's end, and
as long again from its admission (past any wait for room) to its end, or to the end of the
dropped rest; a reply its client does not take within that long closes the connection, and one
it leaves unread for `STALL_S` (`lane_state.py`) lets room-making cut it (no goodbye: a frame
is under way): before, 256 peers that sent calls and read no reply held every connection. A
connection opens to send a call: one without a frame within `min(body_timeout_s,
FIRST_FRAME_S)` of its hello is closed, and one idle for `IDLE_S` between calls. At
`MAX_CONNECTIONS`, a new connection makes room: the one idle longest is closed, before the new
one's hello. Idle: since its hello, its last reply, or its frame's first byte while that frame
is still read (its head, its body, or the body's wait for room in the budget, which is then
cancelled and its hold given back: `lane_state.py`); answering, never closed for room: its
hello, and a call from its frame read whole and admitted (or refused) to its reply (but for one
its peer leaves unread, above). So peers that hold connections without calls, with frames they
never finish, or with replies they never read, cannot push other clients off the lane (a
client finds its idle connection closed and opens another). Only with every connection
answering a call (or its hello) is a new one closed before the hello (its client stays on
HTTP).

Goodbye: a connection ended between calls (for room, idle past `IDLE_S` or its first frame's
bound, or by `stop`) gets `frames.GOODBYE`, written without waiting (`frames.say_goodbye`;
skipped where the peer's buffer is full), then is shut down; a Unix socket's peer reads what
was sent before the close, then the end. No request sent on it after is answered: the one
ending it takes it off the open ones first, under the lock `_mark` takes, and a connection's
thread answers a frame (or refuses one, or sends a hello) only once `_mark` has found it open
and marked it answering, which `_make_room` and `stop` skip; its thread, ending it idle, reads
nothing more. And a reply is always written before a goodbye: a thread writes only while its
connection is marked answering, the ender only once it is not. So a client that reads the
goodbye where it expected a reply sends the call again (`kvtier/client/lane.py`): a call that
crossed the close is not lost to a `TransportError`. A frame begun when its connection is ended
(for room, or by `stop`), its body read or not, is not answered either (it was not read whole).
Ending one answering a call, or one too slow mid-frame, writes no goodbye. `stop` (SIGTERM) ends
the idle ones at once and each one answering a call, or still reading one (`reading`: room-making
may end it, `stop` does not), once its reply is sent (as HTTP finishes the requests in
progress); only one still at it after `STOP_S` is cut.

Counted: a frame answered (its reply made, a refusal too: 400, 404, 401, ...) counts once in
`kvtier_lane_requests_total` and in `kvtier_request_seconds` (its path's series, `other` for a
path the lane does not carry or a malformed frame), timed from its head read to its reply, as
HTTP counts its requests, just before the reply is sent (a reply whose send fails counts);
one left unanswered (its connection ended mid-body, for room, or too slow) counts in
neither. (Before, the 400s and 404s were not counted, and a frame cut off mid-body was.)

Hostile input: a frame longer than `frame_limit(config)` (the tokens `service.max_tokens`
allows, and 1 MiB of fields) closes the connection before its body is read; one slower than
its bounds above closes it; a frame that is not that array, or names a path the lane does not
carry, is answered 400 or 404 as `{error, detail}`, and the connection goes on. An accept that
fails (the process out of file descriptors, which a peer opening connections can bring about)
is tried again every `ACCEPT_RETRY_S`: the lane serves again once it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from typing import cast

from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError
from kvtier.service import frames, wire
from kvtier.service.admission import Service, tenant_of_key
from kvtier.service.lane_state import Connection, Gone, LaneCall, refusal
from kvtier.service.plane import Handler

log = logging.getLogger("kvtier.service")

MAX_CONNECTIONS = 256
IDLE_S = 600.0
FIRST_FRAME_S = 5.0  # a connection's first frame: min(this, service.body_timeout_s) after hello
STOP_S = 5.0  # how long `stop` waits for the connections' threads
ACCEPT_RETRY_S = 0.1  # how long the lane waits after an accept fails (EMFILE)
BACKLOG = 4096  # connects not yet accepted (the kernel's somaxconn caps it): module doc, "Where"


def frame_limit(config: KVTierConfig) -> int:
    """The longest request frame the lane reads: the tokens allowed, and 1 MiB of fields."""
    return frames.longest(config.service.max_tokens)


class Lane:
    def __init__(self, service: Service, handlers: dict[str, Handler]) -> None:
        self.service, self.handlers = service, handlers
        self.limit = frame_limit(service.config)
        self.timeout_s = service.config.service.body_timeout_s
        self.first_s = min(self.timeout_s, FIRST_FRAME_S)
        self.max_body = service.config.service.max_body_bytes
        self.max_tokens = service.config.service.max_tokens
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: dict[socket.socket, Connection] = {}
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> str | None:
        """Listen on a new lane; its name, or None (logged) when it cannot listen. Called on
        the event loop whose `service.budget` its calls are charged to (the app's lifespan)."""
        self._loop = asyncio.get_running_loop()
        name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + name)
            listener.listen(BACKLOG)
        except OSError as exc:
            listener.close()
            log.warning("kvtier: the local lane could not listen (%s); clients use HTTP", exc)
            return None
        self._listener = listener
        threading.Thread(target=self._accept, name="kvtier-lane", daemon=True).start()
        return name

    def stop(self) -> None:
        """Stop listening, end the idle connections (`GOODBYE`), and each one answering a call
        once its reply is sent; wait `STOP_S` at most, then cut the ones still answering."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            listener.close()
        with self._lock:  # (no thread closes its connection while it is ended here)
            self._stopping = True  # a reply sent from now ends its connection (`_mark`)
            open_now = list(self._open.items())
            for conn, state in open_now:
                if not state.answering and not state.reading:  # idle: its client sends again
                    self._end(conn)
                    frames.say_goodbye(conn)
        deadline = time.monotonic() + STOP_S
        for _, state in open_now:
            state.thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for conn in self._open:  # answering past `STOP_S`: cut
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv

    def _accept(self) -> None:
        failing = False
        while (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._listener is not listener:
                    return  # closed by `stop`
                if not failing:  # out of descriptors (a peer can cause it): wait, not end
                    log.warning("kvtier: the local lane cannot accept (%s); retrying", exc)
                failing = True
                time.sleep(ACCEPT_RETRY_S)
                continue
            failing = False
            if not frames.same_user(conn):
                conn.close()
                continue
            with self._lock:
                self._make_room()  # before the new one's hello: its peer sees the end
                taken = len(self._open) < MAX_CONNECTIONS and self._listener is not None
                if taken:
                    state = Connection(threading.Thread(
                        target=self._serve, args=(conn,), name="kvtier-lane-conn", daemon=True
                    ))  # fmt: skip
                    self._open[conn] = state
                    state.thread.start()
            if not taken:
                conn.close()  # every one answering a call: this one stays on HTTP

    def _make_room(self) -> None:
        """At `MAX_CONNECTIONS`, end the connection idle longest (`Connection.idle`: not
        answering a call, or its reply unread for `STALL_S`), under the lock: with `GOODBYE`,
        or cut without one where a reply is stalled on it (no frame into its middle); its
        thread sees the end and goes. Nothing below the bound or with none idle."""
        if len(self._open) < MAX_CONNECTIONS:
            return
        now = time.monotonic()
        idle = [(state.since, id(conn), conn) for conn, state in self._open.items()
                if state.idle(now)]  # fmt: skip
        if not idle:
            return
        conn = min(idle)[2]
        stalled = self._open[conn].stalled
        self._end(conn)
        if stalled:  # its thread's send fails (EPIPE): the connection is done
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        else:
            frames.say_goodbye(conn)

    def _end(self, conn: socket.socket) -> None:
        """Take idle `conn` off the open ones (under the lock), its wait for room cancelled;
        the caller ends it (`GOODBYE`), which wakes its thread from a read of a frame."""
        self._open.pop(conn).end()

    def _mark(self, conn: socket.socket, answering: bool, reading: bool = False) -> bool:
        """Mark `conn` answering a call (not to be ended for room), or idle again from now (a
        frame begun, a reply sent); False when it was ended (for room, or by `stop`) already:
        a thread writes on its connection only while marked answering, so `GOODBYE` is the
        last frame of one ended idle, and none of a request sent after it is answered."""
        with self._lock:
            state = self._open.get(conn)
            if state is None:
                return False
            if self._stopping and not answering:  # its reply sent (or none begun): ended
                self._end(conn)
                frames.say_goodbye(conn)
                return False
            state.answering, state.reading = answering, reading and not answering
            state.stalled = False
            if not answering:
                state.since = time.monotonic()
            return True

    def _serve(self, conn: socket.socket) -> None:
        """One connection (module doc), until it ends, idles or sends a frame too long."""
        metrics = self.service.metrics
        metrics.lane_connections.inc()
        try:
            conn.sendall(frames.frame(frames.HELLO))  # answering until sent: never ended
            if not self._mark(conn, False):  # before it (so `GOODBYE` never cuts into it)
                return
            wait_s = self.first_s  # a connection opens to send a call: soon
            while True:
                conn.settimeout(wait_s)
                try:
                    first = frames.read_exactly(conn, 1)  # a frame's time runs from its first byte
                except TimeoutError:  # idle past its bound: ended with `GOODBYE`
                    self._end_idle(conn)
                    return
                if not self._mark(conn, False, reading=True):  # (the last one ended for room)
                    return
                deadline = time.monotonic() + self.timeout_s
                rest = frames.read_exactly(conn, frames.LENGTH.size - 1, deadline)
                (length,) = frames.LENGTH.unpack(first + rest)
                if length > self.limit:
                    return  # its body is not read: the connection is done
                head = frames.read_exactly(conn, min(length, frames.HEAD_BYTES), deadline)
                call = LaneCall(conn, length, head)
                try:
                    reply = frames.frame(list(self.answer(call)))
                finally:
                    call.release(self._loop)
                if not call.answering and not self._mark(conn, True):  # a refusal, unmarked
                    return  # ended for room while its head was read: its client sends again
                # answered: counted before it is sent, so that a client that reads the metrics
                # after its reply finds it there (module doc, "Counted")
                metrics.observe(call.path, time.perf_counter() - call.started)
                metrics.lane_requests.inc()
                self._send(conn, reply)
                if not self._mark(conn, False):
                    return
                if call.unread:  # refused before its body was read: it is skipped
                    frames.skip(conn, call.unread, time.monotonic() + self.timeout_s)
                wait_s = IDLE_S
        except (OSError, Gone):
            return  # gone, idle, too slow, ended for room, or stopped: nothing to answer
        finally:
            metrics.lane_connections.dec()
            with self._lock:  # closed under it: never while `GOODBYE` is written to it
                self._open.pop(conn, None)
                conn.close()

    def _send(self, conn: socket.socket, reply: bytes) -> None:
        """Send `reply` on `conn` (marked answering), within `body_timeout_s`. While its peer's
        buffer cannot take the rest, the connection is `stalled` since the last bytes it took
        (`Connection.idle`: room may end it after `STALL_S` without progress, which fails the
        send; a slow reader that keeps reading is not cut)."""
        rest, deadline = memoryview(reply), time.monotonic() + self.timeout_s
        while rest:
            conn.settimeout(0)
            try:
                rest = rest[conn.send(rest) :]
                continue
            except BlockingIOError:
                pass
            with self._lock:
                state = self._open.get(conn)
                if state is not None:
                    state.stalled, state.since = True, time.monotonic()
            conn.settimeout(max(deadline - time.monotonic(), 1e-6))  # past it: TimeoutError
            rest = rest[conn.send(rest) :]  # once the peer has read some

    def _end_idle(self, conn: socket.socket) -> None:
        """End `conn` idle past its bound with `GOODBYE` (unless it was ended already)."""
        with self._lock:
            if self._open.pop(conn, None) is not None:
                frames.say_goodbye(conn)

    def answer(self, call: LaneCall) -> tuple[int, bytes]:
        """The status and body bytes of one request frame (module doc): its head admitted
        first, then its body charged to the budget and read (`call.unread` left on a
        refusal)."""
        try:
            head = frames.request_head(call.head, call.length)
        except ValueError as exc:
            return refusal(400, "malformed_frame", str(exc))
        call.path = head.path
        handler = self.handlers.get(head.path)
        if handler is None:
            carried = ", ".join(sorted(self.handlers))
            return refusal(404, "not_found", f"path {head.path[:64]!r}: the lane carries {carried}")
        try:
            store = self.service.ready_store()
            tenant = tenant_of_key(self.service, head.authorization, head.tenant, head.path)
            if head.body_length > self.max_body:
                raise wire.WireError(
                    413, "body_too_large",
                    f"body of {head.body_length} bytes, more than "
                    f"service.max_body_bytes={self.max_body}",
                )  # fmt: skip
            try:  # waiting on room or on its peer for the body: idle (`_make_room` may end it)
                if call.unread:
                    self._charge(call, tenant, head.body_length)
                    call.read_rest(time.monotonic() + self.timeout_s)
                if not self._mark(call.conn, True):
                    raise ConnectionResetError("ended for room")
                call.answering = True
            except OSError as exc:  # the connection, not the call: nothing to answer
                raise Gone(str(exc)) from None
            body = cast(bytes, memoryview(call.head)[head.body_at :])  # read in place (`flat`)
            data = wire.decode_request(body, wire.MSGPACK, self.max_tokens) if body else {}
            return 200, wire.encode(handler(store, tenant, data), True)
        except wire.WireError as exc:
            return refusal(exc.status, exc.kind, exc.detail)
        except KVTierError as exc:
            return refusal(*wire.classify(exc), str(exc))
        except Gone:
            raise
        except Exception as exc:  # as `Guard` answers one over HTTP
            log.exception("kvtier: unexpected error in lane %s", head.path)
            detail = f"an unexpected {type(exc).__name__}; the server's log has the traceback"
            return refusal(500, "internal", detail)

    def _charge(self, call: LaneCall, tenant: str, nbytes: int) -> None:
        """Hold the body's `nbytes` in `service.budget` before it is read, as HTTP holds a
        `Content-Length` (`budget.py`: waits for room, 503 busy past `body_timeout_s`)."""
        loop = self._loop
        assert loop is not None, "the lane charges its budget on the loop it started on"
        with self._lock:
            state = self._open.get(call.conn)
        if state is None:
            raise ConnectionResetError("ended before it waited for room")
        call.hold = self.service.budget.hold(tenant, self.service.auth.enabled)
        call.wait_for_room(state, nbytes, (loop, self._lock), self.timeout_s, STOP_S)
