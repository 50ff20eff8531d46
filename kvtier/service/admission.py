"""The sidecar's state (`Service`: the store once ready, auth, metrics, its instance id) and who a
request acts as.

    service.ready_store()              the store, or `WireError` 503 not_ready (with the reason)
    admit(request, service)            the store and the tenant of the caller's key (or the
                                       tenant it names, without auth: 403 `unknown_tenant`
                                       for one the config does not list, before its body);
                                       401/403 otherwise
    tenant_of_key(service, key, named, route)  the same from the values alone (the local lane's)
    admit_viewer(request, service)     for figures: None (global) for the admin key or without
                                       auth, else the key's tenant
    viewer_refusal(request, service)   for global-only routes (/v1/config, /metrics): None for
                                       the admin key or without auth, else the 401/403 to answer

A refusal never echoes the key it refused (`unauthorized`).

`service.instance` is random (16 hex digits, `secrets`), drawn once when the app is made: no two
server processes share one, so a client that mapped the pools of one tells a reply of another
(a sidecar restarted at the same URL, with new pools) by it. `/v1/pools` and every reply that
names slots carry it (`bodies.py`, `plane.py`; the client's side: `client/pools.py`).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterable

from fastapi import Request

from kvtier.config import KVTierConfig
from kvtier.service import wire
from kvtier.service.auth import Auth, bearer
from kvtier.service.budget import Budget
from kvtier.service.grants import Grants
from kvtier.service.history import History
from kvtier.service.metrics import Metrics
from kvtier.store import KVStore

StoreFactory = Callable[[], KVStore]
Admit = Callable[[Request, "Service"], tuple[KVStore, str | None]]
"""Who a request acts as: the store and a tenant (None: global figures, for the admin)."""


class Service:
    """The app's state: the store once ready, auth, metrics, the status page's history."""

    def __init__(self, config: KVTierConfig, factory: StoreFactory) -> None:
        self.config = config
        self.auth = Auth(config)
        self.metrics = Metrics(self)
        self.history = History()
        self.factory = factory
        self.store: KVStore | None = None
        self.failure = ""
        self.ready = threading.Event()
        self.lane: str | None = None  # the local lane's name while it listens (`lane.py`)
        self.instance = secrets.token_hex(8)  # this server's id in its replies (module doc)
        self.grants = Grants()  # request token -> lease / reservation id (`grants.py`)
        limits = config.service
        fair = limits.inflight_bytes // max(1, len(config.tenants))
        share = max(fair, limits.max_body_bytes)  # the largest call fits an idle budget
        self.budget = Budget(limits.inflight_bytes, share, fair)  # bodies, replies (`budget.py`)

    def start(self) -> None:
        """Build the store (recovery included) on this thread; `ready` when it is done."""
        try:
            self.store = self.factory()
            self.history.start(self.store)
        except Exception as exc:  # reported by /readyz; the process keeps answering /healthz
            self.failure = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.ready.set()

    def stop(self) -> None:
        self.history.stop()
        store, self.store = self.store, None
        if store is not None:
            store.close()  # drains the mover, leaves the disk tier consistent

    def ready_store(self) -> KVStore:
        """The store, or `WireError` 503 saying why there is none (recovering, or the start's
        failure)."""
        if self.store is None:
            raise wire.WireError(503, "not_ready", self.failure or "recovering")
        return self.store


def admit(request: Request, service: Service) -> tuple[KVStore, str]:
    """The store and the tenant of the caller's key (or the named tenant, without auth)."""
    store = service.ready_store()
    headers = request.headers
    return store, tenant_of_key(
        service, headers.get("authorization"), headers.get("x-kvtier-tenant"), request.url.path
    )


def tenant_of_key(
    service: Service, authorization: str | None, named: str | None, route: str
) -> str:
    """The tenant an `Authorization` value admits (or `named`, the `x-kvtier-tenant` value,
    without auth, which the calls that act as a tenant check against the config);
    401/403 otherwise (the admin key, which acts as no tenant, told so for `route`). HTTP's
    headers or the local lane's fields (`lane.py`)."""
    tenant = service.auth.tenant(authorization, named)
    if tenant is None:
        if service.auth.is_admin(authorization):
            detail = f"the admin key acts as no tenant: use a tenant's key for {route[:64]}"
            raise unauthorized(authorization, detail)
        raise unauthorized(authorization, "unknown API key")
    if tenant not in service.config.tenants and not route.startswith(NAMES_NO_TENANT):
        raise unknown_tenant(tenant, service.config.tenants)
    return tenant


NAMES_NO_TENANT = ("/v1/pools", "/v1/leases/")
"""The routes a keyless caller may name any tenant on: the pools are the same for every tenant,
and a lease is found only by its own tenant (an unknown one's is 404, as any other's)."""


def unknown_tenant(tenant: str, tenants: Iterable[str]) -> wire.WireError:
    """403 `unknown_tenant` for a keyless call naming a tenant the config does not list (the
    store's own refusal of it, worded as the store words it), given at admission: before, the
    call's body was read first, and held its bytes in `service.max_inflight_bytes` (up to
    `max_body_bytes` each, for `body_timeout_s`), so that calls naming no tenant of the config
    could keep the configured tenants' calls waiting, or refused 503 `busy`."""
    more = f" (of {len(tenant)} characters)" if len(tenant) > 64 else ""
    detail = f"tenant {tenant[:64]!r}{more}: unknown, expected one of {sorted(tenants)}"
    return wire.WireError(403, "unknown_tenant", detail)


def admit_viewer(request: Request, service: Service) -> tuple[KVStore, str | None]:
    """For figures: global (None) for the admin key or without auth, else the key's tenant."""
    if viewer_refusal(request, service) is None:
        return service.ready_store(), None
    return admit(request, service)


def viewer_refusal(request: Request, service: Service) -> wire.WireError | None:
    """Global-only routes (/v1/config, /metrics): None for the admin key (or without auth),
    else the refusal to answer."""
    authorization = request.headers.get("authorization")
    if not service.auth.enabled or service.auth.is_admin(authorization):
        return None
    return unauthorized(authorization, "this route needs the admin key")


def unauthorized(authorization: str | None, forbidden: str) -> wire.WireError:
    """401 without a well-formed key, else 403 `forbidden`; the key itself is never echoed."""
    if bearer(authorization) is None:
        return wire.WireError(401, "unauthorized", "missing 'Authorization: Bearer <key>'")
    return wire.WireError(403, "forbidden", forbidden)
