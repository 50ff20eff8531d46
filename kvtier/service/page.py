"""The status page at `/`: what an operator opens in a browser (issue 18).

    GET /                 the page (HTML): tiers, hit rate and copies over the last minutes,
                          leases and mover, faults, recovery, requests in flight, config and
                          build: every figure of `/v1/status` (`render.py`)
    GET /?part=main       its live part alone, which the page's script fetches every 2 s
    GET /page.css /page.js   the page's style and script (static, no build step)

Auth is `/v1/status`'s: without auth every viewer sees the global figures; with auth the admin
key sees them, a tenant's key that tenant's own figures (no charts, no config: those are
global), and anything else is refused. A browser cannot send a Bearer header by itself, so the
page (and only the page: it changes nothing, so a browser sending the key unasked to a
cross-site request is harmless) also takes the key as HTTP Basic credentials, the key as the
password (or as the user name, with an empty password: `curl -u KEY:`), and answers a missing or
unknown key with 401 and `WWW-Authenticate: Basic`, so that the browser asks for it.

While the store recovers the page still answers, saying so, with the build figures.

The page carries no inline script or style. Its headers (`HEADERS`), on every answer of its
paths, refusals (400, 401, 403, 405) included: the Content-Security-Policy `default-src 'none';
script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; frame-ancestors 'none';
base-uri 'none'; form-action 'none'` (scripts, styles, images and fetches from this origin only,
nothing inline, no frames, no forms), nosniff, no referrer, no store. The Host check's 421 and
the 404 of an unknown path are the app's (`guard.py`, `app.py`).
"""

from __future__ import annotations

import base64
import binascii
import os
import platform
import time
from importlib import metadata
from importlib.resources import files
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from kvtier.service import bodies, render, schemas
from kvtier.service.admission import Service
from kvtier.service.auth import bearer

HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
OTHER_METHODS = ["HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
"""The methods the page's paths refuse (405), with its headers: it answers GET only."""
_STATIC = {"/page.css": "text/css", "/page.js": "text/javascript"}
_MAX_CREDENTIALS = 4096


def add_page(app: FastAPI, service: Service) -> None:
    """Add the page's routes to `app` (module doc)."""
    started = (time.time(), time.monotonic())  # the date shown; the uptime's clock
    statics = {
        path: (files("kvtier.service") / "static" / path[1:]).read_bytes() for path in _STATIC
    }

    @app.get(
        "/",
        response_class=HTMLResponse,
        responses=PAGE_RESPONSES,
        openapi_extra=PAGE_PARAMETERS,
        summary="The status page (HTML)",
    )
    async def page(request: Request) -> Response:
        part = request.query_params.get("part")
        if part not in (None, "main"):
            return _refusal(400, "bad_argument", f"part: got {part[:64]!r}, expected 'main'")
        viewer = _viewer(service, request.headers.get("authorization"))
        if isinstance(viewer, Response):
            return viewer
        draw = render.live if part == "main" else render.document  # 3-18 ms: off the loop
        inflight = service.budget.figures(viewer)  # read on the loop, which changes it
        html = await run_in_threadpool(lambda: draw(_view(service, viewer, started, inflight)))
        return HTMLResponse(html, headers=HEADERS)

    for path, media in _STATIC.items():
        app.get(path, include_in_schema=False)(_static(statics[path], media))
    for path in ("/", *_STATIC):  # FastAPI's own 405 would carry no `HEADERS`
        app.api_route(path, methods=OTHER_METHODS, include_in_schema=False)(_not_allowed)


async def _not_allowed(request: Request) -> Response:
    refusal = _refusal(405, "method_not_allowed", f"{request.method[:16]}: expected GET")
    refusal.headers["allow"] = "GET"
    return refusal


def _static(body: bytes, media: str) -> Any:
    async def static() -> Response:
        return Response(body, media_type=media, headers=HEADERS)

    return static


PAGE_PARAMETERS: dict[str, Any] = {
    "parameters": [{"name": "part", "in": "query", "required": False, "schema": {"enum": ["main"]}}]
}
_ERROR = {"application/json": {"schema": schemas.ERROR}}
PAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "OK", "content": {"text/html": {"schema": {"type": "string"}}}},
    400: {"description": "a `part` other than main", "content": _ERROR},
    401: {"description": "no key, or one the server does not know", "content": _ERROR},
    403: {"description": "a Bearer key the server does not know", "content": _ERROR},
    415: {"description": "a body that is neither JSON nor msgpack", "content": _ERROR},
    421: {"description": "a Host header that does not name this server", "content": _ERROR},
}


def _refusal(status: int, kind: str, detail: str, ask: bool = False) -> Response:
    """The page's error reply: JSON, with the page's `HEADERS` (its body may repeat what the
    request said: never sniffed, framed, or kept)."""
    headers = dict(HEADERS)
    if ask:
        headers["www-authenticate"] = 'Basic realm="kvtier", charset="UTF-8"'
    return JSONResponse({"error": kind, "detail": detail}, status, headers=headers)


def _viewer(service: Service, authorization: str | None) -> str | Response | None:
    """None for the global figures, a tenant's name for its own, or the refusal to answer."""
    auth = service.auth
    if not auth.enabled:
        return None
    header = _as_bearer(authorization)
    if auth.is_admin(header):
        return None
    tenant = auth.tenant(header, None)
    if tenant is not None:
        return tenant
    if header is None:
        return _refusal(401, "unauthorized", "a key: Bearer, or Basic with the key", ask=True)
    if bearer(authorization) is not None:
        return _refusal(403, "forbidden", "unknown API key")
    return _refusal(401, "unauthorized", "unknown API key", ask=True)  # Basic: ask again


def _as_bearer(authorization: str | None) -> str | None:
    """`Bearer <key>` as given, or made of Basic credentials (the password, else the user);
    None for anything else (malformed credentials are no credentials)."""
    if authorization is None or len(authorization) > _MAX_CREDENTIALS:
        return None
    if bearer(authorization) is not None:
        return authorization
    if authorization[:6].lower() != "basic ":  # (schemes in any case, as `auth.bearer`)
        return None
    try:
        decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, _, password = decoded.partition(":")
    key = password or user
    return f"Bearer {key}" if key else None


def _view(
    service: Service, tenant: str | None, started: tuple[float, float], inflight: dict[str, int]
) -> render.View:
    """One snapshot for the page: what `/v1/status` answers `tenant` (global: None), the
    store's status with the requests' bytes in flight (`inflight`, `budget.figures`)."""
    store = service.store
    status = None if store is None else {**store.status(tenant=tenant), "inflight": inflight}
    if status is not None:
        readiness = "ready"
    else:
        readiness = f"not ready: {service.failure}" if service.failure else "recovering"
    overall = tenant is None
    return render.View(
        status=status,
        readiness=readiness,
        tenant=tenant,
        rates=service.history.rates() if overall else None,
        config=bodies.redacted(service.config) if overall else None,
        build=_build(started),
        as_of=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
    )


def _build(started: tuple[float, float]) -> dict[str, str]:
    """The build and the process: `started` is (wall, monotonic) seconds at start; the uptime
    is on the monotonic clock, which no wall-clock jump moves."""
    try:
        version = metadata.version("kvtier")
    except metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    uptime = time.monotonic() - started[1]
    return {
        "kvtier": version,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pid": str(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started[0])),
        "up": f"{uptime / 3600:.1f} h" if uptime >= 3600 else f"{uptime:.0f} s",
    }
