"""Reading a request body with bounds on its size and on the time it takes.

    await read_body(request, limit, timeout_s, limit_name) -> bytearray

- Size: a `Content-Length` over `limit` is refused (413) before a byte is read; a body without
  one (chunked) is read chunk by chunk with a running count and refused as soon as the count
  passes `limit`, so memory held for a refused body stays under `limit` plus one chunk (uvicorn
  stops reading a socket whose data the app has not taken).
- Time: the whole body must arrive within `timeout_s` (`service.body_timeout_s`), else 408: a
  client that sends headers and half a body holds a connection that long, not forever.
- A client that hangs up before its body is complete raises `Disconnected` (quietly: it is
  counted, not logged; no answer can reach it).

After a 413 or 408 the rest of the body is left unread: the refusal closes the connection.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from kvtier.service.wire import WireError


class Disconnected(Exception):
    """The client hung up before its request body was complete."""


async def read_body(
    request: Request, limit: int, timeout_s: float, limit_name: str = "service.max_body_bytes"
) -> bytearray:
    """The body of `request` (as read: no copy); `WireError` 413 past `limit` bytes (what sets
    it: `limit_name`), 408 past `timeout_s`."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise WireError(
            413, "body_too_large",
            f"body of {length} bytes, more than {limit_name}={limit}",
        )  # fmt: skip
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise WireError(
                        413, "body_too_large",
                        f"body of more than {limit} bytes ({limit_name}), refused "
                        "as it was read",
                    )  # fmt: skip
    except TimeoutError:
        raise WireError(
            408, "body_timeout",
            f"the body did not arrive within service.body_timeout_s={timeout_s} s "
            f"({len(body)} bytes came)",
        ) from None  # fmt: skip
    except ClientDisconnect:
        raise Disconnected from None
    return body
