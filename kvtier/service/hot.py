"""`HotRoutes`: the data plane's POST routes served from the edge, past FastAPI's routing.

An engine calls the sidecar on every request (lookup, prefetch, reserve, commit, release): a
call's latency is added to its time to first token. Through the whole FastAPI stack a call
spent about three times as long in the framework (routing, dependency solving, exception
middleware, the async exit stack) as in its handler (py-spy on a server committing 16 MiB
prompts; `benchmarks/bench_datapath.py`). This ASGI middleware sits just inside `Guard` and
sends a POST whose path is one of `routes` straight to that route's endpoint.

Contract:
- The endpoint is the function the FastAPI route itself calls (`app._post`): the same
  admission (auth before the body), the same bounded body read, decoding, typed errors and
  metrics; it gets a Starlette `Request` of the same scope and its `Response` is sent as is.
- `Guard` runs first, as for every route: the Host and media-type checks, and the last line
  around an unexpected exception (500 `{error, detail}`, logged).
- Anything else (another method or path, a trailing slash, a lifespan or websocket scope)
  goes to the app unchanged, which answers as before (405, 404, redirects).
- The FastAPI routes stay registered: they are the API's documentation (OpenAPI, which
  schemathesis tests), and they answer wherever this middleware is not installed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


class HotRoutes:
    def __init__(self, app: ASGIApp, routes: Mapping[str, Endpoint]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.routes.get(scope["path"])
            if endpoint is not None:
                response = await endpoint(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
