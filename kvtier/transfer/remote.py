"""The store's link to the remote tier (issue 14): what it shares, and what it takes back.

- **Out** (`after_store`, called by the write path under the cache's lock, right after new
  blocks entered the index): their ids along the path (chained now, `Forest.ids_of`) and their
  KV go to the `RemoteWriter`, which copies to host memory the leading blocks its backlog has
  room for (`tiers.remote.max_pending_bytes`) and writes them behind the caller; the rest are
  dropped and counted. Blocks stored below a prefix that lives only on disk go out too
  (`after_store_key`: their insert flight may enter the index after the call, so their ids are
  chained from the key, as a reader chains them). Blocks that came from the remote are not
  sent back.
- **In** (`fill`, called by `prefetch` and `load` before they take the lock): the blocks of the
  request past the local cached prefix that the cluster holds in a row (one round trip to
  probe) are read in chunks, one round trip each: the first of at most `group_blocks` blocks,
  each next one twice the last, up to `FILL_CHUNK_BYTES` (at least one block). Each chunk is
  verified and stored into the local tiers through the ordinary write path (`store_blocks`, the
  callback the store gives), as if computed here: placement, room, prefix closure and quotas
  are the write path's. Then the prefetch or load runs as usual and finds them. Only a verified
  leading run is stored: a block missing or failing verification ends it (the rest would break
  prefix closure). A chunk the local tiers do not take whole (no room for it: a store is all or
  nothing; or KV they cannot keep: a quantized host cannot keep a value past fp16's range,
  which the cluster holds plain) ends the fill, counted in `fill_refused`: so a fill reads at
  most one chunk more than the local tiers keep, whatever the prompt's length, and the
  prefetch or load serves what was stored. Blocks of the chunk that another call (a load of
  the same prompt, a store) put in the index during the round trip are taken, not refused: the
  fill goes on past them. Below a prefix that lives only on disk the blocks
  go in insert flights, which a background mover may land after the call: the first chunk
  taken (stored or pending) ends the fill (the next would extend blocks not in the index yet);
  one not taken whole is refused, counted, as above.
  A prefetch's fill stops within the blocks its tenant could still lease on gpu (`most`,
  `Operations.fill_from_remote`): a prefetch is all or nothing, and a longer prefix would make
  one that leases a shorter prefix fail.
  Counters: `fills` (fills that stored blocks), `filled_blocks`, `fill_misses` (the cluster
  served none), `fill_refused`.

Contract: nothing here raises because of the cluster; it never holds the cache's lock during a
round trip. Ids sent out are the index's; ids asked for are chained from the request's tokens
under the tenant's namespace seed, so a tenant only ever reads blocks of its own namespace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from kvtier.blocks import BlockId
from kvtier.errors import InvalidKVError
from kvtier.index import Node, RadixIndex
from kvtier.tiers.base import DISK
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.remote.writer import RemoteWriter

FILL_CHUNK_BYTES = 16 * 2**20
"""The most a fill reads from the cluster in one round trip (at least one block): with the
local tiers' refusal ending a fill, the bound on what it reads and does not keep."""

StoreBlocks = Callable[[BlockId, str, bytes, torch.Tensor, int], int]
"""`store_blocks(namespace, tenant, key, blocks, first)`: store the blocks of `key` from position
`first` on, `blocks` `[n, *block_shape]` (tokens from `first * block_tokens`), under the lock;
returns how many were taken: stored, or pending (landing on disk after the call)."""


class RemoteLink:
    def __init__(
        self,
        index: RadixIndex,
        tier: RemoteTier,
        writer: RemoteWriter,
        lock: threading.RLock,
        store_blocks: StoreBlocks,
    ) -> None:
        self.index = index
        self.tier = tier
        self.writer = writer
        self._lock = lock
        self._store_blocks = store_blocks
        self.stats = dict.fromkeys(("filled_blocks", "fills", "fill_misses", "fill_refused"), 0)

    def after_store(self, namespace: BlockId, end: Node, start: int, blocks: torch.Tensor) -> None:
        """New blocks start.. of the path to `end` (KV `blocks`, `[n, *block_shape]`) were
        stored: queue them for the cluster. Under the cache's lock."""
        forest = self.index.forest  # the path's ids node by node: O(nodes), not O(blocks)
        ids = forest.hasher.split(b"".join(forest.ids_of(node) for node in self.index.path(end)))
        self.writer.submit(bytes(namespace), ids, start, blocks)  # it copies what it takes

    def after_store_key(
        self, namespace: BlockId, key: bytes, start: int, blocks: torch.Tensor
    ) -> None:
        """As `after_store`, for new blocks start.. of `key` that are not in the index yet (a
        store below a disk-only prefix: its insert flight lands on disk, perhaps after the call):
        their ids chained from `key` under `namespace`, as a reader's `probe` chains them."""
        kb, hasher = self.index.key_nbytes, self.index.forest.hasher
        stop = (start + len(blocks)) * kb
        ids = hasher.split(hasher.chain(namespace, key[:stop], kb))
        self.writer.submit(bytes(namespace), ids, start, blocks)  # it copies what it takes

    def probe(self, namespace: BlockId, key: bytes, local: int) -> tuple[list[bytes], int]:
        """The ids of `key`'s whole blocks, and how many past the first `local` the cluster
        holds in a row (one round trip; none when `local` covers them all). No lock held."""
        kb = self.index.key_nbytes
        total = len(key) // kb
        if local >= total:
            return [], 0
        hasher = self.index.forest.hasher
        ids = [bytes(i) for i in hasher.split(hasher.chain(namespace, key[: total * kb], kb))]
        return ids, self.tier.probe(bytes(namespace), ids, local)

    def fill(self, namespace: BlockId, tenant: str, key: bytes, most: int | None = None) -> int:
        """Store locally the blocks of `key` past its cached prefix that the cluster holds
        (module doc), within its first `most` blocks (None: all); how many were stored.
        Without the cache's lock."""
        kb = self.index.key_nbytes
        with self._lock:
            match = self.index.match(namespace, key)
        local, below_disk = match.num_blocks, match.end.fastest_last() == DISK
        if most is not None and local >= most:
            return 0
        ids, run = self.probe(namespace, key, local)
        if most is not None:
            run = min(run, most - local)
        if not ids:
            return 0
        layout, seed = self.tier.layout, bytes(namespace)
        largest = max(1, FILL_CHUNK_BYTES // layout.block_bytes)
        pos, stop, step = local, local + run, min(self.tier.group_blocks, largest)
        served_any = refused = False
        filled = 0  # blocks this fill stored (or left pending on disk)
        while pos < stop:
            count = min(step, stop - pos)
            out = torch.empty((count, *layout.block_shape), dtype=layout.dtype)
            served = self.tier.read(seed, ids, pos, list(out.unbind(0)))
            good = served.index(False) if False in served else count
            if good == 0:
                break
            served_any = True
            end, stored, held = pos + good, 0, 0
            try:
                with self._lock:
                    stored = self._store_blocks(namespace, tenant, key[: end * kb], out[:good], pos)
                    if stored < good:  # the blocks a concurrent load or store put there count
                        held = self.index.match(namespace, key[: end * kb]).num_blocks
            except InvalidKVError:  # the cluster's bytes, refused here: a miss, not the call's
                refused = True
            filled += stored
            # blocks a concurrent load, prefetch or store of the prefix put in the index during
            # the round trip are there, not refused: the fill goes on past them (it stopped,
            # counted `fill_refused`, and the second of two loads of a prompt served its first
            # chunk only)
            pos = max(pos + stored, held)
            if pos < end:  # not taken whole: no room, or KV refused
                refused = True
                break
            if good < count or below_disk:  # the verified run ends; or the blocks land later,
                break  # on disk, and the next chunk cannot chain to them until they do
            step = min(2 * step, largest)
        self._count(
            fills=int(filled > 0),
            filled_blocks=filled,
            fill_misses=int(not served_any),
            fill_refused=int(refused),
        )
        return filled

    def status(self) -> dict[str, Any]:
        figures = self.tier.stats()
        figures.update(self.stats)
        figures.update({f"writer_{name}": value for name, value in self.writer.stats.items()})
        figures["writer_pending_bytes"] = self.writer.pending_bytes
        figures["writer_last_error"] = self.writer.last_error
        return figures

    def check(self) -> None:
        self.tier.check()
        self.writer.check()

    def drain(self, timeout_s: float) -> bool:
        return self.writer.drain(timeout_s)

    def close(self) -> None:
        self.writer.close()
        self.tier.cluster.close()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.stats[name] += delta
