"""The data plane's handlers, one per POST route: `handler(store, tenant, body) -> reply body`,
shared by the HTTP routes (`app.py`) and the local lane (`lane.py`).

Each reads its fields from the decoded body (`wire.py`: a bad one is a `WireError`), calls the
store as the tenant its caller was admitted as, and returns the reply's body; a store error
propagates for the caller to classify. They run on a worker thread (HTTP) or on the lane
connection's thread, never on the event loop; the one exception is HTTP's `prefetch`, a
coroutine that awaits its lease without holding a thread (`sync_handlers` gives the lane a
blocking twin), and HTTP's `load`, which holds its reply's bytes in the budget first (the lane
carries no load).

A give-back by `request` token (`release`, `abort`) of a tenant the config does not list is
refused as a lookup of it is (`UnknownTenantError`: 403 `unknown_tenant`) before anything is
remembered for the name: the grants table holds the configured tenants only (`grants.py`).

Every reply that names slots (a lease: prefetch, `/v1/leases`; a reservation) carries the
server's `instance` (`admission.Service`), so a client never reads or writes the pools it mapped
from another server process for them (`client/pools.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from kvtier.blocks import check_start
from kvtier.config.service import ServiceConfig
from kvtier.errors import LeaseError
from kvtier.results import Lease, LeaseState
from kvtier.service import bodies, budget, wire
from kvtier.service.grants import Grants
from kvtier.store import PREFETCH_ATTEMPTS, KVStore

Handler = Callable[[KVStore, str, dict[str, Any]], Any]


class Plane:
    def __init__(self, config: ServiceConfig, instance: str, grants: Grants) -> None:
        self.config = config
        self.instance = instance  # the server's, in every reply that names slots
        self.grants = grants  # request token -> lease or reservation id, per tenant

    def lookup(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        tokens = wire.tokens_field(data, self.config.max_tokens)
        return store.lookup(tokens, tenant=tenant)._asdict()

    async def prefetch(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        """As `store.prefetch(wait=True)` does, within `wait_s`: a lease that FAILED (a corrupt
        disk copy, dropped by the failure) is tried again, up to PREFETCH_ATTEMPTS times, so
        that the intact leading part comes back leased. The leases in `release` are released
        by the first attempt, once every field is known good (the store's `release`)."""
        tokens, ttl, deadline, done, token, as_load = self._prefetch_fields(data)
        for _ in range(PREFETCH_ATTEMPTS):
            lease = await run_in_threadpool(
                functools.partial(store.prefetch, as_load=as_load),
                tokens, tenant=tenant, ttl_s=ttl, wait=False, release=done,
            )  # fmt: skip
            if not self._grant(store, tenant, token, lease):  # a lock and a dict: no thread hop
                await run_in_threadpool(self._withdrawn, store, token, lease)
            done = []
            left = deadline - time.monotonic()
            if left > 0:
                await await_lease(lease, left)
            if lease.state is not LeaseState.FAILED or time.monotonic() >= deadline:
                break
        return bodies.lease(lease, self.instance, _granted_ttl(store, ttl))

    def prefetch_blocking(
        self, store: KVStore, tenant: str, data: dict[str, Any]
    ) -> dict[str, Any]:
        """`prefetch`, waiting for the lease on the calling thread (the lane's)."""
        tokens, ttl, deadline, done, token, as_load = self._prefetch_fields(data)
        for _ in range(PREFETCH_ATTEMPTS):
            lease = store.prefetch(
                tokens, tenant=tenant, ttl_s=ttl, wait=False, release=done, as_load=as_load
            )
            if not self._grant(store, tenant, token, lease):
                self._withdrawn(store, token, lease)
            done = []
            left = deadline - time.monotonic()
            if left > 0:
                with contextlib.suppress(LeaseError):
                    lease.wait(left)
            if lease.state is not LeaseState.FAILED or time.monotonic() >= deadline:
                break
        return bodies.lease(lease, self.instance, _granted_ttl(store, ttl))

    def lease_blocking(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        """`GET /v1/leases/{id}?wait_s=` for the lane (`frames.PATHS`): the lease's state,
        waiting on the calling thread up to `wait_s` (0 if absent, as over HTTP; bounded by
        `prefetch_wait_s`) while it is PENDING; an unknown (or another tenant's) lease is a
        `LeaseError` (404)."""
        lease_id = wire.int_field(data, "lease_id")
        wait_s = wire.wait_field({"wait_s": data.get("wait_s", 0)}, self.config.prefetch_wait_s)
        lease = store.lease(lease_id, tenant=tenant)
        if wait_s > 0 and lease.state is LeaseState.PENDING:
            with contextlib.suppress(LeaseError):  # an ended lease: its state tells
                lease.wait(wait_s)
        return bodies.lease(lease, self.instance)

    def _prefetch_fields(
        self, data: dict[str, Any]
    ) -> tuple[Any, float | None, float, list[int], str | None, bool]:
        """A prefetch's fields, every one checked before any work: tokens, ttl, deadline, the
        leases to release, the request token, `as_load` (a client's shared-memory load)."""
        tokens = wire.tokens_field(data, self.config.max_tokens)
        ttl = wire.number_field(data, "ttl_s", None)
        deadline = time.monotonic() + wire.wait_field(data, self.config.prefetch_wait_s)
        token, as_load = wire.request_field(data), wire.bool_field(data, "as_load")
        return tokens, ttl, deadline, wire.release_field(data), token, as_load

    def _grant(self, store: KVStore, tenant: str, token: str | None, lease: Lease) -> bool:
        """Remember `lease` under `token`; False: the token was withdrawn first."""
        seeds = store.namespaces.seeds
        return token is None or self.grants.grant("lease", tenant, token, lease.lease_id, seeds)

    @staticmethod
    def _withdrawn(store: KVStore, token: str | None, lease: Lease) -> None:
        """End `lease`, whose token was given back before it was granted (module doc)."""
        with contextlib.suppress(LeaseError):
            store.release(lease)
        raise LeaseError(f"request {token}: given back before its lease was granted")

    def release(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        token = _by_token(data, "lease_id")
        if token is None:
            lease = store.lease(wire.int_field(data, "lease_id"), tenant=tenant)
            store.release(lease)
            return {}
        lease_id = self.grants.withdraw("lease", tenant, token, store.namespaces.seeds)
        if lease_id is not None:
            with contextlib.suppress(LeaseError):  # ended already: nothing left to give back
                store.release(store.lease(lease_id, tenant=tenant))
        return {}

    def store_kv(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        tokens = wire.tokens_field(data, self.config.max_tokens)
        start = wire.int_field(data, "start") if "start" in data else 0
        return store.store(tokens, wire.kv_from_wire(data), tenant=tenant, start=start)._asdict()

    async def load(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        """The KV of the cached prefix from `start`, at most `max_body_bytes` of it (whole
        blocks; `truncated` when the prefix may go on past them: ask again from `num_tokens`).
        The reply's KV (sent from where it is gathered: `wire.encode_parts`) is held in the
        call's budget (`budget.py`) for as many tokens as were asked before a byte of it is
        gathered, and is no more than the call may hold beside its body (`Hold.room`: where a
        tenant's share is `max_body_bytes`, a reply of it never fit, 503 `busy` after a wait)."""
        tokens = wire.tokens_field(data, self.config.max_tokens)
        start = wire.int_field(data, "start") if "start" in data else 0
        layout = store.layout
        check_start(start, len(tokens), layout.block_tokens)
        limit = min(self.config.max_body_bytes, (1 << 32) - 1)  # msgpack's longest bin
        hold = budget.HOLD.get()
        if hold is not None:  # beside its body: what one call may hold (`Hold.room`), and
            limit = min(limit, hold.room())  # of it what is free now, a block at least
            limit = min(limit, max(layout.block_bytes, hold.free_now()))
        most = limit // layout.block_bytes * layout.block_tokens
        if not most and start < len(tokens):
            # no reply holds a block (the config lets `max_body_bytes` be less than one): before,
            # `tokens[:start]` was loaded, a 400 naming no fault (`start` 0) or a reply
            # `truncated` at its own start, which a client takes for a broken server
            raise wire.WireError(
                413,
                "body_too_large",
                f"a block of {layout.block_bytes} bytes, more than a reply carries ({limit}: "
                f"service.max_body_bytes, at most 2**32-1, and what the call may hold beside its "
                f"body: service.max_inflight_bytes and the tenants' shares), and a load's reply "
                f"is whole blocks",
            )
        end = min(len(tokens), start + most)
        if hold is not None:
            charge = (end - start) // layout.block_tokens * layout.block_bytes
            await hold.take(charge, time.monotonic() + self.config.body_timeout_s)
        result = await run_in_threadpool(
            functools.partial(store.load, tokens[:end], tenant=tenant, start=start, device="cpu")
        )
        reply = {"num_tokens": result.num_tokens, **wire.kv_to_wire(result.kv)}
        if end < len(tokens) and result.num_tokens == end:
            reply["truncated"] = True
        return reply

    def reserve(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        tokens = wire.tokens_field(data, self.config.max_tokens)
        ttl = wire.number_field(data, "ttl_s", None)
        done = wire.release_field(data)
        token = wire.request_field(data)
        reservation = store.reserve(tokens, tenant=tenant, ttl_s=ttl, release=done)
        rid = reservation.reservation_id
        seeds = store.namespaces.seeds
        if token is not None and not self.grants.grant("reservation", tenant, token, rid, seeds):
            with contextlib.suppress(LeaseError):
                store.abort(rid)
            raise LeaseError(f"request {token}: given back before its reservation was granted")
        slots = list(reservation.slots)
        return {**reservation._asdict(), "slots": slots, "instance": self.instance}

    def commit(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        rid = wire.int_field(data, "reservation_id")
        store.reservation(rid, tenant=tenant)
        return store.commit(rid)._asdict()

    def reset(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        """The caller's tenant's cached KV forgotten (`KVStore.reset`)."""
        return store.reset(tenant)

    def abort(self, store: KVStore, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
        token = _by_token(data, "reservation_id")
        if token is None:
            rid = wire.int_field(data, "reservation_id")
            if rid:  # (0: a reserve that reserved nothing, `KVStore.abort`)
                store.reservation(rid, tenant=tenant)
                store.abort(rid)
            return {}
        granted = self.grants.withdraw("reservation", tenant, token, store.namespaces.seeds)
        if granted is not None:
            with contextlib.suppress(LeaseError):  # committed or ended already
                store.reservation(granted, tenant=tenant)
                store.abort(granted)
        return {}

    def sync_handlers(self) -> dict[str, Handler]:
        """The handlers of the calls the lane carries (`frames.PATHS`), all blocking."""
        return {
            "/v1/lookup": self.lookup,
            "/v1/prefetch": self.prefetch_blocking,
            "/v1/release": self.release,
            "/v1/reserve": self.reserve,
            "/v1/commit": self.commit,
            "/v1/abort": self.abort,
            "/v1/leases": self.lease_blocking,
        }


def _by_token(data: dict[str, Any], id_field: str) -> str | None:
    """The `request` token of a release or abort (None: by `id_field`); `WireError` 400 for a
    malformed token, or for both an id and a token."""
    token = wire.request_field(data)
    if token is not None and id_field in data:
        raise wire.WireError(
            400,
            "invalid_argument",
            f"request: got both {id_field} and request, expected one of them",
        )
    return token


async def await_lease(lease: Lease, wait_s: float) -> None:
    """Wait up to `wait_s` for `lease` to leave PENDING, without a thread; a timeout or a
    failure is the caller's to read from the lease's state."""
    with contextlib.suppress(asyncio.TimeoutError, LeaseError):
        await asyncio.wait_for(lease.wait_async(), wait_s)


def _granted_ttl(store: KVStore, ttl: float | None) -> float:
    """The ttl a prefetch's lease was granted for: the one asked (checked by the store), or
    `policy.lease_ttl_s`."""
    return store.config.policy.lease_ttl_s if ttl is None else float(ttl)
