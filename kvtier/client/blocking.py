"""`Client`: the store's methods over HTTP from threads (see the package doc for the contract).

Each method is one request, or on the shared-memory path (`pools.py`) a few: `store` is
reserve + write into the mapped pool + commit (abort if the write fails), `load` is lease (a
prefetch marked `as_load`, which the server counts as a load) + copy out of the mapped gpu
pool, its release owed (`releases.py`: carried by the next prefetch or reserve, else sent by
the flusher thread within `RELEASE_AFTER_S`, or at `close()`) once the lease surely held its
slots through the copy; where that is not sure by time, released at once, and a lease that
ended first throws the copy away (`held.py`). Where a call cannot go that way (or its lease
ended before the copy did, or before it was ready; or a store's reservation ended before its
commit, e.g. a write that outlasted its ttl, `policy.lease_ttl_s` by default), its KV travels
in the body: the call stores or loads what it would have on the mapped path.

Each prefetch and reserve carries a fresh `request` token; one whose reply is lost (a
`TransportError`, an interrupt) owes a give-back by that token, sent before the next prefetch or
reserve of its tenant, by the flusher, or at `close()`; one whose reply comes after `close()`
gives it back itself, on a connection of its own, and raises `ClosedError` (`releases.py`).

A lease or reservation reply of another server instance than the pools mapped here (the
sidecar restarted at the same URL: `pools.py`) makes the client forget its mappings and ask
`/v1/pools` again, once per instance; the new pools and lane are taken from then on, and that
call's KV goes through them if they are the reply's instance, else through the body.

Every argument is checked before a request is sent, as `KVStore` checks it (`arguments.py`):
a `store`'s `kv` against the served layout and the tokens from `start` on, on the body path
as on the mapped one. The requests themselves are `Sender`'s (`sending.py`): each checks
first that this is the process that made the client (a fork's call is a `ClosedError`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvtier.blocks import KVLayout, Tokens, check_device, encode_tokens, token_array
from kvtier.caller_kv import kv_layout
from kvtier.client.arguments import (
    check_flag,
    check_options,
    check_timeout,
    check_tokens,
    lease_of,
    ttl_field,
    waited,
)
from kvtier.client.calls import Calls
from kvtier.client.connections import MAX_REPLY_BYTES, Connections
from kvtier.client.held import LeaseFrom, held_until
from kvtier.client.lane import LaneConnections
from kvtier.client.mapper import Mapper
from kvtier.client.owing import Alone
from kvtier.client.pages import LoadPages, StorePieces, prefetch_body
from kvtier.client.pools import NOTHING_RESERVED, MappedView, ReservationFrom
from kvtier.client.releases import release_of
from kvtier.client.sending import Sender
from kvtier.client.transport import RequestHeaders, WaitPacer, reply_body
from kvtier.errors import CapacityError, LeaseError
from kvtier.results import Lease, LeaseState, LoadResult, LookupResult, Reservation, StoreResult
from kvtier.service import replies, wire


def _alone(url: str, headers: RequestHeaders) -> Alone:
    """A POST over HTTP on a connection of its own, within its `timeout_s` (a give-back after
    `close()`, in what is left of its call's, at least `owing.GRACE_S`)."""

    def post(path: str, body: dict[str, Any], tenant: str, timeout_s: float) -> dict[str, Any]:
        alone = Connections(url, timeout_s, MAX_REPLY_BYTES)
        try:
            encoded = wire.encode(body, True)
            return reply_body(alone.request("POST", path, encoded, headers.for_tenant(tenant)))
        finally:
            alone.close()

    return post


class Client(MappedView):
    """A blocking client (keep-alive connections, `connections.py`; safe to share by threads)."""

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
        """`api_key` (default `$KVTIER_API_KEY`) selects the tenant when the server has auth;
        without auth `tenant` (or each call's `tenant=`) does. `shared_memory`: map the
        server's pools when they are on this host. A reply longer than `max_reply_bytes` is a
        `ReplyError`, read no further (a load sent in the body is the longest a server sends).
        Each argument is checked here (`InvalidArgumentError` naming it: `arguments.py`), and
        the pools mapped (a `/v1/pools` that fails raises here, its connection closed). The
        client is this process's: used in another (a fork), every call is a `ClosedError`."""
        check_options(api_key, tenant, shared_memory, timeout_s, max_reply_bytes)
        self._headers = RequestHeaders(api_key, tenant)
        self._http = Connections(url, timeout_s, max_reply_bytes)
        self._server = Mapper(self._http, self._headers, (timeout_s, max_reply_bytes))
        self._pools = self._server.pools
        self._calls, self._timeout_s = Calls(), timeout_s  # what `close()` waits for
        alone = _alone(url, self._headers)
        self._send = Sender(self._http, self._headers, self._server, self._calls, alone)
        self._post, self._get = self._send.post, self._send.get  # each checked (`sending.py`)
        self._owing = self._send.owing  # releases, give-backs owed
        self._owed, self._key = self._owing.owed, self._send.key
        if shared_memory:
            try:
                self._server.map()
            except BaseException:  # no client to close: its connection is closed here
                self._http.close()
                raise

    @property
    def _lane(self) -> LaneConnections | None:
        return self._server.lane  # the lane now (`Mapper`)

    @_lane.setter
    def _lane(self, lane: LaneConnections | None) -> None:
        self._server.lane = lane

    # ---- the engine contract ------------------------------------------------------------

    def lookup(self, tokens: Tokens, *, tenant: str = "default") -> LookupResult:
        packed = encode_tokens(check_tokens(tokens))
        body = self._post("/v1/lookup", {"tokens": packed}, tenant)
        return self._pools.lookup(body, len(packed) // 4)

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
        check_flag("wait", wait)  # as the store checks it
        return self._prefetch(tokens, tenant, ttl_s, wait).lease

    def _prefetch(
        self, tokens: Tokens, tenant: str, ttl_s: float | None, wait: bool, as_load: bool = False
    ) -> LeaseFrom:
        """`prefetch`, the server instance of the reply that granted the lease, and until when
        it surely holds its slots (`held.py`; `as_load`: a load's, counted as one:
        `pages.prefetch_body`)."""
        with self._calls.call():
            tokens = check_tokens(tokens)
            request, asked_at = prefetch_body(tokens, ttl_s, wait, as_load), time.monotonic()
            deadline = asked_at + self._timeout_s  # the call's: a give-back's too (`owing.py`)
            token, body = self._send.granting("lease", "/v1/prefetch", request, tenant, deadline)
            with self._owing.keeping("lease", token, tenant, deadline):
                instance = self._server.instance(body, "lease", tenant)
                lease = self._pools.lease(body, self.release, len(request["tokens"]) // 4)
                held = held_until(asked_at, body)
            if not wait or lease.ready():
                return LeaseFrom(lease, instance, held)
            try:
                return LeaseFrom(self.wait_for(lease), instance, held)
            except BaseException:  # interrupted, or the wait failed: the lease is still ours
                self._owing.owe(lease, tenant)  # released soon, never left to its ttl
                raise

    def wait_for(self, lease: Lease, timeout_s: float | None = None) -> Lease:
        """Wait for a pending lease on the server; the lease as it is then (READY; ended:
        `LeaseError`, naming the state the server reports, or for a lease it no longer holds,
        released or reaped past its ttl, "unknown, released or expired": the server keeps no
        ids of ended leases, so it never says "expired" alone; still pending after
        `timeout_s`: returned pending).
        Without `timeout_s`, `WaitTimeoutError` past `WaitPacer.MOST_WAIT_S` (`transport.py`).
        `timeout_s` bounds the wait asked of the server; each ask is a request of the client's
        own `timeout_s`, so a server slow to answer holds the call until it does or that ends
        the ask (`TransportError`)."""
        lease = waited(lease, timeout_s)
        pacer = WaitPacer(None if timeout_s is None else time.monotonic() + timeout_s)
        while True:
            asked_at, wait_s = pacer.ask()  # bounded without `timeout_s` too (`WaitPacer`)
            body = self._send.lease_state(lease, wait_s)
            self._server.instance(body, "lease", None)  # another server's: its pools mapped
            fresh = self._pools.waited(body, lease, self.release)
            if fresh.state is not LeaseState.PENDING:
                fresh.wait(0)  # raises LeaseError for an ended lease
                return fresh
            if pacer.past_deadline(lease.lease_id):  # `WaitTimeoutError` past the client's bound
                return fresh
            time.sleep(pacer.after(asked_at, wait_s))

    def release(self, lease: Lease | int) -> None:
        lease_id, tenant = release_of(lease)  # checked as the store checks it
        self._post("/v1/release", {"lease_id": lease_id}, self._key.held(tenant))

    def cancel(self, lease: Lease) -> None:
        """`KVStore.cancel`: a pending lease cancelled, a ready one released (the server's
        `/v1/release` ends a lease in either state); `LeaseError` if it is not live."""
        self.release(lease_of(lease))

    def store(
        self,
        tokens: Tokens,
        kv: torch.Tensor,
        *,
        tenant: str = "default",
        start: int = 0,
        layout: str = "layers",
    ) -> StoreResult:
        """`KVStore.store`. `kv` is checked against the served layout and the tokens from
        `start` on (`InvalidKVError`, `InvalidArgumentError`) before anything is sent, on the
        shared-memory path and the body path alike. A reserve refused (`CapacityError`), or a
        reservation that ended before its commit (`LeaseError`: the write into the mapped pool
        outlasted its ttl; its slots stay quarantined on the server for
        `policy.reservation_quarantine_s`), and `kv` is sent again in the body."""
        with self._calls.call():
            kind = kv_layout(layout)
            tokens = token_array(check_tokens(tokens))  # checked once: check_kv, reserve, body
            self._server.refresh()  # a re-map that failed: asked again (`mapper.py`)
            self.layout()  # the served pools: the layout `kv` is checked against, the body limit
            kv = self._pools.check_kv(tokens, kv, start, kind)  # a copy of a view of a pool
            if self._pools.buffers:
                try:
                    reservation, instance = self._reserve(tokens, tenant, None)
                except CapacityError:  # over its quota or the tier: the body path, as `load`
                    reservation, instance = NOTHING_RESERVED
                if (cached := self._pools.all_cached(reservation, tokens)) is not None:
                    return cached  # the server holds it all: nothing to send
                pool = self._pools.writable(reservation, start, instance)
                if pool is not None:
                    try:
                        self._pools.write_blocks(reservation, pool, kv, start, kind)
                    except Exception:
                        self.abort(reservation)
                        raise
                    try:
                        return self.commit(reservation)
                    except LeaseError:  # it ended before the commit (its ttl): the body path
                        pass
                elif reservation.num_tokens:
                    self.abort(reservation)
            pieces = StorePieces(tokens, kv, start, kind, self._pools.served)
            while (body := pieces.next()) is not None:
                pieces.add(self._post("/v1/store", body, tenant))
            return pieces.result

    def load(
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
            self._server.refresh()  # a re-map that failed: asked again (`mapper.py`)
            dest = None
            if start or out is not None or kind != "layers" or "gpu" in self._pools.buffers:
                self.layout()  # known before `start` and `out` are checked against it
                dest = self._pools.destination(pages.asked, out, kind, wanted, start)
            if "gpu" in self._pools.buffers:
                assert dest is not None
                try:
                    granted = self._prefetch(tokens, tenant, None, True, True)
                except (CapacityError, LeaseError):
                    pass  # larger than the gpu tier can lease, or ended unready: the body
                else:
                    lease, first = granted.lease, start // dest.layout.block_tokens
                    try:
                        kv = self._pools.read_blocks(lease, granted.instance, dest, first)
                    except BaseException:
                        self.release(lease)
                        raise
                    if kv is None:  # not the pools mapped here: the body path
                        self._owing.owe(lease, tenant)  # released on a later request's way
                    elif self._owing.settle(granted, tenant, kv):  # held through the copy
                        return LoadResult(lease.num_tokens, kv)
                    else:  # it ended first: the copy zeroed, none of it left in `out`
                        dest = self._pools.destination(pages.asked, out, kind, wanted, start)
            while (request := pages.next()) is not None:  # a long prefix: several replies
                body = self._post("/v1/load", request, tenant)
                if body.get("truncated") is True and pages.block_tokens is None:
                    pages.block_tokens = self.layout().block_tokens  # pages end on them
                pages.add(body)
            return self._pools.loaded(pages, wanted, pages.asked, dest, start)

    def reserve(
        self, tokens: Tokens, *, tenant: str = "default", ttl_s: float | None = None
    ) -> Reservation:
        return self._reserve(tokens, tenant, ttl_s)[0]

    def _reserve(self, tokens: Tokens, tenant: str, ttl_s: float | None) -> ReservationFrom:
        """`reserve`, and the server instance of its reply."""
        with self._calls.call():
            request: dict[str, Any] = {"tokens": encode_tokens(check_tokens(tokens))}
            if (ttl := ttl_field(ttl_s)) is not None:  # checked before anything is sent
                request["ttl_s"] = ttl
            deadline = time.monotonic() + self._timeout_s  # the call's (`owing.py`)
            token, body = self._send.granting(
                "reservation", "/v1/reserve", request, tenant, deadline
            )
            with self._owing.keeping("reservation", token, tenant, deadline):
                instance = self._server.instance(body, "reservation", tenant)
                reservation = self._pools.reservation(body, request["tokens"])
            return reservation, instance

    def commit(self, reservation: Reservation | int) -> StoreResult:
        """`KVStore.commit`: a `Reservation`, or its id (of this client's tenant)."""
        r = self._key.reserved(reservation)  # checked as the store checks it
        reply = self._post("/v1/commit", {"reservation_id": r.reservation_id}, r.tenant)
        return self._pools.stored(reply, r.most_tokens)

    def abort(self, reservation: Reservation | int) -> None:
        """`KVStore.abort`: a `Reservation`, or its id (of this client's tenant)."""
        r = self._key.reserved(reservation)
        self._post("/v1/abort", {"reservation_id": r.reservation_id}, r.tenant)

    def reset(self, tenant: str = "default") -> dict[str, Any]:
        """`POST /v1/reset` (`KVStore.reset`): the tenant's KV forgotten; the reply checked."""
        return replies.reset(self._post("/v1/reset", {}, tenant))

    def status(self) -> dict[str, Any]:
        return self._get("/v1/status")

    def blocks(self) -> dict[str, Any]:
        """`GET /v1/blocks`: `{block_size, topics: [{topic, seq, events}]}`, every block held as
        a KV-event batch per topic (a router's resync), checked (`ProtocolError`)."""
        return replies.blocks(self._get("/v1/blocks"))

    def layout(self) -> KVLayout:
        """The server's KV layout (`/v1/pools`, checked; model name "served"), asked once: an
        engine's caches, pages and `out` are checked against it before it stores or loads."""
        if self._pools.served is None:
            self._pools.map(self._get("/v1/pools"), mapping=False)
        assert self._pools.served is not None
        return self._pools.served.layout

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the loads, stores, prefetches and reserves under way (up to `timeout_s`,
        default the client's; one called after is a `ClosedError`: `calls.py`), release and
        give back what is owed (sent until that bound, again), then close the connections and
        forget the mapped pools (a tensor taken from `pool_buffer` before is still the live
        pool's memory: it cannot be unmapped under it). A call still under way then gives back
        what it is granted itself. In another process than the maker's: `ClosedError`."""
        check_timeout(timeout_s)
        bound = self._timeout_s if timeout_s is None else timeout_s
        self._calls.close(bound)  # in a fork: `ClosedError`, nothing sent nor closed
        self._owing.close(time.monotonic() + bound)
        self._http.close()
        if (lane := self._lane) is not None:
            lane.close()
        self._pools.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
