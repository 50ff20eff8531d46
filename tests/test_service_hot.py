"""The data plane's POST routes served from the edge (`kvtier/service/hot.py`): which requests
take the short way, that everything else reaches the app as before, and that the edge's checks
still come first on the real app."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from fastapi.testclient import TestClient
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from kvtier.config import KVTierConfig
from kvtier.service.app import create_app
from kvtier.service.guard import Guard
from kvtier.service.hot import HotRoutes
from kvtier.store import KVStore


def _serve(app: Any, scope: dict[str, Any]) -> tuple[int, bytes]:
    """(status, body) of one request to the ASGI `app`."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent[1:])


def _scope(method: str, path: str, kind: str = "http") -> dict[str, Any]:
    return {
        "type": kind,
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
        "scheme": "http",
        "server": ("127.0.0.1", 8750),
    }


def test_only_a_post_to_a_listed_path_takes_the_short_way() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(f"{scope['method']} {scope['path']}")
        await PlainTextResponse("app", 405)(scope, receive, send)

    async def endpoint(request: Request) -> Response:
        body = await request.body()  # the request is whole: its body can be read
        return PlainTextResponse(f"hot {request.url.path} {len(body)}")

    hot = HotRoutes(app, {"/v1/lookup": endpoint})
    assert _serve(hot, _scope("POST", "/v1/lookup")) == (200, b"hot /v1/lookup 0")
    assert seen == []
    for method, path in (("GET", "/v1/lookup"), ("POST", "/v1/lookup/"), ("POST", "/v1/x")):
        assert _serve(hot, _scope(method, path)) == (405, b"app")
    assert seen == ["GET /v1/lookup", "POST /v1/lookup/", "POST /v1/x"]


def test_on_the_real_app_the_edge_checks_come_first_and_every_post_route_is_listed() -> None:
    app = create_app(KVTierConfig(), lambda: KVStore(KVTierConfig()))
    classes: list[object] = [m.cls for m in app.user_middleware]
    assert classes == [Guard, HotRoutes]  # Guard outermost
    listed = set(cast("dict[str, Any]", app.user_middleware[1].kwargs["routes"]))
    data_plane = {
        path
        for route in app.routes
        for path in [getattr(route, "path", "")]
        if "POST" in getattr(route, "methods", ())
        and not path.startswith("/v1/admin/")
        and path not in ("/", "/page.js", "/page.css")  # the page's 405s, with its headers
    }
    assert listed == data_plane and "/v1/commit" in listed
    with TestClient(app, base_url="http://127.0.0.1") as client:
        deadline = time.monotonic() + 30  # the store starts on a thread of its own: a bound
        while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.02)  # (a loaded machine took longer than the first request to start)
        bad_host = client.post("/v1/lookup", json={"tokens": [1]}, headers={"host": "evil.test"})
        assert bad_host.status_code == 421 and bad_host.json()["error"] == "bad_host"
        plain = client.post("/v1/lookup", content=b"{}", headers={"content-type": "text/plain"})
        assert plain.status_code == 415 and plain.json()["error"] == "unsupported_media"
        bad = client.post("/v1/lookup", json={"tokens": [-1]})
        assert bad.status_code == 400 and "tokens" in bad.json()["detail"]
        good = client.post("/v1/lookup", json={"tokens": list(range(64))})
        assert good.status_code == 200 and good.json()["num_tokens"] == 0
        assert client.get("/v1/lookup").status_code == 405  # not a POST: the app's answer
