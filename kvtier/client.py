"""Clients of the sidecar (`kvtier serve`): `Client` (threads) and `AsyncClient` (asyncio).

Same method names, arguments and result types as the embedded `KVStore`, so an engine moves
between embedded and sidecar by configuration alone:

    with Client("http://127.0.0.1:8750", api_key=...) as kv:     # or KVStore(config)
        hit = kv.lookup(tokens)
        lease = kv.prefetch(tokens)            # READY when it returns (waited on the server)
        kv.release(lease)
        kv.store(tokens, kv_tensor)
        out = kv.load(tokens).kv

On the same host (`shared_memory=True`, the default) the client maps the server's memory
pools from /dev/shm: `store` reserves slots, writes the blocks straight into the mapped pool
and commits; `load` leases the prefix, copies the pages out of the mapped gpu pool and releases
it. No KV byte crosses the socket. Where the pools cannot be mapped (another host, a CUDA pool)
or a call cannot go that way (new blocks below a disk-only prefix, a prefix larger than the gpu
tier), the KV travels in the body instead. A CUDA gpu pool is opened through its CUDA IPC
description (`service/cuda_ipc.py`). `pool_buffer(tier)` is the mapped buffer, for an engine
that reads leased pages itself.

The client trusts nothing its server says (`service/replies.py`): every reply is checked before
it is used, and a malformed one is a `ReplyError` naming the field: a `/v1/pools` reply whose
layout, slot counts, shared-memory names or CUDA IPC descriptions are not what a kvtier server
sends fails `Client(url)` itself, and a lease or reservation whose slots fall outside the pools
is refused before anything is read or written. A well-formed pool that is not there to map
(another host, another user) or whose segment is not exactly the file its server made (a
symlink, another owner or mode, another size: `tiers/shm.py`) stays unmapped, and its KV travels
in the body.

Errors come back as the same `kvtier.errors` types the store raises (their message is the
server's), plus `ServiceError` for what has no store equivalent (auth, limits, not ready).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import torch

from kvtier.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidKVError,
    InvalidTokensError,
    KVTierError,
    LeaseError,
    NotWrittenError,
    QuotaError,
    ReplyError,
    StorageError,
    UnknownTenantError,
)
from kvtier.kvdata import check_kv, from_blocks, to_blocks
from kvtier.results import Lease, LeaseState, LoadResult, LookupResult, Reservation, StoreResult
from kvtier.service import replies, wire
from kvtier.service.cuda_ipc import import_pool
from kvtier.tiers.shm import map_shared
from kvtier.tokens import Tokens

_RAISES: dict[str, type[KVTierError]] = {
    "invalid_tokens": InvalidTokensError,
    "invalid_argument": InvalidArgumentError,
    "invalid_kv": InvalidKVError,
    "unknown_lease": LeaseError,
    "unknown_tenant": UnknownTenantError,
    "capacity": CapacityError,
    "quota": QuotaError,
    "not_written": NotWrittenError,
    "storage": StorageError,
}
"""Error kinds raised as the store's own error types; any other kind (and any kind refused by
the service itself: 401, 403, 413) is a `ServiceError`, "closed" and "not_ready" (503) too."""


class ServiceError(KVTierError):
    """A refusal of the service itself: `status` (401, 403, 413, 503, ...) and `kind`."""

    def __init__(self, status: int, kind: str, detail: str) -> None:
        super().__init__(f"{status} {kind}: {detail}")
        self.status, self.kind, self.detail = status, kind, detail


def _reply(response: httpx.Response) -> dict[str, Any]:
    """The body of a successful response; the error it reports raised (`_RAISES`), or
    `ReplyError` if it is no map."""
    if response.status_code >= 400:
        try:
            body = wire.decode(response.content, response.headers.get("content-type"))
            kind, detail = str(body.get("error"))[:64], str(body.get("detail"))[:2000]
        except wire.WireError:
            kind, detail = "http", response.text[:200]
        cls = _RAISES.get(kind)
        if cls is not None and response.status_code not in (401, 403, 413):
            raise cls(detail)
        raise ServiceError(response.status_code, kind, detail)
    try:
        return wire.decode(response.content, response.headers.get("content-type"))
    except wire.WireError as exc:
        raise ReplyError(f"{response.request.url.path}: {exc.detail}") from None


class _Calls:
    """Request bodies and result parsing, shared by both clients (transport aside)."""

    def __init__(self, api_key: str | None, tenant: str | None) -> None:
        key = api_key if api_key is not None else os.environ.get("KVTIER_API_KEY")
        self.headers = {"content-type": wire.MSGPACK, "accept": wire.MSGPACK}
        if key:
            self.headers["authorization"] = f"Bearer {key}"
        if tenant:
            self.headers["x-kvtier-tenant"] = tenant
        self.pools: dict[str, torch.Tensor] = {}
        self.served: replies.Pools | None = None

    def headers_for(self, tenant: str) -> dict[str, str]:
        if tenant == "default" or "authorization" in self.headers:
            return self.headers
        return {**self.headers, "x-kvtier-tenant": tenant}

    def map_pools(self, body: dict[str, Any]) -> None:
        """Map every pool the server offers, once its whole reply is checked (`ReplyError`,
        nothing mapped); a pool that is not here to map stays unmapped."""
        served = replies.pools(body)
        dtype = served.layout.dtype
        for pool in served.pools:
            shape = served.layout.pool_shape(pool.num_slots)
            ipc = pool.cuda_ipc
            try:
                if pool.shared_memory is not None:
                    self.pools[pool.tier] = map_shared(pool.shared_memory, dtype, shape)
                elif ipc is not None and ipc.device < torch.cuda.device_count():
                    self.pools[pool.tier] = import_pool(ipc)
            except (OSError, RuntimeError):
                continue  # another host, user or GPU, or not its server's file: the body path
        self.served = served

    def lease(self, body: dict[str, Any], canceller: Callable[[Lease], None] | None) -> Lease:
        return replies.lease(body, self.served, canceller)

    def reservation(self, body: dict[str, Any], tokens: bytes) -> Reservation:
        return replies.reservation(body, self.served, len(tokens) // 4)

    def loaded(self, body: dict[str, Any], device: torch.device | str | None) -> LoadResult:
        num_tokens, kv = replies.loaded(body, None if self.served is None else self.served.layout)
        return LoadResult(num_tokens, kv.to(device or "cpu"))

    def check_kv(self, tokens: Tokens, kv: torch.Tensor) -> None:
        """`InvalidKVError` for a KV that the server would refuse: the shared-memory path
        writes it into the pool before the server sees it, so it is checked here."""
        assert self.served is not None, "pools are mapped with their layout"
        check_kv(self.served.layout, kv, len(wire.pack_tokens(tokens)) // 4)

    def write_blocks(self, reservation: Reservation, kv: torch.Tensor) -> None:
        """Write the reserved blocks of `kv` (checked by `check_kv`) into their mapped slots."""
        assert self.served is not None, "pools are mapped with their layout"
        start, end = reservation.cached_tokens, reservation.cached_tokens + reservation.num_tokens
        pool = self.pools[reservation.tier]
        blocks = to_blocks(kv[:, :, start:end], self.served.layout.block_tokens)
        pool[list(reservation.slots)] = blocks.to(pool.device)
        if pool.is_cuda:  # complete before the commit lets the server read the slots
            torch.cuda.synchronize(pool.device)

    def read_blocks(self, lease: Lease) -> torch.Tensor:
        return from_blocks(self.pools["gpu"][list(lease.block_table)].cpu())  # indexing copies


class Client:
    """A blocking client (one keep-alive connection pool, safe to share between threads)."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8750",
        *,
        api_key: str | None = None,
        tenant: str | None = None,
        shared_memory: bool = True,
        timeout_s: float = 120.0,
    ) -> None:
        """`api_key` (default `$KVTIER_API_KEY`) selects the tenant when the server has auth;
        without auth `tenant` (or each call's `tenant=`) does. `shared_memory`: map the
        server's pools when they are on this host."""
        self._calls = _Calls(api_key, tenant)
        self._http = httpx.Client(base_url=url, timeout=timeout_s)
        if shared_memory:
            self._calls.map_pools(self._get("/v1/pools"))

    # ---- transport ---------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], tenant: str = "default") -> dict[str, Any]:
        response = self._http.post(
            path, content=wire.encode(body, True), headers=self._calls.headers_for(tenant)
        )
        return _reply(response)

    def _get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self._http.get(path, params=params, headers=self._calls.headers)
        return _reply(response)

    # ---- the engine contract ------------------------------------------------------------

    def lookup(self, tokens: Tokens, *, tenant: str = "default") -> LookupResult:
        body = self._post("/v1/lookup", {"tokens": wire.pack_tokens(tokens)}, tenant)
        return replies.lookup(body)

    def prefetch(
        self,
        tokens: Tokens,
        *,
        tenant: str = "default",
        ttl_s: float | None = None,
        wait: bool = True,
    ) -> Lease:
        """Lease the cached prefix on the server's gpu tier. With `wait`, return it READY
        (waiting on the server, which bounds each wait); else as it is (`wait_for`)."""
        request: dict[str, Any] = {"tokens": wire.pack_tokens(tokens), "wait_s": 0.0}
        if ttl_s is not None:
            request["ttl_s"] = ttl_s
        if wait:
            del request["wait_s"]
        lease = self._calls.lease(self._post("/v1/prefetch", request, tenant), self.release)
        return self.wait_for(lease) if wait and not lease.ready() else lease

    def wait_for(self, lease: Lease, timeout_s: float | None = None) -> Lease:
        """Wait for a pending lease on the server; the lease as it is then (READY, or ended:
        `LeaseError` names the state; still pending after `timeout_s`: returned pending)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
            body = self._get(f"/v1/leases/{lease.lease_id}", {"wait_s": wait_s})
            fresh = self._calls.lease(body, self.release)
            if fresh.state is not LeaseState.PENDING:
                fresh.wait(0)  # raises LeaseError for an ended lease
                return fresh
            if deadline is not None and time.monotonic() >= deadline:
                return fresh

    def release(self, lease: Lease | int) -> None:
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        tenant = lease.tenant if isinstance(lease, Lease) else "default"
        self._post("/v1/release", {"lease_id": lease_id}, tenant)

    def store(self, tokens: Tokens, kv: torch.Tensor, *, tenant: str = "default") -> StoreResult:
        if self._calls.pools:
            self._calls.check_kv(tokens, kv)
            reservation = self.reserve(tokens, tenant=tenant)
            if reservation.num_tokens and reservation.tier in self._calls.pools:
                try:
                    self._calls.write_blocks(reservation, kv)
                except Exception:
                    self.abort(reservation)
                    raise
                return self.commit(reservation)
            if reservation.num_tokens:
                self.abort(reservation)
        body = {"tokens": wire.pack_tokens(tokens), **wire.kv_to_wire(kv)}
        return replies.stored(self._post("/v1/store", body, tenant))

    def load(
        self, tokens: Tokens, *, tenant: str = "default", device: torch.device | str | None = None
    ) -> LoadResult:
        if "gpu" in self._calls.pools:
            try:
                lease = self.prefetch(tokens, tenant=tenant)
            except CapacityError:
                pass  # larger than the gpu tier can lease: through the body
            else:
                try:
                    kv = self._calls.read_blocks(lease)
                finally:
                    self.release(lease)
                return LoadResult(lease.num_tokens, kv.to(device or "cpu"))
        body = self._post("/v1/load", {"tokens": wire.pack_tokens(tokens)}, tenant)
        return self._calls.loaded(body, device)

    def reserve(
        self, tokens: Tokens, *, tenant: str = "default", ttl_s: float | None = None
    ) -> Reservation:
        request: dict[str, Any] = {"tokens": wire.pack_tokens(tokens)}
        if ttl_s is not None:
            request["ttl_s"] = ttl_s
        body = self._post("/v1/reserve", request, tenant)
        return self._calls.reservation(body, request["tokens"])

    def commit(self, reservation: Reservation) -> StoreResult:
        body = {"reservation_id": reservation.reservation_id}
        return replies.stored(self._post("/v1/commit", body, reservation.tenant))

    def abort(self, reservation: Reservation) -> None:
        self._post("/v1/abort", {"reservation_id": reservation.reservation_id}, reservation.tenant)

    def status(self) -> dict[str, Any]:
        return self._get("/v1/status")

    def pool_buffer(self, tier: str) -> torch.Tensor | None:
        """The server's pool of `tier` mapped here (`[slots, *block_shape]`), or None."""
        return self._calls.pools.get(tier)

    def close(self) -> None:
        self._http.close()
        self._calls.pools.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of `Client`: the same methods, as coroutines."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8750",
        *,
        api_key: str | None = None,
        tenant: str | None = None,
        shared_memory: bool = True,
        timeout_s: float = 120.0,
    ) -> None:
        self._calls = _Calls(api_key, tenant)
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout_s)
        self._shared_memory = shared_memory
        self._mapped = False

    async def _post(
        self, path: str, body: dict[str, Any], tenant: str = "default"
    ) -> dict[str, Any]:
        await self._map()
        response = await self._http.post(
            path, content=wire.encode(body, True), headers=self._calls.headers_for(tenant)
        )
        return _reply(response)

    async def _get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self._http.get(path, params=params, headers=self._calls.headers)
        return _reply(response)

    async def _map(self) -> None:
        if self._shared_memory and not self._mapped:
            self._mapped = True
            self._calls.map_pools(await self._get("/v1/pools"))

    async def lookup(self, tokens: Tokens, *, tenant: str = "default") -> LookupResult:
        body = await self._post("/v1/lookup", {"tokens": wire.pack_tokens(tokens)}, tenant)
        return replies.lookup(body)

    async def prefetch(
        self,
        tokens: Tokens,
        *,
        tenant: str = "default",
        ttl_s: float | None = None,
        wait: bool = True,
    ) -> Lease:
        request: dict[str, Any] = {"tokens": wire.pack_tokens(tokens)}
        if ttl_s is not None:
            request["ttl_s"] = ttl_s
        if not wait:
            request["wait_s"] = 0.0
        lease = self._calls.lease(await self._post("/v1/prefetch", request, tenant), None)
        while wait and lease.state is LeaseState.PENDING:
            body = await self._get(f"/v1/leases/{lease.lease_id}", {"wait_s": 30})
            lease = self._calls.lease(body, None)
        if wait:
            lease.wait(0)  # raises LeaseError for an ended lease
        return lease

    async def release(self, lease: Lease | int) -> None:
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        tenant = lease.tenant if isinstance(lease, Lease) else "default"
        await self._post("/v1/release", {"lease_id": lease_id}, tenant)

    async def store(
        self, tokens: Tokens, kv: torch.Tensor, *, tenant: str = "default"
    ) -> StoreResult:
        await self._map()
        if self._calls.pools:
            self._calls.check_kv(tokens, kv)
            reservation = await self.reserve(tokens, tenant=tenant)
            if reservation.num_tokens and reservation.tier in self._calls.pools:
                try:
                    self._calls.write_blocks(reservation, kv)
                except Exception:
                    await self.abort(reservation)
                    raise
                return await self.commit(reservation)
            if reservation.num_tokens:
                await self.abort(reservation)
        body = {"tokens": wire.pack_tokens(tokens), **wire.kv_to_wire(kv)}
        return replies.stored(await self._post("/v1/store", body, tenant))

    async def load(
        self, tokens: Tokens, *, tenant: str = "default", device: torch.device | str | None = None
    ) -> LoadResult:
        await self._map()
        if "gpu" in self._calls.pools:
            try:
                lease = await self.prefetch(tokens, tenant=tenant)
            except CapacityError:
                pass
            else:
                try:
                    kv = self._calls.read_blocks(lease)
                finally:
                    await self.release(lease)
                return LoadResult(lease.num_tokens, kv.to(device or "cpu"))
        body = await self._post("/v1/load", {"tokens": wire.pack_tokens(tokens)}, tenant)
        return self._calls.loaded(body, device)

    async def reserve(
        self, tokens: Tokens, *, tenant: str = "default", ttl_s: float | None = None
    ) -> Reservation:
        request: dict[str, Any] = {"tokens": wire.pack_tokens(tokens)}
        if ttl_s is not None:
            request["ttl_s"] = ttl_s
        body = await self._post("/v1/reserve", request, tenant)
        return self._calls.reservation(body, request["tokens"])

    async def commit(self, reservation: Reservation) -> StoreResult:
        body = {"reservation_id": reservation.reservation_id}
        return replies.stored(await self._post("/v1/commit", body, reservation.tenant))

    async def abort(self, reservation: Reservation) -> None:
        body = {"reservation_id": reservation.reservation_id}
        await self._post("/v1/abort", body, reservation.tenant)

    async def status(self) -> dict[str, Any]:
        return await self._get("/v1/status")

    async def aclose(self) -> None:
        await self._http.aclose()
        self._calls.pools.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
