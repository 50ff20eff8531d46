"""`AsyncClient`: the asyncio twin of `Client` (`blocking.py`), the same methods as coroutines.

It maps the server's pools at its first request rather than at construction (a constructor
cannot await); the shared-memory path and its fallback to the body are `Client`'s (a load's
copy kept only where its lease held the slots through it: `held.py`; a reply of another server
instance maps the new server's pools and lane: `pools.py`; a store whose reservation ended
before its commit sent again in the body), and so are
owed releases (`releases.py`), sent here by a task the event loop starts `RELEASE_AFTER_S`
after a load rather than by a thread. Its failures are `Client`'s too: a connection refused,
reset or timed out is a `TransportError`, not httpx's own exception. A prefetch or reserve
whose reply is lost (a transport failure, the task cancelled) owes a give-back by its request
token, as `Client`'s does (`owing.py`); once the client is closed, within what is left of that
call's `timeout_s`, and at least `owing.GRACE_S`.

An `AsyncClient` belongs to the event loop of its first call (`loops.py`): its connections
are that loop's. A call from another loop (a second `asyncio.run`) is a `ClosedError` that
names the misuse, and sends nothing; `aclose()` works from any loop (from another, it sends
what is owed on connections of its own and drops the first loop's untouched), and again after
one cancelled or failed midway (what that one left owed, sent likewise). Make one
`AsyncClient` per event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import torch

from kvtier.blocks import KVLayout, Tokens, check_device, encode_tokens, token_array
from kvtier.caller_kv import kv_layout
from kvtier.client.arguments import (
    KeyTenant,
    check_flag,
    check_options,
    check_timeout,
    check_tokens,
    ttl_field,
    waited,
)
from kvtier.client.calls import Calls
from kvtier.client.connections import MAX_REPLY_BYTES, check_url
from kvtier.client.held import LeaseFrom, held_until
from kvtier.client.lane import AsyncLaneConnections
from kvtier.client.loops import EventLoopOf
from kvtier.client.mapper import AsyncMapper
from kvtier.client.owing import AsyncOwing
from kvtier.client.pages import LoadPages, StorePieces, prefetch_body
from kvtier.client.pools import NOTHING_RESERVED, MappedView, ReservationFrom
from kvtier.client.releases import may_have_reached, new_token, release_of
from kvtier.client.sending import AsyncSender, lease_state
from kvtier.client.transport import (
    REFUSALS,
    RequestHeaders,
    WaitPacer,
    alone_post,
    direct,
    httpx_headers,
    httpx_send,
    reply_body,
)
from kvtier.errors import CapacityError, LeaseError
from kvtier.results import Lease, LeaseState, LoadResult, LookupResult, Reservation, StoreResult
from kvtier.service import frames, replies, wire


class AsyncClient(AsyncSender, MappedView):
    """The asyncio twin of `Client`: the same methods, as coroutines."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8750",
        *,
        api_key: str | None = None,
        tenant: str | None = None,
        shared_memory: bool = True,
        timeout_s: float = 120.0,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        """As `Client`'s."""
        url = check_url(url)[0].geturl()  # a malformed one: `InvalidArgumentError`, as `Client`'s
        check_options(api_key, tenant, shared_memory, timeout_s, max_reply_bytes)
        self._headers = RequestHeaders(api_key, tenant)
        self._max_reply, self._shared_memory = max_reply_bytes, shared_memory
        self._http = httpx.AsyncClient(base_url=url, timeout=timeout_s, transport=direct())
        self._server = AsyncMapper(self._http, self._headers, (timeout_s, max_reply_bytes))
        self._pools = self._server.pools
        self._calls = Calls()  # what `aclose()` waits for
        self._key = KeyTenant(self._calls, "authorization" in self._headers.common)
        alone = alone_post(url, self._headers, max_reply_bytes)  # a give-back after `aclose()`
        self._owing = AsyncOwing(self._post, alone)  # releases, give-backs owed
        self._owed, self._timeout_s = self._owing.owed, timeout_s
        self._loop = EventLoopOf(self._calls)  # the loop of its first call (`loops.py`)

    @property
    def _lane(self) -> AsyncLaneConnections | None:
        return self._server.lane  # the lane now (`AsyncMapper`)

    @_lane.setter
    def _lane(self, lane: AsyncLaneConnections | None) -> None:
        self._server.lane = lane

    async def _post(
        self, path: str, body: dict[str, Any], tenant: str = "default"
    ) -> dict[str, Any]:
        self._loop.check()  # a fork's, another loop's or a closed client's: nothing sent
        await self._key.admit(tenant, self._get)  # the process, the tenant (`KeyTenant`)
        await self._map()
        content, headers = wire.encode(body, True), self._headers.for_tenant(tenant)
        lane = self._lane  # one for the call: `AsyncMapper.instance` may replace it
        if lane is not None and path in frames.PATHS:
            reply = await lane.request(path, content, headers)
            if reply is not None:  # None: the lane cannot be reached, and nothing was sent
                return reply_body(reply)
        out = httpx_headers(headers)
        request = self._http.build_request("POST", path, content=content, headers=out)
        return reply_body(await httpx_send(self._http, request, self._max_reply))

    async def _get(self, path: str) -> dict[str, Any]:
        self._loop.check()  # a fork's, another loop's: no socket of the maker's touched
        request = self._http.build_request("GET", path, headers=httpx_headers(self._headers.common))
        return reply_body(await httpx_send(self._http, request, self._max_reply))

    async def _post_carrying(self, path: str, body: dict[str, Any], tenant: str) -> dict[str, Any]:
        """`_post`, carrying the releases owed for `tenant` (`releases.py`), after giving back
        what lost replies of that tenant may have been granted."""
        self._loop.check()  # before any debt is taken to be sent
        await self._owing.send_requests(self._owed.take_requests(tenant))
        ids = self._owed.take(tenant)
        try:
            return await self._post(path, {**body, "release": ids} if ids else body, tenant)
        except BaseException:
            if ids:
                self._owing.owe_again(tenant, ids)
            raise

    async def _post_granting(
        self, kind: str, path: str, request: dict[str, Any], tenant: str, deadline: float
    ) -> tuple[str, dict[str, Any]]:
        """`Sender.granting`: the token and the reply."""
        token = new_token()
        try:
            return token, await self._post_carrying(path, {**request, "request": token}, tenant)
        except BaseException as exc:
            if may_have_reached(exc, REFUSALS):
                await self._owing.give_back(kind, token, tenant, deadline)
            raise

    async def _map(self) -> None:
        """Map the server's pools before the first call that may use them; a failed
        `/v1/pools` (a sidecar still starting) is asked again at the next call."""
        if self._shared_memory and not self._server.mapped:
            pools = await self._get("/v1/pools")
            if not self._server.mapped:  # another call of this client may have mapped them
                self._server.take(pools)

    async def lookup(self, tokens: Tokens, *, tenant: str = "default") -> LookupResult:
        packed = encode_tokens(check_tokens(tokens))
        body = await self._post("/v1/lookup", {"tokens": packed}, tenant)
        return self._pools.lookup(body, len(packed) // 4)

    async def prefetch(
        self,
        tokens: Tokens,
        *,
        tenant: str = "default",
        ttl_s: float | None = None,
        wait: bool = True,
    ) -> Lease:
        check_flag("wait", wait)  # as the store checks it
        return (await self._prefetch(check_tokens(tokens), tenant, ttl_s, wait)).lease

    async def _prefetch(
        self, tokens: Tokens, tenant: str, ttl_s: float | None, wait: bool, as_load: bool = False
    ) -> LeaseFrom:
        """`Client._prefetch`: the lease, its server instance and until when it surely holds."""
        with self._calls.call():
            request, asked_at = prefetch_body(tokens, ttl_s, wait, as_load), time.monotonic()
            deadline = asked_at + self._timeout_s  # the call's: a give-back's too (`owing.py`)
            token, body = await self._post_granting(
                "lease", "/v1/prefetch", request, tenant, deadline
            )
            async with self._owing.keeping("lease", token, tenant, deadline):
                instance = await self._server.instance(body, "lease", tenant)
                lease = self._pools.lease(body, None, len(request["tokens"]) // 4)
                held = held_until(asked_at, body)
            if wait and lease.state is LeaseState.PENDING:
                try:
                    lease = await self.wait_for(lease)
                except BaseException:  # cancelled, or the wait failed: the lease is still ours
                    self._owing.owe(lease, tenant)  # released soon, never left to its ttl
                    raise
            if wait:
                lease.wait(0)  # raises LeaseError for an ended lease
            return LeaseFrom(lease, instance, held)

    async def wait_for(self, lease: Lease, timeout_s: float | None = None) -> Lease:
        """As `Client.wait_for` (READY; ended: `LeaseError`, a released or expired lease's
        "unknown, released or expired"; pending past `timeout_s`: returned pending, or without
        it past the client's bound: `WaitTimeoutError`)."""
        lease = waited(lease, timeout_s)  # checked before anything is sent
        pacer = WaitPacer(None if timeout_s is None else time.monotonic() + timeout_s)
        while True:
            asked_at, wait_s = pacer.ask()  # bounded without `timeout_s` too (`WaitPacer`)
            body = await self._lease_state(lease, wait_s)
            await self._server.instance(body, "lease", None)  # another server's: its pools mapped
            fresh = self._pools.waited(body, lease, None)
            if fresh.state is not LeaseState.PENDING:
                fresh.wait(0)  # raises LeaseError for an ended lease
                return fresh
            if pacer.past_deadline(lease.lease_id):  # `WaitTimeoutError` past the client's bound
                return fresh
            await asyncio.sleep(pacer.after(asked_at, wait_s))

    async def _lease_state(self, lease: Lease, wait_s: float) -> dict[str, Any]:
        """`GET /v1/leases/{id}?wait_s=`, as the lease's tenant (`sending.lease_state`)."""
        self._loop.check()  # a fork's, another loop's: no socket of the maker's touched
        headers, limit = self._headers.for_tenant(lease.tenant), self._max_reply
        return await lease_state(self._http, self._lane, headers, (lease, wait_s), limit)

    async def release(self, lease: Lease | int) -> None:
        lease_id, tenant = release_of(lease)  # checked as the store checks it
        await self._post("/v1/release", {"lease_id": lease_id}, self._key.held(tenant))

    async def store(
        self,
        tokens: Tokens,
        kv: torch.Tensor,
        *,
        tenant: str = "default",
        start: int = 0,
        layout: str = "layers",
    ) -> StoreResult:
        with self._calls.call():
            kind = kv_layout(layout)
            tokens = token_array(check_tokens(tokens))  # checked once: check_kv, reserve, body
            await self._map()
            await self.layout()  # `kv` checked against it on every path; the body limit
            kv = self._pools.check_kv(tokens, kv, start, kind)  # a copy of a view of a pool
            if self._pools.buffers:
                try:
                    reservation, instance = await self._reserve(tokens, tenant, None)
                except CapacityError:  # over its quota or the tier: the body path, as `load`
                    reservation, instance = NOTHING_RESERVED
                if (cached := self._pools.all_cached(reservation, tokens)) is not None:
                    return cached  # the server holds it all: nothing to send
                pool = self._pools.writable(reservation, start, instance)
                if pool is not None:
                    try:
                        self._pools.write_blocks(reservation, pool, kv, start, kind)
                    except Exception:
                        await self.abort(reservation)
                        raise
                    try:
                        return await self.commit(reservation)
                    except LeaseError:  # it ended before the commit (its ttl): the body path
                        pass
                elif reservation.num_tokens:
                    await self.abort(reservation)
            pieces = StorePieces(tokens, kv, start, kind, self._pools.served)
            while (body := pieces.next()) is not None:
                pieces.add(await self._post("/v1/store", body, tenant))
            return pieces.result

    async def load(
        self,
        tokens: Tokens,
        *,
        tenant: str = "default",
        start: int = 0,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
        layout: str = "layers",
    ) -> LoadResult:
        with self._calls.call():
            kind, wanted = kv_layout(layout), check_device(device)
            tokens = token_array(check_tokens(tokens))  # checked once: the prefetch reuses it
            pages = LoadPages(encode_tokens(tokens), start)  # the body path's replies
            await self._map()
            dest = None
            if start or out is not None or kind != "layers" or "gpu" in self._pools.buffers:
                await self.layout()  # known before `start` and `out` are checked against it
                dest = self._pools.destination(pages.asked, out, kind, wanted, start)
            if "gpu" in self._pools.buffers:
                assert dest is not None
                try:
                    granted = await self._prefetch(tokens, tenant, None, True, True)
                except (CapacityError, LeaseError):
                    pass  # larger than the gpu tier can lease, or ended unready: the body
                else:
                    lease, first = granted.lease, start // dest.layout.block_tokens
                    try:
                        kv = self._pools.read_blocks(lease, granted.instance, dest, first)
                    except BaseException:
                        await self.release(lease)
                        raise
                    if kv is None:  # not the pools mapped here: the body path
                        self._owing.owe(lease, tenant)  # released on a later request's way
                    elif await self._owing.settle(granted, tenant, kv):  # held through the copy
                        return LoadResult(lease.num_tokens, kv)
                    else:  # it ended first: the copy zeroed, none of it left in `out`
                        dest = self._pools.destination(pages.asked, out, kind, wanted, start)
            while (request := pages.next()) is not None:  # a long prefix: several replies
                body = await self._post("/v1/load", request, tenant)
                if body.get("truncated") is True and pages.block_tokens is None:
                    pages.block_tokens = (await self.layout()).block_tokens  # pages end on them
                pages.add(body)
            return self._pools.loaded(pages, wanted, pages.asked, dest, start)

    async def layout(self) -> KVLayout:
        """`Client.layout`."""
        if self._pools.served is None:
            self._pools.map(await self._get("/v1/pools"), mapping=False)
        assert self._pools.served is not None
        return self._pools.served.layout

    async def reserve(
        self, tokens: Tokens, *, tenant: str = "default", ttl_s: float | None = None
    ) -> Reservation:
        return (await self._reserve(tokens, tenant, ttl_s))[0]

    async def _reserve(self, tokens: Tokens, tenant: str, ttl_s: float | None) -> ReservationFrom:
        """`reserve`, and the server instance of its reply."""
        with self._calls.call():
            request: dict[str, Any] = {"tokens": encode_tokens(check_tokens(tokens))}
            if (ttl := ttl_field(ttl_s)) is not None:  # checked before anything is sent
                request["ttl_s"] = ttl
            deadline = time.monotonic() + self._timeout_s  # the call's (`owing.py`)
            token, body = await self._post_granting(
                "reservation", "/v1/reserve", request, tenant, deadline
            )
            async with self._owing.keeping("reservation", token, tenant, deadline):
                instance = await self._server.instance(body, "reservation", tenant)
                reservation = self._pools.reservation(body, request["tokens"])
            return reservation, instance

    async def commit(self, reservation: Reservation | int) -> StoreResult:
        r = self._key.reserved(reservation)  # a Reservation or its id (`Client.commit`)
        reply = await self._post("/v1/commit", {"reservation_id": r.reservation_id}, r.tenant)
        return self._pools.stored(reply, r.most_tokens)

    async def abort(self, reservation: Reservation | int) -> None:
        r = self._key.reserved(reservation)
        await self._post("/v1/abort", {"reservation_id": r.reservation_id}, r.tenant)

    async def reset(self, tenant: str = "default") -> dict[str, Any]:
        """`POST /v1/reset` (`Client.reset`)."""
        return replies.reset(await self._post("/v1/reset", {}, tenant))

    async def status(self) -> dict[str, Any]:
        return await self._get("/v1/status")

    async def aclose(self, timeout_s: float | None = None) -> None:
        """As `Client.close`: wait for the calls under way that may owe a release (up to
        `timeout_s`, default the client's), release and give back what is owed (until that
        bound again), then close the connections and forget the mapped pools (`Client.close`);
        from any event loop, whatever a part's closing raises (`_close`)."""
        check_timeout(timeout_s)
        await _close(self, self._timeout_s if timeout_s is None else timeout_s)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _close(client: AsyncClient, bound: float) -> None:
    """`AsyncClient.aclose`, its waits bounded by `bound` (s). From another event loop than the
    client's (`loops.py`), or once closed already (a close cancelled or failed midway), the
    calls under way are waited for only while their loop is open, what is owed is sent on
    connections of this loop's own (`AsyncOwing.close_alone`), and the first loop's
    connections are dropped untouched (closed with their loop, or as they are collected).
    Closed whatever a part's closing raises or a cancel: every call after is a `ClosedError`,
    and what was owed stays owed to the next `aclose()` (`AsyncOwing.stop`)."""
    client._calls.check_process()  # a fork's: nothing sent nor closed
    if client._loop.closed or not client._loop.own():
        await client._calls.aclose(0.0 if client._loop.ended() else bound)
        client._loop.close()
        await client._owing.close_alone(time.monotonic() + bound)
        client._pools.clear()
        if (lane := client._lane) is not None:
            lane.drop()
        return
    try:
        await client._calls.aclose(bound)
        await client._owing.close(time.monotonic() + bound)
    finally:
        client._loop.close()
        client._owing.stop()
        client._pools.clear()
        try:
            await client._http.aclose()
        finally:
            if (lane := client._lane) is not None:
                await lane.aclose()
