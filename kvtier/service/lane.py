"""The local lane: the data plane's small calls over a Unix socket, past HTTP.

An engine calls the sidecar on every request (lookup; prefetch, which a shared-memory load is;
reserve and commit, which a shared-memory store is; release), and each call's latency is added
to its time to first token. Over HTTP a lookup took 0.64-0.89 ms on this project's machine:
0.26 ms of CPU in the client's `http.client`, 0.4 ms in the server's uvicorn, Starlette and
FastAPI layers and its hop to a worker thread, while a Unix-socket round trip of a msgpack frame
took 0.03 ms. A client that maps the server's pools (same host, same user:
`service.shared_memory`) reaches this lane too: the server names it in `GET /v1/pools`
(`lane`), and a client that cannot reach it stays on HTTP (`kvtier/client/lane.py`).

    Lane(service, handlers).start() -> name    listens; `stop()` closes it and its connections

Where: an abstract Unix socket (Linux: no file, nothing left behind by a SIGKILL), named
`kvtier-lane-<pid>-<8 hex>` (`frames.NAME`). Who: a peer whose uid (SO_PEERCRED) is not the
server's is closed before a byte is read or sent: the trust boundary of the /dev/shm segments
(mode 0600, the server's user), which such a peer could map anyway. Auth and tenants are the
HTTP routes': each request carries its key, admitted as a header would be (`admission.py`).

How: a thread per connection (at most `MAX_CONNECTIONS`), blocked in `recv` between requests,
runs each call's handler itself (`plane.py`'s, prefetch waiting for its lease there): no event
loop, no hop to a worker thread. The store is thread-safe, as the HTTP routes' worker threads
already rely on.

Frames: a 4-byte little-endian length, then msgpack.
    the server's hello, once, on accepting:  "kvtier-lane 1" (`frames.HELLO`)
    request                                  [path, authorization, tenant, body]
                                             (str; str or nil; str or nil; msgpack bytes)
    reply                                    [status, body]  (int; the HTTP reply's body bytes)
A request is answered as its POST is over HTTP (`/v1/leases`: as `GET /v1/leases/{id}`, the id
and `wait_s` in the body; `frames.PATHS`): the same handler, body limit
(`service.max_body_bytes`: 413), decoding, typed errors (`wire.classify`) and metrics, so a
client reads a lane reply as it reads an HTTP one.

Hostile input: a frame longer than `frame_limit(config)` (the tokens `service.max_tokens`
allows, and 1 MiB of fields) closes the connection before its body is read; a frame that does
not arrive whole within `service.body_timeout_s`, or a reply its client does not take within
that long, closes it; a frame that is not that array, or names a path the lane does not carry,
is answered 400 or 404 as `{error, detail}`, and the connection goes on. Past
`MAX_CONNECTIONS` a connection is closed before the hello (its client stays on HTTP); a
connection idle for `IDLE_S` is closed. An accept that fails (the process out of file
descriptors, which a peer opening connections can bring about) is tried again every
`ACCEPT_RETRY_S`: the lane serves again once it can.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time

from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError
from kvtier.service import flat, frames, wire
from kvtier.service.admission import Service, tenant_of_key
from kvtier.service.plane import Handler

log = logging.getLogger("kvtier.service")

MAX_CONNECTIONS = 256
IDLE_S = 600.0
STOP_S = 5.0  # how long `stop` waits for the connections' threads
ACCEPT_RETRY_S = 0.1  # how long the lane waits after an accept fails (EMFILE)


def frame_limit(config: KVTierConfig) -> int:
    """The longest request frame the lane reads: the tokens allowed, and 1 MiB of fields."""
    return 4 * config.service.max_tokens + (1 << 20)


class Lane:
    def __init__(self, service: Service, handlers: dict[str, Handler]) -> None:
        self.service, self.handlers = service, handlers
        self.limit = frame_limit(service.config)
        self.timeout_s = service.config.service.body_timeout_s
        self.max_body = service.config.service.max_body_bytes
        self.max_tokens = service.config.service.max_tokens
        self._listener: socket.socket | None = None
        self._open: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()

    def start(self) -> str | None:
        """Listen on a new lane; its name, or None (logged) when it cannot listen."""
        name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + name)
            listener.listen(64)
        except OSError as exc:
            listener.close()
            log.warning("kvtier: the local lane could not listen (%s); clients use HTTP", exc)
            return None
        self._listener = listener
        threading.Thread(target=self._accept, name="kvtier-lane", daemon=True).start()
        return name

    def stop(self) -> None:
        """Stop listening, end every connection and wait (up to `STOP_S`) for their threads."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            listener.close()
        with self._lock:
            open_now = list(self._open.items())
        for conn, _ in open_now:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        deadline = time.monotonic() + STOP_S
        for _, thread in open_now:
            thread.join(max(0.0, deadline - time.monotonic()))

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
            with self._lock:
                full = len(self._open) >= MAX_CONNECTIONS
                if not full and frames.same_user(conn) and self._listener is not None:
                    thread = threading.Thread(
                        target=self._serve, args=(conn,), name="kvtier-lane-conn", daemon=True
                    )
                    self._open[conn] = thread
                    thread.start()
                    continue
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        """One connection (module doc), until it ends, idles or sends a frame too long."""
        metrics = self.service.metrics
        metrics.lane_connections.inc()
        try:
            conn.sendall(frames.frame(frames.HELLO))
            while True:
                conn.settimeout(IDLE_S)
                first = frames.read_exactly(conn, 1)  # a frame's time runs from its first byte
                deadline = time.monotonic() + self.timeout_s
                rest = frames.read_exactly(conn, frames.LENGTH.size - 1, deadline)
                (length,) = frames.LENGTH.unpack(first + rest)
                if length > self.limit:
                    return  # its body is not read: the connection is done
                payload = frames.read_exactly(conn, length, deadline)
                reply = frames.frame(list(self.answer(payload)))
                conn.settimeout(self.timeout_s)  # a client that does not read it is cut off
                conn.sendall(reply)
        except OSError:
            return  # gone, idle, too slow, or stopped: nothing to answer
        finally:
            metrics.lane_connections.dec()
            with self._lock:
                self._open.pop(conn, None)
            conn.close()

    def answer(self, payload: bytes) -> tuple[int, bytes]:
        """The status and body bytes of one request frame (module doc)."""
        try:
            request = flat.loads_msgpack(payload, 4, top=list)
        except flat.Malformed as exc:
            return _refusal(400, "malformed_frame", f"not a request frame: {exc}")
        if not (
            isinstance(request, list)
            and len(request) == 4
            and isinstance(request[0], str)
            and all(v is None or isinstance(v, str) for v in request[1:3])
            and isinstance(request[3], bytes | memoryview)
        ):
            return _refusal(
                400, "malformed_frame",
                "expected [path: str, authorization: str | nil, tenant: str | nil, body: bytes]",
            )  # fmt: skip
        path, authorization, named, body = request
        handler = self.handlers.get(path)
        if handler is None:
            carried = ", ".join(sorted(self.handlers))
            return _refusal(404, "not_found", f"path {path[:64]!r}: the lane carries {carried}")
        started = time.perf_counter()
        try:
            store = self.service.ready_store()
            tenant = tenant_of_key(self.service, authorization, named)
            if len(body) > self.max_body:
                raise wire.WireError(
                    413, "body_too_large",
                    f"body of {len(body)} bytes, more than service.max_body_bytes={self.max_body}",
                )  # fmt: skip
            data = wire.decode_request(body, wire.MSGPACK, self.max_tokens) if body else {}
            return 200, wire.encode(handler(store, tenant, data), True)
        except wire.WireError as exc:
            return _refusal(exc.status, exc.kind, exc.detail)
        except KVTierError as exc:
            return _refusal(*wire.classify(exc), str(exc))
        except Exception as exc:  # as `Guard` answers one over HTTP
            log.exception("kvtier: unexpected error in lane %s", path)
            detail = f"an unexpected {type(exc).__name__}; the server's log has the traceback"
            return _refusal(500, "internal", detail)
        finally:
            self.service.metrics.observe(path, time.perf_counter() - started)
            self.service.metrics.lane_requests.inc()


def _refusal(status: int, kind: str, detail: str) -> tuple[int, bytes]:
    return status, wire.encode({"error": kind, "detail": detail}, True)
