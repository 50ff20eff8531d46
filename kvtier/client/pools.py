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
  server read the slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.blocks import Tokens, check_kv, check_start, from_blocks, to_blocks
from kvtier.results import Lease, LoadResult, Reservation
from kvtier.service import replies, wire
from kvtier.service.cuda_ipc import import_pool
from kvtier.tiers.shm import map_shared


class MappedPools:
    """The pools a server offers and those of them mapped here; empty until `map`."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # tier -> the mapped pool
        self.served: replies.Pools | None = None  # what the server offers, once asked

    def map(self, body: dict[str, Any]) -> None:
        """Map every pool the server offers, once its whole reply is checked (`ReplyError`,
        nothing mapped); a pool that is not here to map stays unmapped."""
        served = replies.pools(body)
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

    def loaded(self, body: dict[str, Any], device: torch.device | str | None) -> LoadResult:
        """A `/v1/load` reply (KV in the body), on `device` (None: the CPU)."""
        num_tokens, kv = replies.loaded(body, None if self.served is None else self.served.layout)
        return LoadResult(num_tokens, kv.to(device or "cpu"))

    def check_kv(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> None:
        """`InvalidKVError` for a KV that the server would refuse (`kv` holds tokens from
        `start` on): the shared-memory path writes it into the pool before the server sees
        it, so it is checked here."""
        assert self.served is not None, "pools are mapped with their layout"
        num_tokens = len(wire.pack_tokens(tokens)) // 4
        check_start(start, num_tokens, self.served.layout.block_tokens)
        check_kv(self.served.layout, kv, num_tokens - start)

    def writable(self, reservation: Reservation, start: int) -> bool:
        """Whether this client can fill `reservation` from a KV that begins at `start`: it
        reserved something, in a pool mapped here, and nothing before `start` (which the
        caller has no KV for; the body path then stores nothing, as the server decides)."""
        return bool(
            reservation.num_tokens
            and reservation.tier in self.buffers
            and reservation.cached_tokens >= start
        )

    def write_blocks(self, reservation: Reservation, kv: torch.Tensor, start: int = 0) -> None:
        """Write the reserved blocks of `kv` (checked by `check_kv`; its tokens from `start`
        on) into their mapped slots."""
        assert self.served is not None, "pools are mapped with their layout"
        begin = reservation.cached_tokens - start
        pool = self.buffers[reservation.tier]
        blocks = to_blocks(
            kv[:, :, begin : begin + reservation.num_tokens], self.served.layout.block_tokens
        )
        pool[list(reservation.slots)] = blocks.to(pool.device)
        if pool.is_cuda:  # complete before the commit lets the server read the slots
            torch.cuda.synchronize(pool.device)

    def read_blocks(self, lease: Lease) -> torch.Tensor:
        """The leased prefix's KV, copied out of the mapped gpu pool (`[layers, 2, tokens,
        ...]` on the CPU)."""
        return from_blocks(self.buffers["gpu"][list(lease.block_table)].cpu())  # indexing copies
