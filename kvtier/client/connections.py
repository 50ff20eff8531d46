"""`Connections`: the blocking client's HTTP/1.1 keep-alive connections to its server, on the
standard library's `http.client`.

Why not httpx, which `AsyncClient` keeps: an engine calls the sidecar on every request, and a
call's latency is added to its time to first token. A lookup round trip took 0.93-1.03 ms
through `httpx.Client` and 0.49 ms through `http.client` on the same server and connection
reuse (this machine, 2 cores): httpx's pure-Python layers (httpcore, h11) cost about as much as
the server's whole answer.

Contract:
- `request(method, path, body, headers)` sends one request and reads the whole reply (`Reply`:
  status, content type, body bytes); safe from any number of threads: each request holds a
  connection of its own, taken from the idle ones or opened, and given back when its reply is
  read whole and the server keeps it open.
- An idle connection the server has closed (uvicorn ends one idle for 5 s) is found before it
  is used (its socket reads as ready: end of file; `still_open`, whatever the descriptor's
  number) and replaced, so a request is never sent on
  a connection known dead; a request is never sent twice.
- A server that answers before it has read the whole body (a 413 for a body over its limit)
  and closes: the send fails, and the answer sent is read and returned all the same, so the
  caller gets the refusal rather than a broken pipe.
- A call has `timeout_s` for the whole of it: connecting, sending its request and reading its
  whole reply, head (interim `100 Continue` replies too) and body (`Deadline`); each socket
  operation waits at most what is left, so a server that drips its reply a byte at a time
  cannot hold a call past `timeout_s`. Past it: a `TransportError` naming the call and the
  bound. (A load of 1 GiB through the body, the longest reply by default, takes about a second
  on a local link; the default `timeout_s` is 120 s.)
- Every failure to connect, send or read, a timeout, a reply that is not HTTP and a reply cut
  short of its Content-Length (or with one that is not ASCII digits, or a chunk size that is
  not hex digits: `DeadlineResponse`) is a `TransportError` naming the call (and the value);
  its connection is closed.
- A reply body longer than `max_reply_bytes` (a Content-Length that says so, or bytes that
  keep coming) is a `ReplyError`: no more than that is read, and the connection is closed.
- `close()` closes the idle connections; one in use is closed when its request ends. A request
  after it is a `ClosedError`, as httpx's closed client refused one.
"""

from __future__ import annotations

import http.client
import io
import math
import re
import select
import socket
import threading
import time
import urllib.parse
from typing import Any, NamedTuple

from kvtier.errors import ClosedError, InvalidArgumentError, KVTierError, ReplyError

_MAX_LINE = 65536
"""The longest chunk-size line read, as http.client's own bound (`_MAXLINE`)."""
MAX_REPLY_BYTES = (1 << 30) + (1 << 20)
"""The longest reply body a client reads by default: a KV as long as the server's default
`service.max_body_bytes` takes in (a load sent in the body), and room for the fields around it."""


class TransportError(KVTierError):
    """The server could not be reached, or its reply not read: connection refused or reset,
    a timeout, a reply that is not HTTP."""


class TransportTimeout(TransportError):
    """A `TransportError` of a call not done within its `timeout_s`: the server may be alive
    but slow (`integrations/lookups.Quiet` tells it from one that could not be reached)."""


class Reply(NamedTuple):
    status: int
    content_type: str | None
    content: bytes
    path: str  # the path asked, for the messages of a reply that does not decode


def check_url(url: object) -> tuple[urllib.parse.SplitResult, int | None]:
    """`url` split, and its port (None: the scheme's); `InvalidArgumentError` naming `url`
    unless it is `http(s)://host[:port][/path]` with a port in [1, 65535] (a query or fragment,
    which every call dropped, included); credentials in it (`user:password@`) are not shown."""
    expected = "http://host:port (or https://; an IPv6 host in brackets, a port in [1, 65535])"
    shown = re.sub(r"//[^/]*@", "//(credentials not shown)@", url) if isinstance(url, str) else url
    try:
        if not isinstance(url, str) or not url.strip().isprintable() or " " in url.strip():
            raise ValueError(url)  # (http.client refuses a space or a control in a host, untyped)
        parts = urllib.parse.urlsplit(url.strip())  # (a newline read with it from a file)
        port = parts.port  # urllib refuses a port that is no number, or past 65535
    except ValueError:
        raise InvalidArgumentError(f"url: got {shown!r:.200}, expected {expected}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise InvalidArgumentError(f"url: got {shown!r:.200}, expected {expected}")
    if parts.query or parts.fragment or url.strip().endswith(("?", "#")):  # (dropped unread)
        raise InvalidArgumentError(f"url: got {shown!r:.200}, expected no query or fragment")
    return parts, port


class Connections:
    def __init__(self, url: str, timeout_s: float, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        parts, port = check_url(url)
        self._https = parts.scheme == "https"
        self._host, self._port = str(parts.hostname), port  # `check_url`: a host is given
        self._base = parts.path.rstrip("/")
        self._timeout = timeout_s
        self._max_reply = max_reply_bytes
        self._idle: list[Deadline] = []
        self._lock = threading.Lock()
        self._closed = False

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Reply:
        conn = self._take()
        conn.deadline = time.monotonic() + self._timeout  # the whole call's (module doc)
        sent: OSError | None = None  # the send's failure, when the server stopped reading
        try:
            try:
                conn.request(method, self._base + path, body=body, headers=headers)
            except OSError as exc:
                if conn.sock is None or isinstance(exc, TimeoutError):
                    raise  # never connected, or a server that stopped reading: no answer
                sent = exc  # the server may have answered before it stopped reading (413)
            try:
                conn.sock.settimeout(conn.left())  # what `DeadlineResponse` has for the reply
                response = conn.getresponse()
                content = read_reply(response, self._max_reply, f"{method} {path}")
            except (OSError, http.client.HTTPException):
                if sent is not None:
                    raise sent from None  # no early answer: the send's failure is the news
                raise
        except TimeoutError:
            conn.close()
            raise TransportTimeout(
                f"{method} {path}: TimeoutError: not done within timeout_s ({self._timeout} s: "
                "connecting, sending and the whole reply)"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        except BaseException:
            conn.close()  # interrupted mid-request, or a reply too long: its state is unknown
            raise
        if response.will_close or sent is not None:  # a body half sent: the connection is done
            conn.close()
        else:
            self._give(conn)
        return Reply(response.status, response.getheader("content-type"), content, path)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> Deadline:
        while True:
            with self._lock:
                if self._closed:
                    raise ClosedError("the client is closed: no request is sent")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                kind = DeadlineTLS if self._https else Deadline
                return kind(self._host, self._port, timeout=self._timeout)
            sock = conn.sock
            if sock is not None and still_open(sock):
                return conn
            conn.close()

    def _give(self, conn: Deadline) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()


def still_open(sock: socket.socket) -> bool:
    """Whether an idle connection can take a request: nothing to read on it (a server that
    closed it reads as ready: end of file). `poll`, not `select`: `select` refuses a descriptor
    past FD_SETSIZE (1024) with a ValueError, and an engine process with many files and
    sockets open is handed such descriptors; every request after the first on a connection
    then failed untyped (both clients' blocking connections, `lane.py` too)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)  # POLLHUP and POLLERR come back unasked: not open either


def read_reply(response: http.client.HTTPResponse, limit: int, call: str) -> bytes:
    """`response`'s body, or `ReplyError` once it is known to pass `limit` bytes (before
    reading any when its Content-Length says so; after `limit` + 1 bytes when it does not).
    A Content-Length that is no count (negative: http.client would read to the end of the
    connection) or a body cut short of it is an `http.client.HTTPException` (`read(amt)`
    returns a short read as it is), as httpx refuses both."""
    length = response.getheader("content-length")
    if length is not None and _COUNT.fullmatch(length) is None:
        raise http.client.HTTPException(
            f"a Content-Length of {length!r:.40}, expected a count (ASCII digits)"
        )
    check_declared_length(length, limit, call)
    content = response.read(limit + 1)
    if len(content) > limit:
        raise reply_too_long(limit, call)
    if response.length:  # what its Content-Length still said was to come (None: no header)
        raise http.client.IncompleteRead(content, response.length)
    return content


_COUNT = re.compile(r"[ \t]*[0-9]+[ \t]*")
"""A Content-Length, as HTTP has it: ASCII digits (`str.isdigit` takes "²" and `str.strip`
drops "\\x1f", neither of which `int` reads: a raw `ValueError` escaped the call)."""
_CHUNK_SIZE = re.compile(rb"[ \t]*[0-9A-Fa-f]+[ \t]*(;[^\r\n]*)?\r?\n")
"""A chunk-size line: hex digits, an optional extension (`int(line, 16)`, which http.client
uses, takes "-1" too: a read to the end of the connection, past `max_reply_bytes`)."""


def check_declared_length(length: str | None, limit: int, call: str) -> None:
    """`ReplyError` when a reply's Content-Length header says it passes `limit` bytes (both
    clients, before they read the body); one that is no count is left to the caller (the
    blocking client refuses it, httpx does)."""
    if length is not None and _COUNT.fullmatch(length) and int(length) > limit:
        raise ReplyError(
            f"{call}: a reply of {int(length)} bytes, more than {limit} (max_reply_bytes)"
        )


def reply_too_long(limit: int, call: str) -> ReplyError:
    """The error of a reply whose bytes passed `limit` as they came (both clients)."""
    return ReplyError(f"{call}: a reply of more than {limit} bytes (max_reply_bytes)")


class Deadline(http.client.HTTPConnection):
    """An `http.client` connection whose calls each end by `deadline` (monotonic; set before
    each request): connecting, each send and each read of the reply wait at most what is left
    of it, then `TimeoutError`."""

    deadline = math.inf

    def left(self) -> float:
        """The seconds left until `deadline`; `TimeoutError` once none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        return left

    def connect(self) -> None:
        self.timeout = self.left()
        super().connect()

    def send(self, data: Any) -> None:
        if self.sock is not None:  # None: `connect` first, within what is left
            self.sock.settimeout(self.left())
        super().send(data)

    def response_class(  # type: ignore[override]  # a factory that hands on the deadline
        self, sock: socket.socket, debuglevel: int = 0, method: str | None = None
    ) -> http.client.HTTPResponse:
        return DeadlineResponse(sock, self.deadline, debuglevel, method)


class DeadlineTLS(Deadline, http.client.HTTPSConnection):
    """`Deadline` over TLS (its handshake within what is left too)."""


class DeadlineResponse(http.client.HTTPResponse):
    """A reply read by `deadline`: its head (status line, interim replies, headers) and body
    through `Until`, so each read of the socket waits at most what is left."""

    def __init__(
        self, sock: socket.socket, deadline: float, debuglevel: int = 0, method: str | None = None
    ) -> None:
        super().__init__(sock, debuglevel, method)
        # the socket's reader made above (unread; it keeps the socket open for this reply
        # after the connection lets go of it, as http.client's does), read through `Until`
        self.fp = io.BufferedReader(Until(self.fp.detach(), sock, deadline))

    def _read_next_chunk_size(self) -> int:
        """The next chunk's size, read as http.client does, but hex digits only: a line that
        is none (a negative size: http.client read the rest of the connection whole, past
        `max_reply_bytes`, or raised a raw `ValueError`) is an `HTTPException` naming it (a
        `TransportError` for the caller), its connection closed."""
        line = self.fp.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise http.client.LineTooLong("chunk size")
        if _CHUNK_SIZE.fullmatch(line) is None:
            self.close()  # where the body ends is not known: the connection is done
            raise http.client.HTTPException(
                f"a chunk size line of {line[:40]!r}, expected hex digits"
            )
        return int(line.split(b";", 1)[0], 16)


class Until(io.RawIOBase):
    """`raw` (a socket's reader), each read waiting at most until `deadline` (then
    `TimeoutError`); closing it closes `raw`."""

    def __init__(self, raw: io.RawIOBase, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.source, self.sock, self.deadline = raw, sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self.sock.settimeout(left)
        return self.source.readinto(buffer)

    def close(self) -> None:
        self.source.close()
        super().close()
