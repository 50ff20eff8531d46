"""What both clients put on the wire and read back from it, their transport aside.

Requests: `RequestHeaders`, the headers of every request (msgpack bodies both ways, the API
key as a bearer token, the tenant where no key names it); `direct`, `AsyncClient`'s transport
(no proxy of the environment); `alone_post`, `AsyncClient`'s POST on a connection of its own,
in the running event loop (a give-back after `aclose()`).
Replies: `reply_body(reply)`, a success's decoded body, or the error the server reported
raised as the store's own error type (`ERROR_TYPES`), else as a `ServiceError`; a body that
does not decode is a `ReplyError`. What a body holds is checked later, field by field
(`service/replies.py`). An error's kind and detail
are the server's words: cut (64, 2000 characters) and made `text.printable` before they are
raised, so a message of ours never carries a terminal escape or a forged line.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvtier.client.connections import (
    Reply,
    TransportError,
    TransportTimeout,
    check_declared_length,
    reply_too_long,
)
from kvtier.errors import ClosedError, InvalidArgumentError, KVTierError, ReplyError
from kvtier.service import wire
from kvtier.text import printable

ERROR_TYPES: dict[str, type[KVTierError]] = {
    kind: cls for cls, (_, kind) in wire.ERRORS.items() if cls is not ClosedError
}
"""Error kinds raised as the store's own error types (the server's table, `wire.ERRORS`); any
other kind (and any kind refused by the service itself: 401, 403, 413) is a `ServiceError`,
"closed" and "not_ready" (503) too."""


class ServiceError(KVTierError):
    """A refusal of the service itself: `status` (401, 403, 413, 503, ...) and `kind`."""

    def __init__(self, status: int, kind: str, detail: str) -> None:
        super().__init__(f"{status} {kind}: {detail}")
        self.status, self.kind, self.detail = status, kind, detail


REFUSALS: tuple[type[KVTierError], ...] = (ServiceError, *ERROR_TYPES.values())
"""The errors `reply_body` raises for a refusal the server answered: a prefetch or reserve
refused so was granted nothing (`releases.may_have_reached`)."""


_HEADER_TEXT = re.compile(r"[\x21-\x7e\xa1-\xff]([\x20-\x7e\xa0-\xff]*[\x21-\x7e\xa1-\xff])?")
"""What a header's value may be: printable latin-1 (as http.client sends it, and the server
reads it), without a space at either end."""


class RequestHeaders:
    """The headers of a client's requests; fixed at construction."""

    def __init__(self, api_key: str | None, tenant: str | None) -> None:
        """`api_key` (None: `$KVTIER_API_KEY`) selects the tenant when the server has auth;
        without a key, `tenant` names the tenant of every request that names none itself."""
        key = api_key if api_key is not None else os.environ.get("KVTIER_API_KEY")
        self.common = {
            "content-type": wire.MSGPACK,
            "accept": wire.MSGPACK,
            "accept-encoding": "identity",  # nothing to inflate (`httpx_send`)
        }
        if key:
            key = key.strip()  # as the server reads the header: a secret file's newline goes
            if not _HEADER_TEXT.fullmatch(key):
                raise InvalidArgumentError(
                    "api_key: expected printable latin-1 (an HTTP header carries it), got a key "
                    "that is not (not shown)"
                )
            self.common["authorization"] = f"Bearer {key}"
        if tenant:
            if not _HEADER_TEXT.fullmatch(tenant):
                raise InvalidArgumentError(f"tenant: expected a tenant id, got {tenant!r}")
            self.common["x-kvtier-tenant"] = tenant

    def for_tenant(self, tenant: str) -> dict[str, str]:
        """The headers of a call made for `tenant` ("default": the client's own); a key, when
        there is one, decides the tenant on the server, so it is sent as is."""
        if tenant == "default" or "authorization" in self.common:
            return self.common
        if type(tenant) is not str or not _HEADER_TEXT.fullmatch(tenant):  # before any send
            raise InvalidArgumentError(f"tenant: expected a tenant id (str), got {tenant!r:.80}")
        return {**self.common, "x-kvtier-tenant": tenant}


def httpx_headers(headers: dict[str, str]) -> httpx.Headers:
    """`headers` for an httpx request, encoded as latin-1, as http.client sends them and the
    server reads them (httpx encodes a str as ASCII: a latin-1 key or tenant would raise)."""
    return httpx.Headers(headers, encoding="latin-1")


async def httpx_send(client: httpx.AsyncClient, request: httpx.Request, limit: int) -> Reply:
    """Send `request` (`AsyncClient`'s) and read its reply as the `Reply` that `reply_body`
    reads: `limit` bytes of it at most, a `ReplyError` past them (as the blocking client's
    `read_reply`), raw (a content encoding is not undone: kvtier's server sends none, and
    asks for none); httpx's transport failures as `TransportError`, a call after `aclose()` as
    `ClosedError`. The whole call (connecting, sending, the whole reply) has the client's
    timeout (`AsyncClient`'s `timeout_s`; httpx's own bounds each read only, so a reply
    dripped a byte at a time would never end): past it, a `TransportError` naming the call
    and the bound, as `Connections.request`'s."""
    call = f"{request.method} {request.url.path}"
    if client.is_closed:  # httpx refuses with a bare RuntimeError: the blocking client's error
        raise ClosedError(f"{call}: the client is closed: no request is sent")
    bound = client.timeout.read
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(bound):
            response = await client.send(request, stream=True)
            try:
                check_declared_length(response.headers.get("content-length"), limit, call)
                size = 0
                async for chunk in response.aiter_raw():
                    size += len(chunk)
                    if size > limit:
                        raise reply_too_long(limit, call)
                    chunks.append(chunk)
            finally:
                await response.aclose()
    except TimeoutError:
        raise TransportTimeout(
            f"{call}: TimeoutError: not done within timeout_s ({bound} s: connecting, sending and "
            "the whole reply)"
        ) from None
    except httpx.TransportError as exc:
        raise TransportError(f"{call}: {type(exc).__name__}: {exc}") from None
    content_type = response.headers.get("content-type")
    return Reply(response.status_code, content_type, b"".join(chunks), request.url.path)


def direct() -> httpx.AsyncHTTPTransport:
    """`AsyncClient`'s transport: straight to the server's URL, as `Client`'s `http.client`
    goes, never through a proxy named by the environment (`HTTP_PROXY`, `ALL_PROXY`: httpx
    takes those unless given a transport, and sent them every request, the API key and the KV
    in it, for a sidecar on 127.0.0.1 too). The environment's CA files (`SSL_CERT_FILE`) still
    count for an https URL."""
    return httpx.AsyncHTTPTransport()


def alone_post(
    url: str, headers: RequestHeaders, limit: int
) -> Callable[[str, dict[str, Any], str, float], Awaitable[dict[str, Any]]]:
    """A POST over HTTP on a connection of its own, within its `timeout_s` (a give-back after
    `aclose()`, in what is left of its call's, at least `owing.GRACE_S`), in the running event
    loop."""

    async def post(
        path: str, body: dict[str, Any], tenant: str, timeout_s: float
    ) -> dict[str, Any]:
        content = wire.encode(body, True)
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, transport=direct()) as alone:
            asked = alone.build_request(
                "POST", path, content=content, headers=httpx_headers(headers.for_tenant(tenant))
            )
            return reply_body(await httpx_send(alone, asked, limit))

    return post


def reply_body(response: Reply) -> dict[str, Any]:
    """The body of a successful (2xx) response; the error it reports raised (`ERROR_TYPES`,
    else `ServiceError`), or `ReplyError` if it is no map. Any other status is a `ServiceError`
    too: a redirect is not followed (kvtier's server sends none), nor its body taken for the
    answer."""
    if not 200 <= response.status < 300:
        try:
            body = wire.decode(response.content, response.content_type)
            kind, detail = printable(body.get("error"), 64), printable(body.get("detail"), 2000)
        except wire.WireError:
            kind, detail = "http", printable(response.content[:200].decode("utf-8", "replace"))
        cls = ERROR_TYPES.get(kind)
        if cls is not None and response.status >= 400 and response.status not in (401, 403, 413):
            raise cls(detail)
        raise ServiceError(response.status, kind, detail)
    try:
        return wire.decode(response.content, response.content_type)
    except wire.WireError as exc:
        raise ReplyError(f"{response.path}: {exc.detail}") from None


class WaitTimeoutError(KVTierError, TimeoutError):
    """A wait on a pending lease without a timeout of the caller's (`prefetch(wait=True)`, a
    mapped `load`, `wait_for(lease)`) that the server kept PENDING past the client's own bound
    (`WaitPacer.MOST_WAIT_S`): the message names the lease and how long it waited."""


class WaitPacer:
    """The asks and pauses of one wait on a pending lease (`Client.wait_for`).

    The server holds each ask up to the wait asked for (`ASK_S`, bounded by its
    `prefetch_wait_s`), so an answer of PENDING that comes back well before that came from a
    server whose bound is short, or that does not wait at all (a broken or hostile one): asking
    again at once would spin. After such an answer the next ask waits a pause that doubles from
    `FIRST_S` to `MOST_S`; an answer that was held for its wait resets it. A pause never runs
    past the caller's deadline.

    The whole wait is bounded on the client's side too: a real server ends a pending lease
    within its ttl (at most its `policy.max_ttl_s`, 600 s by default), but a broken or hostile
    one may answer PENDING for ever. Without a deadline of the caller's, a wait still pending
    `MOST_WAIT_S` after it began is a `WaitTimeoutError` (`past_deadline`); a caller that expects
    longer waits (a server with a longer ttl) passes its own `timeout_s` to `wait_for`."""

    FIRST_S = 0.001
    MOST_S = 0.5
    HELD_S = 0.05  # an answer held this long (or the whole wait asked) was a real wait
    ASK_S = 30.0  # the wait each ask asks of the server, without a deadline
    MOST_WAIT_S = 600.0  # the longest wait without a deadline: the default `max_ttl_s`

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.began = time.monotonic()
        self._end = self.began + self.MOST_WAIT_S if deadline is None else deadline
        self._pause = 0.0

    def ask(self) -> tuple[float, float]:
        """When the next ask is sent (monotonic, now) and the wait it asks of the server."""
        now = time.monotonic()
        most = self.ASK_S if self.deadline is None else math.inf
        return now, max(0.0, min(most, self._end - now))

    def past_deadline(self, lease_id: int) -> bool:
        """After an answer of PENDING: whether the caller's deadline has passed (the wait
        returns the lease, pending); `WaitTimeoutError` when the client's own bound has."""
        now = time.monotonic()
        if now < self._end:
            return False
        if self.deadline is not None:
            return True
        raise WaitTimeoutError(
            f"lease {lease_id}: still pending after {now - self.began:.1f} s of waiting, "
            f"expected a server to end a pending lease within {self.MOST_WAIT_S} s (a wait "
            "without timeout_s is bounded there: pass timeout_s to wait longer)"
        )

    def after(self, asked_at: float, wait_s: float) -> float:
        """The pause before the next ask, for an answer of PENDING to an ask sent at
        `asked_at` (monotonic) that asked to wait `wait_s`."""
        now = time.monotonic()
        if now - asked_at >= min(wait_s, self.HELD_S):
            self._pause = 0.0
            return 0.0
        self._pause = min(max(2 * self._pause, self.FIRST_S), self.MOST_S)
        return max(0.0, min(self._pause, self._end - now))
