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
- A KV is checked against the served layout before it is written into a pool (`check_kv`), as
  the server never sees it before the commit.
- Writes into a CUDA pool are complete when `write_blocks` returns, before the commit lets the
  server read the slots; reads out of one, when `read_blocks` returns, before the release lets
  the server reuse them.
- Blocks move between a mapped pool and the caller's tensor in one pass, in the layout the
  caller asked for (`caller_kv.py`: one copy per run of slots): no temporary, no transpose.
- A load reply in the body is checked against the prompt before a byte of it lands in the
  caller's `out`: whole blocks, no more tokens than were asked (`ReplyError`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.blocks import Tokens, check_start, encode_tokens, from_blocks, to_blocks
from kvtier.caller_kv import Destination, KVKind, blocks_view, check_kv_as
from kvtier.errors import ReplyError
from kvtier.kernels.block_copy import copy_blocks_slices
from kvtier.results import Lease, LoadResult, Reservation
from kvtier.service import replies, wire
from kvtier.service.cuda_ipc import import_pool
from kvtier.tiers.shm import map_shared


class MappedPools:
    """The pools a server offers and those of them mapped here; empty until `map`."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # tier -> the mapped pool
        self.served: replies.Pools | None = None  # what the server offers, once asked

    def map(self, body: dict[str, Any], mapping: bool = True) -> None:
        """Map every pool the server offers, once its whole reply is checked (`ReplyError`,
        nothing mapped); a pool that is not here to map stays unmapped. Without `mapping`,
        only learn the layout and the pools (a client without shared memory that needs the
        layout for a caller's `out`)."""
        served = replies.pools(body)
        if not mapping:
            self.served = served
            return
        dtype = served.layout.dtype
        for pool in served.pools:
            shape = served.layout.pool_shape(pool.num_slots)
            ipc = pool.cuda_ipc
            try:
                if pool.shared_memory is not None:
                    self.buffers[pool.tier] = map_shared(pool.shared_memory, dtype, shape)
                elif ipc is not None and ipc.device < torch.cuda.device_count():
                    self.buffers[pool.tier] = import_pool(ipc)
            except (OSError, RuntimeError):
                continue  # another host, user or GPU, or not its server's file: the body path
        self.served = served

    def clear(self) -> None:
        """Forget every mapping (the client is closed)."""
        self.buffers.clear()

    def lease(self, body: dict[str, Any], canceller: Callable[[Lease], None] | None) -> Lease:
        """A lease reply, checked against the served pools."""
        return replies.lease(body, self.served, canceller)

    def reservation(self, body: dict[str, Any], tokens: bytes) -> Reservation:
        """A reservation reply for the packed `tokens`, checked against the served pools."""
        return replies.reservation(body, self.served, len(tokens) // 4)

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
        is asked of the server), or a new tensor on `device` (the CPU)."""
        assert self.served is not None, "the layout is known before a load in a caller's layout"
        layout = self.served.layout
        check_start(start, asked, layout.block_tokens)
        return Destination.of(layout, kind, asked - start, out, device, torch.device("cpu"))

    def loaded(
        self,
        body: dict[str, Any],
        device: torch.device | str | None,
        asked: int = 0,
        dest: Destination | None = None,
        start: int = 0,
    ) -> LoadResult:
        """A `/v1/load` reply (KV in the body, from token `start`): on `device` (None: the
        CPU), or into `dest` for a prompt of `asked` tokens."""
        layout = None if self.served is None else self.served.layout
        num_tokens, kv = replies.loaded(body, layout, start)
        if dest is None:
            return LoadResult(num_tokens, kv.to(device or "cpu"))
        bt = dest.layout.block_tokens
        if num_tokens % bt or num_tokens > asked:
            raise ReplyError(
                f"load.num_tokens: got {num_tokens}, expected whole blocks of {bt} tokens, at "
                f"most the {asked} asked"
            )
        count = max(0, num_tokens - start) // bt
        dest.blocks(count).copy_(to_blocks(kv, bt))
        return LoadResult(num_tokens, dest.result(count))

    def check_kv(
        self, tokens: Tokens, kv: torch.Tensor, start: int = 0, kind: KVKind = "layers"
    ) -> None:
        """`InvalidKVError` for a KV that the server would refuse (`kv` holds tokens from
        `start` on, in `kind`): the shared-memory path writes it into the pool before the
        server sees it, so it is checked here."""
        assert self.served is not None, "pools are mapped with their layout"
        num_tokens = len(encode_tokens(tokens)) // 4
        check_start(start, num_tokens, self.served.layout.block_tokens)
        check_kv_as(self.served.layout, kv, kind, num_tokens - start)

    def writable(self, reservation: Reservation, start: int) -> bool:
        """Whether this client can fill `reservation` from a KV that begins at `start`: it
        reserved something, in a pool mapped here, and nothing before `start` (which the
        caller has no KV for; the body path then stores nothing, as the server decides)."""
        return bool(
            reservation.num_tokens
            and reservation.tier in self.buffers
            and reservation.cached_tokens >= start
        )

    def write_blocks(
        self, reservation: Reservation, kv: torch.Tensor, start: int = 0, kind: KVKind = "layers"
    ) -> None:
        """Write the reserved blocks of `kv` (checked by `check_kv`; its tokens from `start`
        on, in `kind`) into their mapped slots, in one pass."""
        assert self.served is not None, "pools are mapped with their layout"
        bt = self.served.layout.block_tokens
        begin, count = (reservation.cached_tokens - start) // bt, reservation.num_tokens // bt
        pool = self.buffers[reservation.tier]
        blocks = blocks_view(kv, kind, bt, begin + count)[begin:]
        copy_blocks_slices(blocks, pool, range(count), list(reservation.slots))
        if pool.is_cuda:  # complete before the commit lets the server read the slots
            torch.cuda.synchronize(pool.device)

    def read_blocks(
        self, lease: Lease, dest: Destination, asked: int, first: int = 0
    ) -> torch.Tensor:
        """The leased prefix's KV from its block `first` on, copied out of the mapped gpu pool
        into `dest` in one pass: the part of it that holds them. A lease of more blocks than a
        prompt of `asked` tokens has is the server's lie (`ReplyError`), refused before a byte
        is copied."""
        table = list(lease.block_table)
        if len(table) > asked // dest.layout.block_tokens:
            raise ReplyError(
                f"prefetch.block_table: got {len(table)} blocks, expected at most the "
                f"{asked // dest.layout.block_tokens} full blocks of the {asked} tokens asked"
            )
        wanted = table[first:]
        pool = self.buffers["gpu"]
        copy_blocks_slices(pool, dest.blocks(len(wanted)), wanted, range(len(wanted)))
        if pool.is_cuda:  # complete before the release lets the server reuse the slots
            torch.cuda.synchronize(pool.device)
        return dest.result(len(wanted))


def store_body(
    tokens: Tokens, kv: torch.Tensor, start: int, kind: KVKind, block_tokens: int
) -> dict[str, Any]:
    """A `/v1/store` body: the KV travels layer-major; pages give their full blocks only, and
    the tokens past them are left out (a partly filled page is never stored)."""
    packed = encode_tokens(tokens)
    if kind == "blocks":
        full = (len(packed) // 4 - start) // block_tokens
        packed = packed[: (start + full * block_tokens) * 4]
        kv = from_blocks(kv[:full])
    return {"tokens": packed, **wire.kv_to_wire(kv), "start": start}
