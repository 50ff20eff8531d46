"""The sidecar's HTTP API: a FastAPI app over one `KVStore` (DESIGN "Engine contract").

    create_app(config, factory, host=None) -> FastAPI; the store is built on a thread at
    start-up, so that /healthz answers during recovery and /readyz turns 200 when it is done

Routes (bodies: `wire.py`; auth: `auth.py`; metrics: `metrics.py`; the edge: `guard.py`, `hot.py`):

    GET  /healthz /readyz                     alive (503: the start failed) / recovered and serving
    GET  /                                    the status page (`page.py`), for a browser
    GET  /v1/status                           live figures: a tenant key sees its tenant's
    GET  /v1/config /metrics /openapi.json    config as given, keys redacted; Prometheus; schema
    GET  /v1/pools                            what a same-host client maps: /dev/shm, the lane;
                                              the server's instance id, which every reply
                                              naming slots repeats (`admission.Service`)
    GET  /v1/blocks                           every block held, as KV events (a router's resync,
                                              `snapshots.py`)
    POST /v1/lookup /v1/prefetch /v1/release /v1/store /v1/load /v1/reserve /v1/commit
         /v1/abort /v1/reset                  the data plane, as the tenant of the caller's key
                                              (reset: its cached KV forgotten, weights changed)
    GET  /v1/leases/{id}?wait_s=              a lease's state, waiting up to wait_s for it
    POST /v1/admin/clear /v1/admin/check /v1/admin/persist    admin key only

Who sees what, with auth on (any tenant has a key): data-plane routes and /v1/pools act as the
key's tenant; /v1/status and /v1/blocks with a tenant key report that tenant's only, with the admin
key the global ones; /v1/config and /metrics (global by nature) need the admin key. 401 without
a key, 403 with a key that does not qualify; a rejected key is never echoed. Without auth
(keyless, loopback only) every route answers as before: global status, open config and metrics.

No logic lives here beyond translation: every figure comes from the store, every decision is
the store's. Store calls run on worker threads (the store's lock may be held for a while by a
big store or the mover), never on the event loop; waiting for a lease awaits it without a
thread. Bodies are read by `body.py` (bounded in size and time). Every answer that is not a 200
is `{error, detail}` with a status its route documents (`schemas.py`): the routes' own, the
edge's (400, 415, 421), and FastAPI's 404/405 for unknown paths and methods. The lifespan also runs
the local lane (`lane.py`), the data plane's small calls past HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from kvtier.config import KVTierConfig
from kvtier.config.service import ServiceConfig
from kvtier.errors import KVTierError
from kvtier.results import LeaseState
from kvtier.service import bodies, budget, flat, schemas, wire
from kvtier.service.admission import (
    Admit,
    Service,
    StoreFactory,
    admit_viewer,
    viewer_refusal,
)
from kvtier.service.admission import admit as _admit
from kvtier.service.body import Disconnected, read_body
from kvtier.service.budget import Hold
from kvtier.service.guard import Guard, HostCheck, fieldless, http_error
from kvtier.service.hot import Endpoint, HotRoutes
from kvtier.service.lane import Lane
from kvtier.service.page import add_page
from kvtier.service.peer import same_user
from kvtier.service.plane import Plane, await_lease
from kvtier.service.snapshots import Snapshots
from kvtier.store import KVStore

log = logging.getLogger("kvtier.service")


def create_app(config: KVTierConfig, factory: StoreFactory, host: str | None = None) -> FastAPI:
    """The app over the store `factory` builds; `host`: the address it is served on (default
    `service.host`), which a request's `Host` must name (`guard.py`)."""
    service = Service(config, factory)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starter = threading.Thread(target=_start_quietly, args=(service,), name="kvtier-start")
        starter.start()
        plane = Plane(config.service, service.instance, service.grants)
        lane = Lane(service, plane.sync_handlers())  # the small calls (`lane.py`)
        service.lane = lane.start() if config.service.shared_memory else None
        yield
        service.lane = None
        await run_in_threadpool(lane.stop)
        await run_in_threadpool(starter.join)
        await run_in_threadpool(service.stop)

    app = FastAPI(
        title="kvtier",
        version="0.1.0",
        summary="Tiered KV-cache store for LLM inference: the sidecar API",
        lifespan=lifespan,
        docs_url=None,  # no Swagger UI, no ReDoc: they would run a CDN's scripts in this
        redoc_url=None,  # origin, which the page's credentials open (the schema: /openapi.json)
    )
    app.state.service = service
    bound = config.service.host if host is None else host
    app.add_exception_handler(HTTPException, http_error)
    app.add_middleware(HotRoutes, routes=_add_routes(app, service))  # inside Guard (`hot.py`)
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    posts = frozenset(r.path for r in routes if "POST" in (r.methods or ()))
    app.add_middleware(Guard, hosts=HostCheck(bound, config.service.allowed_hosts), posts=posts)
    add_page(app, service)
    return app


def _start_quietly(service: Service) -> None:
    """Start the store; a failure is logged and reported by /readyz and /healthz (503: a
    liveness probe restarts it). A refusal of ours (`KVTierError`: a config field, a damaged
    disk, a held lock) is logged as one line (it says what to do); anything else traced."""
    try:
        service.start()
    except KVTierError as exc:
        log.error("kvtier: the store failed to start (/readyz says so too): %s", exc)
    except Exception:
        log.exception("kvtier: the store failed to start; /readyz reports why")


def _error(status: int, kind: str, detail: str, msgpack_body: bool = False) -> Response:
    """`{error, detail}`; a 408, 413 or 503 busy may leave the body unread, so it closes the
    connection."""
    body = wire.encode({"error": kind, "detail": detail}, msgpack_body)
    headers = {"connection": "close"} if status in (408, 413) or kind == "busy" else None
    return Response(
        body, status, headers=headers, media_type=wire.MSGPACK if msgpack_body else wire.JSON
    )


async def _read_request(request: Request, config: ServiceConfig, hold: Hold) -> dict[str, Any]:
    """A request's body, held in the budget before it is read (its length, or the limit while
    it is sent in chunks), read within its bounds and decoded as a flat map (`flat.py`); a JSON
    body, which carries no KV, at most as long as a request needs."""
    kind = request.headers.get("content-type")
    limit, name = config.max_body_bytes, "service.max_body_bytes"
    if not wire.is_msgpack(kind):
        limit = min(limit, flat.json_limit(max(config.max_tokens, wire.MAX_LIST)))
        name = "JSON's limit: 16 bytes a token of service.max_tokens and 64 KiB; send msgpack"
    length = request.headers.get("content-length", "")
    expected = int(length) if length.isdigit() else limit  # (over the limit: 413, unread)
    if expected <= limit:
        await hold.take(expected, time.monotonic() + config.body_timeout_s)
    body = await read_body(request, limit, config.body_timeout_s, name)
    hold.shrink(len(body))
    return wire.decode_request(body, kind, config.max_tokens) if body else {}


def _add_routes(app: FastAPI, service: Service) -> dict[str, Endpoint]:
    """Add the routes; return the data plane's POST endpoints, by path (`hot.py`)."""
    config = service.config.service

    async def call(
        request: Request,
        handler: Callable[[KVStore, Any, dict[str, Any]], Any],
        admit: Admit = _admit,
        reads_body: bool = True,
        bytes_reply: bool = False,
    ) -> Response:
        """Admit (auth first, before the body), refuse JSON to a route whose reply is bytes
        (`bytes_reply`: before it runs, so the refusal changes nothing), read and decode the
        body (`reads_body`), run `handler(store, tenant, body)` (sync, on a worker thread,
        unless it is a coroutine function), encode; every refusal as `{error, detail}`."""
        msgpack_body = wire.is_msgpack(request.headers.get("content-type"))
        started = time.perf_counter()
        hold: budget.Hold | None = None  # the call's bytes in flight (`budget.py`)
        try:
            store, tenant = admit(request, service)
            if bytes_reply and not msgpack_body:
                raise wire.no_bytes_in_json()
            own = service.auth.enabled and tenant is not None  # a tenant key: its own figures
            hold = service.budget.hold(tenant or "", own)
            budget.HOLD.set(hold)  # in this task's own context
            data = await _read_request(request, config, hold) if reads_body else {}
            if asyncio.iscoroutinefunction(handler):
                result = await handler(store, tenant, data)
            else:
                result = await run_in_threadpool(handler, store, tenant, data)
            del data  # the body (a store's KV is read from it in place)
            parts = wire.encode_parts(result, msgpack_body)  # a load's KV as it was gathered
            hold.shrink(sum(len(part) for part in parts))
            kind = wire.MSGPACK if msgpack_body else wire.JSON
            reply = budget.HeldResponse(hold, parts, kind, config.body_timeout_s)
            response, hold = reply, None
            return response  # which gives the hold back as it is sent
        except wire.WireError as exc:
            return _error(exc.status, exc.kind, exc.detail, msgpack_body)
        except KVTierError as exc:
            return _error(*wire.classify(exc), str(exc), msgpack_body)
        except Disconnected:
            service.metrics.disconnected()
            return _error(400, "disconnected", "the client hung up mid-body")  # reaches no one
        finally:
            service.metrics.observe(request.url.path, time.perf_counter() - started)
            if hold is not None:
                hold.release()

    # ---- liveness, readiness, status ------------------------------------------------------

    @app.get("/healthz", responses=schemas.responses(schemas.OK, 503, *schemas.EDGE))
    async def healthz() -> Response:
        """Alive (also while it recovers); 503 once the store failed to start: a restart."""
        if service.failure:
            detail = f"the store failed to start: {service.failure}"
            return JSONResponse({"error": "start_failed", "detail": detail}, 503)
        return JSONResponse({"ok": True})

    @app.get("/readyz", responses=schemas.responses(schemas.READY, 503, *schemas.EDGE))
    async def readyz() -> Response:
        """200 once the store is built and its disk tier recovered; 503 before (or if it
        failed to start). With a remote tier, `remote` says whether it is connected; ready
        either way (without it the store serves its local tiers). The probe needs no key: the
        cluster's error, which names its nodes, is the admin's status's (`remote.last_error`)."""
        store = service.store
        if store is None:
            detail = service.failure or "recovering"
            return JSONResponse({"error": "not_ready", "detail": detail}, 503)
        remote = store.parts.remote
        if remote is None:
            return JSONResponse({"ok": True})
        connected = remote.tier.cluster.stats()["connected"]
        return JSONResponse({"ok": True, "remote": "connected" if connected else "not connected"})

    @app.get("/v1/status", responses=schemas.responses(schemas.ANY_OBJECT, *schemas.GET_STATUSES))
    async def status(request: Request) -> Response:
        """Tiers, paths, index, mover, leases, ops and hit rate, read from the live store, and
        the requests' bytes in flight: with a tenant key, that tenant's figures; with the admin
        key (or without auth), global."""

        async def handler(store: KVStore, tenant: str | None, data: Any) -> dict[str, Any]:
            figures = await run_in_threadpool(functools.partial(store.status, tenant=tenant))
            return {**figures, "inflight": service.budget.figures(tenant)}  # (`budget.py`)

        return await call(request, handler, admit=admit_viewer, reads_body=False)

    snapshots = Snapshots(service.budget, config.body_timeout_s)  # (`snapshots.py`)

    @app.get(
        "/v1/blocks", responses=schemas.responses(schemas.ANY_OBJECT, 400, *schemas.GET_STATUSES)
    )
    async def blocks(request: Request) -> Response:
        """Every block held, per event topic, as one KV-event batch and the topic's sequence
        number then (a router's resync; msgpack only: the batch is bytes): with a tenant key,
        that tenant's blocks (403 where tenants share a topic: `snapshots.py`); with the admin
        key (or without auth), all."""

        async def handler(store: KVStore, tenant: str | None, data: Any) -> dict[str, Any]:
            return await snapshots.take(store, tenant)  # built, then held in the budget

        return await call(request, handler, admit_viewer, reads_body=False, bytes_reply=True)

    @app.get("/v1/config", responses=schemas.responses(schemas.ANY_OBJECT, *schemas.ADMIN_GET))
    async def effective_config(request: Request) -> Response:
        """The config as given (values computed at start are in /v1/status), every API key
        redacted (admin key, with auth)."""
        refusal = viewer_refusal(request, service)
        if refusal is not None:
            return _error(refusal.status, refusal.kind, refusal.detail)
        return JSONResponse(bodies.redacted(service.config))

    @app.get("/metrics", responses=schemas.metrics_responses())
    async def metrics(request: Request) -> Response:
        """Prometheus text format (`kvtier_*`, `tier` and `path` labels); admin key, with
        auth: the figures are global."""
        refusal = viewer_refusal(request, service)
        if refusal is not None:
            return _error(refusal.status, refusal.kind, refusal.detail)
        body, content_type = await run_in_threadpool(service.metrics.render)  # store.status()
        return Response(body, media_type=content_type)

    @app.get("/v1/pools", responses=schemas.responses(schemas.POOLS, *schemas.GET_STATUSES))
    async def pools(request: Request) -> Response:
        """The memory pools a client on this host can map: shared-memory name, slots, layout;
        a CUDA pool's IPC handle only to a peer of the server's own Unix user (`peer.py`).
        The peer's user is looked up once the caller is admitted: the lookup reads the
        kernel's TCP tables (33-83 ms with 900-2,500 sockets), which a caller without a key
        made the server do before its 401, against 1-1.4 ms for any other refusal."""
        client, server = request.client, request.scope.get("server")
        peer = (client.host, client.port) if client is not None else None
        local = tuple(server) if server else None

        def handler(store: KVStore, tenant: str | None, data: Any) -> dict[str, Any]:
            ours = same_user(peer, local)  # on a worker thread, after admission
            return bodies.pools(store, config.shared_memory, service.lane, ours, service.instance)

        return await call(request, handler, reads_body=False)

    # ---- data plane (`plane.py`) ---------------------------------------------------------

    p = Plane(config, service.instance, service.grants)
    reset = fieldless("/v1/reset", p.reset)  # a field in its body: 400 (`guard.py`)
    routes: list[tuple[str, Callable[..., Any], dict[str, Any], dict[str, Any], str]] = [
        ("/v1/lookup", p.lookup, schemas.TOKENS, schemas.LOOKUP, "Cached prefix, by tier"),
        ("/v1/prefetch", p.prefetch, schemas.PREFETCH, schemas.LEASE, "Lease the prefix on gpu"),
        ("/v1/release", p.release, schemas.RELEASE, schemas.EMPTY, "Release a lease"),
        ("/v1/store", p.store_kv, schemas.STORE, schemas.STORED, "Store KV (payload in body)"),
        ("/v1/load", p.load, schemas.LOAD, schemas.LOADED, "Load KV (payload in body)"),
        ("/v1/reserve", p.reserve, schemas.RESERVE, schemas.RESERVATION, "Reserve slots"),
        ("/v1/commit", p.commit, schemas.RESERVATION_ID, schemas.STORED, "Commit a reservation"),
        ("/v1/abort", p.abort, schemas.ABORT, schemas.EMPTY, "Abort a reservation"),
        ("/v1/reset", reset, schemas.NO_FIELDS, schemas.RESET, "Forget the tenant's cached KV"),
    ]
    bytes_call = functools.partial(call, bytes_reply=True)  # a load's reply is its KV
    hot = {path: _post(app, path, handler, bytes_call if path == "/v1/load" else call,
                       request_schema, response_schema, summary)
           for path, handler, request_schema, response_schema, summary in routes}  # fmt: skip

    @app.get(
        "/v1/leases/{lease_id}",
        responses=schemas.responses(schemas.LEASE, *schemas.LEASE_STATUSES),
        openapi_extra=schemas.LEASE_PARAMETERS,
    )
    async def get_lease(request: Request) -> Response:
        """A lease's state; with `wait_s`, wait up to that long (bounded by
        service.prefetch_wait_s) for it to become ready. The id and `wait_s` are parsed here,
        after auth: a bad one is 400, an unknown (or another tenant's) lease 404."""

        async def handler(store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
            lease_id = wire.lease_id_text(request.path_params["lease_id"])
            wait = {"wait_s": wire.query_number(request.query_params.get("wait_s", "0"))}
            wait_s = wire.wait_field(wait, config.prefetch_wait_s)
            lease = await run_in_threadpool(store.lease, lease_id, tenant=tenant)
            if wait_s > 0 and lease.state is LeaseState.PENDING:
                await await_lease(lease, wait_s)
            return bodies.lease(lease, service.instance)

        return await call(request, handler, reads_body=False)

    # ---- admin ----------------------------------------------------------------------------

    @app.post("/v1/admin/clear", responses=schemas.responses(schemas.CLEARED, 404, *schemas.ADMIN))
    async def admin_clear(request: Request, tenant: str | None = None) -> Response:
        """Drop every unleased block (of `tenant`, when given: 404 for an unknown one)."""
        return await _admin(request, service, lambda store: bodies.cleared(store, tenant))

    @app.post("/v1/admin/check", responses=schemas.responses(schemas.CHECKED, *schemas.ADMIN))
    async def admin_check(request: Request) -> Response:
        """Run every invariant check of the store now."""
        return await _admin(request, service, lambda store: bodies.checked(store, service.grants))

    @app.post("/v1/admin/persist", responses=schemas.responses(schemas.PERSISTED, *schemas.ADMIN))
    async def admin_persist(request: Request) -> Response:
        """Give every cached block a durable disk copy now, as the disk holds them (400 without
        one): `left_blocks` have none. Stopping the server does not persist the memory tiers."""
        return await _admin(request, service, bodies.persisted)

    return hot


async def _admin(
    request: Request, service: Service, run: Callable[[KVStore], dict[str, Any]]
) -> Response:
    """`run(store)` for the admin key (403 for any other caller), its result as JSON."""
    if not service.auth.is_admin(request.headers.get("authorization")):
        return _error(403, "forbidden", "admin endpoints need the admin key")
    try:
        result = await run_in_threadpool(run, service.ready_store())
    except wire.WireError as exc:
        return _error(exc.status, exc.kind, exc.detail)
    except KVTierError as exc:
        return _error(*wire.classify(exc), str(exc))
    return JSONResponse(result)


def _post(
    app: FastAPI,
    path: str,
    handler: Callable[..., Any],
    call: Callable[..., Any],
    request_schema: dict[str, Any],
    response_schema: dict[str, Any],
    summary: str,
) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        return await call(request, handler)  # type: ignore[no-any-return]

    endpoint.__name__ = path.strip("/").replace("/", "_")
    app.post(
        path,
        summary=summary,
        responses=schemas.responses(
            response_schema, *schemas.POST_STATUSES, formats=schemas.EITHER
        ),
        openapi_extra=schemas.request_body(request_schema),
    )(endpoint)
    return endpoint
