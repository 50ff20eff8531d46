"""The sidecar's edge: what a request must be before any route sees it, and what an unexpected
failure looks like (ASGI middleware, outermost of the app's own).

A keyless sidecar on loopback (the default) trusts the network it listens on, so it must not be
reachable from a web page the user happens to visit. A browser sends a cross-site request
without asking first (no CORS preflight) only with a "simple" body type (`text/plain`, forms),
and it sends whatever `Host` the page's URL names (a DNS-rebinding page names its own domain,
resolved to 127.0.0.1). So, on every route:

- `Host` must name this server: the address it is bound to, `localhost`, `127.0.0.1`, `::1`, or
  a name of `service.allowed_hosts`; behind a wildcard bind (`0.0.0.0`, `::`), also any IP
  address literal (a rebinding needs a name: an IP literal cannot be re-pointed). The port is
  not compared: the connection already reached this one. Otherwise 421 `bad_host`.
- A request body must be `application/json` or `application/msgpack` (415 `unsupported_media`
  otherwise): a declared `Content-Type` must be one of them (JSON with no `charset`, or
  UTF-8's: it is read as UTF-8 whatever it says), and a request without one may carry
  no body (a bodiless POST, as the admin routes take, needs none). Neither type is "simple",
  so a page cannot send one without a preflight, and no route grants CORS (no
  `Access-Control-Allow-Origin`; a preflight `OPTIONS` is 405).
- A `/v1/` POST carries only the query parameters its route reads (`QUERY`: `/v1/admin/clear`
  its one `tenant`, once; every other POST none), and an admin POST no body (it reads none):
  otherwise 400 `invalid_argument` naming the parameter, before auth. FastAPI passes over an
  unknown parameter and keeps the last of a repeated one, so `/v1/load?start=16` answered the
  KV from token 0, a keyless `/v1/reset?tenant=b` reset tenant `default`, and
  `/v1/admin/clear?tenants=a` (or a body `{"tenant": "a"}`) cleared every tenant. GET routes
  are not held to it (the page's `?part=`, a browser's or a scraper's cache-busting parameters
  change nothing).
- `Host`, `Authorization`, `X-Kvtier-Tenant` and `Content-Type` at most once each: two are
  400 `invalid_argument` naming the header (never its values), before anything else. The
  checks here read the last of a repeated header and the routes the first, so `Host: evil,
  Host: 127.0.0.1` passed the Host check, and two keys acted as the first, whichever a proxy
  or a client library had put there.
- An exception that escapes a route is logged once, with its traceback, and answered
  `500 {"error": "internal", "detail"}` (when no response has begun); the tests forbid it, so
  this is the last line, not a path.

Refusals here happen before the body is read and change nothing.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.service import wire

log = logging.getLogger("kvtier.service")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


class HostCheck:
    """Which `Host` headers name this server (see the module docstring)."""

    def __init__(self, bound: str, allowed: Iterable[str]) -> None:
        self.names = frozenset(name.lower() for name in (bound, *LOOPBACK_NAMES, *allowed))
        self.any_address = bound in WILDCARDS

    def refusal(self, header: str | None) -> str | None:
        """Why `header` does not name this server, or None when it does."""
        if header is None:
            return "no Host header"
        host = _hostname(header.lower())
        if host in self.names or (self.any_address and _is_address(host)):
            return None
        return (
            f"Host {header!r:.100} does not name this server: expected one of "
            f"{sorted(self.names)} (service.allowed_hosts adds names)"
        )


def _hostname(header: str) -> str:
    """The host part of a Host header: `[::1]:8750` -> `::1`, `a.b:80` -> `a.b`."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def body_refusal(content_type: str | None, content_length: str | None, chunked: bool) -> str | None:
    """Why a request's body may not be read, or None when it may."""
    if content_type is not None:
        if wire.media_type(content_type) not in wire.MEDIA_TYPES:
            return f"Content-Type {content_type!r:.100}: expected one of {list(wire.MEDIA_TYPES)}"
        if wire.media_type(content_type) == wire.JSON and charset(content_type) not in UTF8:
            return f"Content-Type {content_type!r:.100}: expected no charset, or utf-8"
        return None
    if chunked or not no_length(content_length):
        return f"a body without a Content-Type: expected one of {list(wire.MEDIA_TYPES)}"
    return None


UTF8 = (None, "utf-8", "utf8", "us-ascii", "ascii")
"""The charsets a JSON body may name: it is read as UTF-8 whatever it says (ASCII is UTF-8)."""


def charset(content_type: str) -> str | None:
    """The `charset` parameter of a `Content-Type`, lowercased, or None."""
    for parameter in content_type.split(";")[1:]:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


def no_length(content_length: str | None) -> bool:
    """Whether a Content-Length says there is no body: absent, or zero however written ("00"
    too, which HTTP allows; the server has refused one that is not digits)."""
    return content_length is None or content_length.strip().lstrip("0") == ""


SINGLE_HEADERS = ("host", "authorization", "x-kvtier-tenant", "content-type")
"""The headers a request may carry at most once: each decides who it is, where or what."""


def repeated_header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a request's headers are ambiguous (one of `SINGLE_HEADERS` twice), or None."""
    seen: set[str] = set()
    for raw, _ in headers:
        name = raw.decode("latin-1").lower()  # (ASGI servers lower-case names already)
        if name in seen and name in SINGLE_HEADERS:
            return f"header {name!r} given more than once: expected it once"
        seen.add(name)
    return None


def fieldless(route: str, handler: Callable[[Any, Any, dict[str, Any]], Any]) -> Any:
    """`handler` for a route whose body names nothing (`/v1/reset`): a field in the body is
    400 `invalid_argument` naming it, before the handler runs, as a query parameter is
    (`query_refusal`): `{"tenant": "b"}` reset the caller's own tenant."""

    def checked(store: Any, tenant: Any, data: dict[str, Any]) -> Any:
        for name in data:
            detail = f"field {name!r:.80}: POST {route} takes none: expected {{}}"
            raise wire.WireError(400, "invalid_argument", detail)
        return handler(store, tenant, data)

    return checked


QUERY = {"/v1/admin/clear": ("tenant",)}
"""The query parameters a `/v1/` POST reads (each at most once); a POST not named reads none."""


def query_refusal(
    method: str, path: str, query: bytes, has_body: bool, posts: frozenset[str]
) -> str | None:
    """Why a `/v1/` POST's query string (or an admin POST's body) may not reach its route, or
    None when it may: a parameter its route does not read (`QUERY`), one given twice, or a body
    sent to an admin route (which reads its arguments from the query alone). A POST to a path
    that takes none (not in `posts`) is left to the app: 405 naming the methods it takes, or
    404 (a 400 "takes none" said the wrong thing of `POST /v1/status?x=1`)."""
    if method != "POST" or path.removesuffix("/") not in posts:
        return None
    admin = path.startswith("/v1/admin/")
    if admin and has_body:
        return f"POST {path:.64} takes no body: expected its arguments in the query string"
    taken = QUERY.get(path.removesuffix("/"), ())  # `/v1/admin/clear/?tenant=`: a redirect
    seen: set[str] = set()
    for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if name not in taken:
            expected = f"only {list(taken)}" if taken else "none"
            expected += "" if taken or admin else " (its arguments in the body)"
            return f"query parameter {name!r:.80}: POST {path:.64} takes {expected}"
        if name in seen:
            return f"query parameter {name!r:.80} given twice: expected it once"
        seen.add(name)
    return None


class Guard:
    """The ASGI middleware: the Host and body checks, then the app, with the last line of
    defence around it."""

    def __init__(self, app: ASGIApp, hosts: HostCheck, posts: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts
        self.posts = posts  # the `/v1/` paths a POST is routed to

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        repeated = repeated_header(scope["headers"])
        if repeated is not None:
            await _answer(send, 400, "invalid_argument", repeated, close=True)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope["headers"]}  # fmt: skip
        bad_host = self.hosts.refusal(headers.get("host"))
        if bad_host is not None:
            await _answer(send, 421, "bad_host", bad_host)
            return
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        bad_body = body_refusal(headers.get("content-type"), headers.get("content-length"), chunked)
        if bad_body is not None:
            await _answer(send, 415, "unsupported_media", bad_body, close=True)
            return
        path, has_body = scope["path"], chunked or not no_length(headers.get("content-length"))
        bad_query = query_refusal(
            scope["method"], path, scope.get("query_string", b""), has_body, self.posts
        )
        if bad_query is not None:  # in the request's format, as the route's own 400s are
            admin = path.startswith("/v1/admin/")  # (an admin route's are JSON: it reads no body)
            packed = wire.is_msgpack(headers.get("content-type")) and not admin
            await _answer(send, 400, "invalid_argument", bad_query, close=True, packed=packed)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.exception("kvtier: unexpected error in %s %s", scope["method"], scope["path"])
            if not started:
                detail = f"an unexpected {type(exc).__name__}; the server's log has the traceback"
                await _answer(send, 500, "internal", detail, close=True)


async def http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's own refusals (404 unknown path, 405 wrong method: a CORS preflight is one)
    as `{error, detail}`, with their headers (a 405's `Allow`, which RFC 9110 requires)."""
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "refused")
    body = json.dumps({"error": kind, "detail": str(exc.detail)}).encode()
    return Response(body, exc.status_code, headers=exc.headers, media_type=wire.JSON)


async def _answer(
    send: Send, status: int, kind: str, detail: str, close: bool = False, packed: bool = False
) -> None:
    """A JSON (`packed`: msgpack) `{error, detail}` response; `close`: the connection ends
    after it, since the request's body may be left unread."""
    error = {"error": kind, "detail": detail}
    body = wire.encode(error, True) if packed else json.dumps(error).encode()
    media = wire.MSGPACK if packed else wire.JSON
    headers = [(b"content-type", media.encode()), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
