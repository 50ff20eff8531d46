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

Where httptools is not installed, uvicorn's h11 protocol runs instead (`protocol_class`): it
bounds a head's size (h11's 16 KiB default) but not its time.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

HEAD_TOO_LARGE = 431
HEAD_TIMEOUT = 408


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


def bounded(max_head_bytes: int, timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the bounds of the module docstring."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHead(HttpToolsProtocol):
        _head_bytes = 0
        _refusal: bytes | None = None
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if self._refusal is None:  # a malformed request: uvicorn's own answer
                super().send_400_response(msg)
                return
            self.transport.write(self._refusal)
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
