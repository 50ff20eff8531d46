"""uvicorn's HTTP protocol with bounds on a request's head: its size and the time it takes.

uvicorn's httptools protocol (its fastest, and the one `kvtier serve` runs) puts no limit on
the request line and headers, and no deadline on them: a client that sends part of a head and
stalls holds its connection forever (a few hundred such clients exhaust the server's file
descriptors), and a 64 MiB header is buffered whole. `bounded(max_head_bytes, timeout_s)` is
the same protocol with both bounds:

- the request line and headers together may hold `max_head_bytes` bytes of URL, names and
  values; past that the request is answered `431 {error: "head_too_large", detail}` and the
  connection closes;
- a head must be complete within `timeout_s` of its first byte (or of the connection, for the
  first request); past that the client gets `408 {error: "head_timeout", detail}` and the
  connection closes. The body has its own deadline in the app (`body.py`); between requests
  uvicorn's keep-alive timeout closes an idle connection.

- a refusal sent before the client has sent all it means to (a 413 for a body over the limit,
  a 408 or 431 mid-head) closes the connection by lingering: the server half-closes (its
  answer, then FIN) and reads and discards what still arrives, for `LINGER_S` or `LINGER_BYTES`
  at most, before it closes. Closing at once, with the client's bytes unread, makes the kernel
  reset the connection, and a client still sending then loses the answer: the blocking client
  saw a broken pipe and httpx a `ReadError` where the server had said 413. A close with
  nothing left to read (keep-alive off, an idle connection at shutdown) is immediate.

- a request the parser refuses (a malformed line or header, a negative or repeated
  Content-Length, one beside Transfer-Encoding) is `400 {error: "bad_request", detail}` naming
  what the parser met, not uvicorn's plain-text line; the connection closes. So is a request
  target with a fragment (`#`, which RFC 9112 does not allow there): httptools drops it and a
  query written after it, so `POST /v1/admin/clear#?tenants=b` reached the route as a clear of
  every tenant, past the edge's check of the query's names (`guard.py`).

- a request's scope carries `extensions["kvtier.abort"]`: it drops the connection at once,
  whatever is still buffered for it, so that a reply whose client stopped reading can be given
  up (`budget.HeldResponse`); a plain close would wait for the buffer to drain.

Where httptools is not installed, uvicorn's h11 protocol runs instead (`protocol_class`): it
bounds a head's size (h11's 16 KiB default) but not its time, closes without lingering, and
answers a malformed request with uvicorn's plain-text 400.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Callable
from typing import Any

HEAD_TOO_LARGE = 431
HEAD_TIMEOUT = 408
LINGER_S = 2.0  # how long a refused client may go on sending before the connection is reset
LINGER_BYTES = 256 << 20  # and how much of it is read and discarded at most


def protocol_class(max_head_bytes: int, timeout_s: float) -> type[asyncio.Protocol] | str:
    """The protocol for `uvicorn.Config(http=...)`: the bounded httptools one, or "h11"."""
    if importlib.util.find_spec("httptools") is None:
        return "h11"
    return bounded(max_head_bytes, timeout_s)


def _response(status: int, reason: str, kind: str, detail: str) -> bytes:
    body = json.dumps({"error": kind, "detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _malformed(msg: str) -> str:
    """What the parser refused, for a 400: its error's text (it names what it met: "invalid
    constant string", "Content-Length can't be present with Transfer-Encoding"), called as it
    is handled; uvicorn's `msg` where there is none."""
    error = sys.exc_info()[1]
    return f"a malformed HTTP request: {(str(error) if error else '') or msg:.200}"


def bounded(max_head_bytes: int, timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the bounds of the module docstring."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHead(HttpToolsProtocol):
        _head_bytes = 0
        _refusal: bytes | None = None
        _deadline: asyncio.TimerHandle | None = None
        _in_head = False  # a head begun and not complete, or one the parser refused
        _lingering: Lingering | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._lingering = Lingering(transport, self._input_pending)
            self.transport = self._lingering  # type: ignore[assignment]  # the cycles' too
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._lingering is not None:
                self._lingering.ended()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._lingering is not None and self._lingering.draining:
                self._lingering.discard(len(data))
                return
            super().data_received(data)

        def _input_pending(self) -> bool:
            """Whether the client may still be sending the current request."""
            return self._in_head or (self.cycle is not None and self.cycle.more_body)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._in_head = True
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            if b"#" in url:  # (the parser drops a fragment, and a query written inside it)
                detail = "request target with a fragment ('#'): expected a path and a query"
                self._refusal = _response(400, "Bad Request", "bad_request", detail)
                raise ValueError("fragment")  # the parser stops: send_400_response
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))  # (trailers too: within the head's bound)
            # After the head, a field is a chunked body's trailer, never a header (RFC 9110
            # 6.5.1): uvicorn appended it to the request's headers, so an Authorization or a
            # tenant sent there passed a proxy that vets the head (audit AZ). Dropped.
            if self._in_head:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._in_head = False
            extensions = self.scope.setdefault("extensions", {})
            extensions["kvtier.abort"] = self._abort  # type: ignore[assignment]
            super().on_headers_complete()

        def _abort(self) -> None:
            if self._lingering is not None:
                self._lingering.abort()

        def _unsupported_upgrade_warning(self) -> None:
            """kvtier serves no websocket (`ws="none"`): an `Upgrade:` request (websocket, a
            curl's h2c) is served as plain HTTP, said at debug level; uvicorn's two warnings
            told the operator to install a websocket library, which would change nothing."""
            self.logger.debug("an Upgrade request served as plain HTTP (kvtier has no websocket)")

        def send_400_response(self, msg: str) -> None:
            self._in_head = True  # a head the parser stopped reading: more of it may come
            refusal = self._refusal
            if refusal is None:  # a malformed request: as `{error, detail}` too, not uvicorn's
                refusal = _response(400, "Bad Request", "bad_request", _malformed(msg))
            self.transport.write(refusal)
            self.transport.close()

        def _count(self, nbytes: int) -> None:
            self._head_bytes += nbytes
            if self._head_bytes > max_head_bytes:
                self._refusal = _response(
                    HEAD_TOO_LARGE,
                    "Request Header Fields Too Large",
                    "head_too_large",
                    f"request line and headers of more than {max_head_bytes} bytes",
                )
                raise ValueError("head too large")  # the parser stops: send_400_response

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            detail = f"the request head did not arrive within {timeout_s} s"
            self.transport.write(_response(HEAD_TIMEOUT, "Request Timeout", "head_timeout", detail))
            self.transport.close()

    return BoundedHead


class Lingering:
    """A connection's transport whose `close()` lingers while `input_pending()` (module doc):
    write EOF after what is buffered, read on and discard (`discard`, from the protocol's
    `data_received`) until the client closes, `LINGER_S` pass or `LINGER_BYTES` arrive. All
    else is the transport's own. `is_closing()` is true from the first `close()`, so nothing
    more is written."""

    def __init__(self, transport: asyncio.Transport, input_pending: Callable[[], bool]) -> None:
        self._transport = transport
        self._input_pending = input_pending
        self.draining = False
        self._drained = 0
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.draining or self._transport.is_closing()

    def abort(self) -> None:
        """Drop the connection now, unsent bytes and all (`connection_lost` follows)."""
        if self._timer is not None:
            self._timer.cancel()
        self._transport.abort()

    def close(self) -> None:
        transport = self._transport
        if self.draining or transport.is_closing():
            return
        if not self._input_pending() or not transport.can_write_eof():
            transport.close()
            return
        self.draining = True
        transport.write_eof()  # the answer, then FIN
        transport.resume_reading()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def discard(self, nbytes: int) -> None:
        self._drained += nbytes
        if self._drained > LINGER_BYTES:
            self._transport.close()

    def ended(self) -> None:
        """The connection is gone: no timer left behind."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
