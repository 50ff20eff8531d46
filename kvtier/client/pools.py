"""The shared-memory data path: the server's pools mapped into this process, and the blocks
read and written through them.

`MappedPools.map(body)` reads a `/v1/pools` reply: the layout and pools the server offers
(`served`), and, of those, the ones that can be mapped here (`buffers`, tier -> tensor
`[slots, *block_shape]`): a /dev/shm segment that is exactly the file its server made
(`tiers/shm.py`), or a CUDA pool through its IPC description (`service/cuda_ipc.py`). A pool
that cannot be mapped (another host, user or GPU) is simply absent from `buffers`, and the
clients send its KV in the body instead.

Invariants:
- Nothing is mapped unless the whole reply passed its checks (`ReplyError` naming the field);
  leases and reservations are checked against the served pools before a slot of them is read
  or written (`service/replies.py`).
- Every reply is checked against its request too: no more tokens than were sent (lookup,
  lease, store, commit, load), the lease waited on and no other, and tenants that the next
  request can send back in a header (`ReplyError`).
- A KV is checked against the served layout before it is written into a pool (`check_kv`), as
  the server never sees it before the commit.
- Writes into a CUDA pool are complete when `write_blocks` returns, before the commit lets the
  server read the slots; reads out of one, when `read_blocks` returns, before the release lets
  the server reuse them.
- Blocks move between a mapped pool and the caller's tensor in one pass, in the layout the
  caller asked for (`caller_kv.py`: one copy per run of slots): no temporary, no transpose.
- A mapping is used only for its server's slots. A server that restarts at the same URL has
  new pools, and a lease or reservation of the new server names slots of those: read or
  written in the old mapping they were the old server's memory, any tenant's bytes. So every
  `/v1/pools` reply and every reply that names slots carries the server's `instance`, random
  per server process (`service/admission.py`, checked in `service/replies.py`), and a mapped
  pool is handed out for a reply's slots only when the mapping is of the reply's instance
  (`pool_for`; `writable`), checked on one snapshot of the mappings so that a re-mapping on
  another thread cannot slip in between. The check does not depend on the pool's kind: a
  CUDA IPC pool (which has no file to look at) is covered by the same line as a /dev/shm one.
  A /dev/shm pool is also still the very file mapped (`segment_id`; defence in depth: a
  segment unlinked under a live server), else that tier is forgotten.
- A reply of another instance (`stale`) makes the clients forget every mapping at once (the
  old server's memory is unmapped with them) and ask `/v1/pools` again, once per instance: a
  server whose replies keep naming other instances costs one request each, never a loop. The
  new pools are mapped (`map`), and the reply's slots are used through them if their
  instance is the reply's; else its KV travels in the body. A new server of another layout is
  a `LayoutChangedError` (`pools.layout`, a `ReplyError`), with nothing mapped.
- A load reply in the body is checked against the prompt before it is returned or a byte of
  it lands in the caller's `out`: no more tokens than were asked, in whole blocks where the
  layout is known (`ReplyError`).
- A caller's `out` is never memory of a pool mapped here (`destination`: a view of
  `pool_buffer` is refused before anything is asked), so a load writes no server slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.blocks import Tokens, check_start, encode_tokens, to_blocks
from kvtier.caller_kv import Destination, KVKind, blocks_view, check_kv_as, overlapped_pool
from kvtier.client.arguments import check_tier
from kvtier.client.pages import LoadPages, joined, stored
from kvtier.errors import LayoutChangedError, ReplyError, shown
from kvtier.kernels.block_copy import copy_blocks_slices
from kvtier.results import Lease, LoadResult, LookupResult, Reservation, StoreResult
from kvtier.service import replies
from kvtier.service.cuda_ipc import import_pool
from kvtier.tiers.shm import map_shared, segment_id

ReservationFrom = tuple[Reservation, str | None]
"""A reservation and the server instance of the reply that granted it (`writable`)."""
NOTHING_RESERVED: ReservationFrom = (Reservation(0, "default", 0, 0, "gpu", (), 0.0), None)
"""A reserve refused (`CapacityError`, `QuotaError`): no slots, so `writable` sends the store
through the body, which stores what the server's own `store` does (a mapped `store` never
fails where the same store through the body would not)."""


@dataclass(frozen=True)
class PoolMapping:
    """The pools mapped here, all of one server `instance` (None: a server without instance
    ids, or nothing mapped): tier -> the mapped pool, and for a /dev/shm pool tier -> (name,
    the file mapped). Replaced whole, never changed in place."""

    instance: str | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    segments: dict[str, tuple[str, tuple[int, int]]] = field(default_factory=dict)


class MappedPools:
    """The pools a server offers and those of them mapped here; empty until `map`."""

    def __init__(self) -> None:
        self.served: replies.Pools | None = None  # what the server offers, once asked
        self.mapping = PoolMapping()
        self._maps = False  # whether this client maps pools (`map` with `mapping`)
        self._asked_for: str | None = None  # the last instance `stale` asked pools again for
        self._lock = threading.Lock()  # `stale` and the replacements of `mapping`

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Tier -> the pool mapped here, as mapped now (read only)."""
        return self.mapping.buffers

    def map(self, body: dict[str, Any], mapping: bool = True) -> None:
        """Map every pool the server offers, once its whole reply is checked (`ReplyError`,
        nothing mapped); a pool that is not here to map stays unmapped. Without `mapping`,
        only learn the layout and the pools (a client without shared memory that needs the
        layout for a caller's `out`). A layout other than the one learnt before is a
        `LayoutChangedError` (`pools.layout`): the caller's KV was checked against that one."""
        served = replies.pools(body)
        if self.served is not None and served.layout != self.served.layout:
            raise LayoutChangedError(
                f"pools.layout: got {served.layout}, expected {self.served.layout}, the layout "
                "this client was serving (the server restarted with another)"
            )
        if not mapping:
            self.served = served
            return
        buffers: dict[str, torch.Tensor] = {}
        segments: dict[str, tuple[str, tuple[int, int]]] = {}
        dtype = served.layout.dtype
        for pool in served.pools:
            shape = served.layout.pool_shape(pool.num_slots)
            ipc = pool.cuda_ipc
            try:
                if pool.shared_memory is not None:
                    mapped = segment_id(pool.shared_memory)
                    buffer = map_shared(pool.shared_memory, dtype, shape)
                    if mapped is None or segment_id(pool.shared_memory) != mapped:
                        continue  # replaced while it was mapped: which file is not known
                    buffers[pool.tier] = buffer
                    segments[pool.tier] = (pool.shared_memory, mapped)
                elif ipc is not None and ipc.device < torch.cuda.device_count():
                    buffers[pool.tier] = import_pool(ipc)
            except (OSError, RuntimeError):
                continue  # another host, user or GPU, or not its server's file: the body path
        with self._lock:
            self.mapping = PoolMapping(served.instance, buffers, segments)
            self.served, self._maps = served, True

    def clear(self) -> None:
        """Forget every mapping (the client is closed, or its server restarted)."""
        with self._lock:
            self.mapping = PoolMapping()

    def stale(self, instance: str | None) -> bool:
        """Whether a reply of server `instance` (one naming slots) calls for `/v1/pools` again:
        this client maps pools, those mapped are another instance's, and the pools were not
        asked for again for `instance` yet. If so every mapping is forgotten now (module doc);
        the caller asks, and hands the reply to `map`."""
        with self._lock:
            if not self._maps or instance in (self.mapping.instance, self._asked_for):
                return False
            self._asked_for, self.mapping = instance, PoolMapping()
            return True

    def pool_for(self, tier: str, instance: str | None) -> torch.Tensor | None:
        """The pool of `tier` mapped here, if the mapping is of server `instance` (the one of
        the reply that names the slots) and still its server's (module doc), else None (a
        /dev/shm pool whose file was replaced is forgotten). One check for every kind of
        pool: a CUDA IPC pool is told apart by the instance alone, by this same code, which
        the CPU tests run with /dev/shm pools."""
        now = self.mapping
        pool = now.buffers.get(tier)
        if pool is None or now.instance != instance:
            return None
        segment = now.segments.get(tier)
        if segment is None or segment_id(segment[0]) == segment[1]:
            return pool
        with self._lock:
            if self.mapping is now:
                buffers = {t: b for t, b in now.buffers.items() if t != tier}
                segments = {t: n for t, n in now.segments.items() if t != tier}
                self.mapping = PoolMapping(now.instance, buffers, segments)
        return None

    def lease(
        self, body: dict[str, Any], canceller: Callable[[Lease], None] | None, asked: int
    ) -> Lease:
        """A lease reply to a prefetch of `asked` tokens, checked against the served pools: a
        prefix of them."""
        lease = replies.lease(body, self.served, canceller)
        _at_most(lease.num_tokens, asked, "lease.num_tokens", "tokens asked")
        _sendable(lease.tenant, "lease.tenant")
        return lease

    def waited(
        self, body: dict[str, Any], waited: Lease, canceller: Callable[[Lease], None] | None
    ) -> Lease:
        """A reply to a wait on the lease `waited`: that lease (id, tokens and slots), in the
        state it is in now."""
        lease = self.lease(body, canceller, waited.num_tokens)
        got = (lease.lease_id, lease.num_tokens, lease.block_table)
        if got != (waited.lease_id, waited.num_tokens, waited.block_table):
            raise ReplyError(
                f"lease: got lease {lease.lease_id} of {lease.num_tokens} tokens in slots "
                f"{list(lease.block_table)!r:.80}, expected the lease waited on: "
                f"{waited.lease_id} of {waited.num_tokens} tokens in "
                f"{list(waited.block_table)!r:.80}"
            )
        return lease

    def reservation(self, body: dict[str, Any], tokens: bytes) -> Reservation:
        """A reservation reply for the packed `tokens`, checked against the served pools."""
        reservation = replies.reservation(body, self.served, len(tokens) // 4)
        _sendable(reservation.tenant, "reservation.tenant")
        return reservation

    def lookup(self, body: dict[str, Any], asked: int) -> LookupResult:
        """A lookup reply for `asked` tokens: a prefix of them."""
        result = replies.lookup(body)
        _at_most(result.num_tokens, asked, "lookup.num_tokens", "tokens asked")
        return result

    def stored(self, body: dict[str, Any], sent: int) -> StoreResult:
        """A store or commit reply for a sequence of `sent` tokens (`pages.stored`)."""
        return stored(body, sent)

    def destination(
        self,
        asked: int,
        out: torch.Tensor | None,
        kind: KVKind,
        device: torch.device | None,
        start: int = 0,
    ) -> Destination:
        """Where a load of `asked` tokens from token `start` writes: `start` and `out` checked
        against the served layout (`InvalidArgumentError`, `InvalidKVError`, before anything
        is asked of the server), `out` apart from every pool mapped here (a view of one, e.g.
        of `pool_buffer`, would write the server's slots: `InvalidArgumentError` naming `out`),
        or a new tensor on `device` (the CPU)."""
        assert self.served is not None, "the layout is known before a load in a caller's layout"
        layout, cpu = self.served.layout, torch.device("cpu")
        check_start(start, asked, layout.block_tokens)
        return Destination.of(layout, kind, asked - start, out, device, cpu, self.buffers)

    def loaded(
        self,
        pages: LoadPages,
        device: torch.device | str | None,
        asked: int,
        dest: Destination | None = None,
        start: int = 0,
    ) -> LoadResult:
        """The `/v1/load` replies of one load (KV in the body, from token `start`; `pages.py`),
        joined: on `device` (None: the CPU), or into `dest` for a prompt of `asked` tokens."""
        layout = None if self.served is None else self.served.layout
        parts = [(first, *replies.loaded(body, layout, first)) for first, body in pages.replies]
        num_tokens, kv = joined(parts)  # the contiguous KV delivered (`pages.joined`)
        bt = 1 if layout is None else layout.block_tokens
        if num_tokens % bt or num_tokens > asked:
            blocks = "" if layout is None else f"whole blocks of {bt} tokens, "
            raise ReplyError(
                f"load.num_tokens: got {num_tokens}, expected {blocks}at most the {asked} asked"
            )
        if dest is None:
            return LoadResult(num_tokens, kv.to(device or "cpu"))
        count = max(0, num_tokens - start) // bt
        dest.blocks(count).copy_(to_blocks(kv, bt))
        return LoadResult(num_tokens, dest.result(count))

    def check_kv(
        self, tokens: Tokens, kv: torch.Tensor, start: int = 0, kind: KVKind = "layers"
    ) -> torch.Tensor:
        """The KV a store sends: `kv` (tokens from `start` on, in `kind`), or a copy of it
        where it shares memory with a pool mapped here (`pool_buffer("gpu")[a:b]`, the pages of
        a lease): the server's reserve may free those very slots, plant its canaries in them
        and hand them back for the new blocks, which were then written from themselves (a
        block stored with another block's bytes; audit AV). `InvalidKVError` for a KV that the
        server would refuse: the shared-memory path writes it into the pool before the server
        sees it, so it is checked here."""
        assert self.served is not None, "pools are mapped with their layout"
        num_tokens = len(encode_tokens(tokens)) // 4
        check_start(start, num_tokens, self.served.layout.block_tokens)
        check_kv_as(self.served.layout, kv, kind, num_tokens - start)
        return kv.clone() if overlapped_pool(kv, self.buffers) else kv

    def writable(
        self, reservation: Reservation, start: int, instance: str | None
    ) -> torch.Tensor | None:
        """The mapped pool this client fills `reservation` of server `instance` in, from a KV
        that begins at `start`, or None (the body path): it reserved something, in a pool
        mapped here from that instance (`pool_for`), and nothing before `start` (which the
        caller has no KV for; the body path then stores nothing, as the server decides)."""
        if not reservation.num_tokens or reservation.cached_tokens < start:
            return None
        return self.pool_for(reservation.tier, instance)

    def all_cached(self, reservation: Reservation, tokens: Tokens) -> StoreResult | None:
        """The store's result when `reservation` found every whole block of `tokens` cached (the
        server's own store would store nothing): no body is then sent. None otherwise."""
        assert self.served is not None, "pools are mapped with their layout"
        whole = len(tokens) // self.served.layout.block_tokens * self.served.layout.block_tokens
        if reservation.num_tokens or not whole or reservation.cached_tokens < whole:
            return None
        return StoreResult(reservation.cached_tokens, 0, 0)

    def write_blocks(
        self,
        reservation: Reservation,
        pool: torch.Tensor,
        kv: torch.Tensor,
        start: int = 0,
        kind: KVKind = "layers",
    ) -> None:
        """Write the reserved blocks of `kv` (checked by `check_kv`; its tokens from `start`
        on, in `kind`) into their slots of `pool` (`writable`'s), in one pass."""
        assert self.served is not None, "pools are mapped with their layout"
        bt = self.served.layout.block_tokens
        begin, count = (reservation.cached_tokens - start) // bt, reservation.num_tokens // bt
        blocks = blocks_view(kv, kind, bt, begin + count)[begin:]
        copy_blocks_slices(blocks, pool, range(count), list(reservation.slots))
        if pool.is_cuda:  # complete before the commit lets the server read the slots
            torch.cuda.synchronize(pool.device)

    def read_blocks(
        self, lease: Lease, instance: str | None, dest: Destination, first: int = 0
    ) -> torch.Tensor | None:
        """The leased prefix's KV from its block `first` on, copied out of the mapped gpu pool
        into `dest` in one pass: the part of it that holds them (a lease checked by `lease`
        holds no more blocks than its prompt); None, nothing read, unless the gpu pool mapped
        here is of server `instance`, the one of the reply that granted the lease (`pool_for`).
        """
        pool = self.pool_for("gpu", instance)
        if pool is None:
            return None
        wanted = list(lease.block_table)[first:]
        copy_blocks_slices(pool, dest.blocks(len(wanted)), wanted, range(len(wanted)))
        if pool.is_cuda:  # complete before the release lets the server reuse the slots
            torch.cuda.synchronize(pool.device)
        return dest.result(len(wanted))


class MappedView:
    """What both clients show of the pools mapped here (`Client`, `AsyncClient` mix it in)."""

    _pools: MappedPools

    def pool_buffer(self, tier: str) -> torch.Tensor | None:
        """The server's pool of `tier` mapped here (`[slots, *block_shape]`), or None (not
        mapped here: another host or user, a closed client, "disk" or "remote"); a `tier` that
        names no tier is an `InvalidArgumentError`. The tensor is the memory of the server
        instance mapped now (`mapped_instance`): after the client re-maps (the sidecar
        restarted), take it again; the old one reads the old server's pages, never the new
        one's."""
        return self._pools.buffers.get(check_tier(tier))

    @property
    def mapped_instance(self) -> str | None:
        """The instance id of the server whose pools are mapped here (random per server
        process; None: none mapped). It changes when the client re-maps after a restart of
        the sidecar at its URL: an engine that keeps a `pool_buffer` tensor takes it again."""
        return self._pools.mapping.instance


def _at_most(count: int, bound: int, field: str, what: str) -> None:
    if count > bound:
        raise ReplyError(f"{field}: got {count}, expected at most the {bound} {what}")


def _sendable(tenant: str, field: str) -> None:
    """`ReplyError` for a tenant that no request header can carry back to the server."""
    if not (tenant.isascii() and tenant.isprintable()):
        raise ReplyError(f"{field}: got {shown(tenant)}, expected printable ASCII (a tenant id)")
