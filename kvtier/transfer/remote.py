"""The store's link to the remote tier (issue 14): what it shares, and what it takes back.

- **Out** (`after_store`, called by the write path under the cache's lock, right after new
  blocks entered the index): their ids along the path (chained now, `Forest.ids_of`) and a host
  copy of their KV go to the `RemoteWriter`, which writes them behind the caller; a backlog past
  `tiers.remote.max_pending_bytes` is dropped and counted. Blocks stored below a prefix that
  lives only on disk go out too (`after_store_key`: their insert flight may enter the index
  after the call, so their ids are chained from the key, as a reader chains them). Blocks that
  came from the remote are not sent back.
- **In** (`fill`, called by `prefetch` and `load` before they take the lock): the blocks of the
  request past the local cached prefix that the cluster holds in a row are read (one round trip
  to probe, one to read), verified, and stored into the local tiers through the ordinary write
  path (`store_blocks`, the callback the store gives), as if computed here: placement, room,
  prefix closure and quotas are the write path's. Then the prefetch or load runs as usual and
  finds them. Only a verified leading run is stored: a block missing or failing verification
  ends it (the rest would break prefix closure). KV the local tiers refuse (a quantized host
  cannot keep a value past fp16's range, which the cluster holds plain) is not stored:
  `fill_refused`, and the prefetch or load serves the local prefix as if the cluster had none.

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
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.remote.writer import RemoteWriter

StoreBlocks = Callable[[BlockId, str, bytes, torch.Tensor, int], int]
"""`store_blocks(namespace, tenant, key, blocks, first)`: store the blocks of `key` from position
`first` on, `blocks` `[n, *block_shape]` (tokens from `first * block_tokens`), under the lock;
returns how many were stored."""


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
        copies = blocks.detach().to("cpu", copy=True)
        self.writer.submit(bytes(namespace), ids, start, list(copies.unbind(0)))

    def after_store_key(
        self, namespace: BlockId, key: bytes, start: int, blocks: torch.Tensor
    ) -> None:
        """As `after_store`, for new blocks start.. of `key` that are not in the index yet (a
        store below a disk-only prefix: its insert flight lands on disk, perhaps after the call):
        their ids chained from `key` under `namespace`, as a reader's `probe` chains them."""
        kb, hasher = self.index.key_nbytes, self.index.forest.hasher
        stop = (start + len(blocks)) * kb
        ids = hasher.split(hasher.chain(namespace, key[:stop], kb))
        copies = blocks.detach().to("cpu", copy=True)
        self.writer.submit(bytes(namespace), ids, start, list(copies.unbind(0)))

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

    def fill(self, namespace: BlockId, tenant: str, key: bytes) -> int:
        """Store locally the blocks of `key` past its cached prefix that the cluster holds
        (module doc); how many were stored. Without the cache's lock."""
        kb = self.index.key_nbytes
        with self._lock:
            local = self.index.lookup(namespace, key).num_blocks
        ids, run = self.probe(namespace, key, local)
        seed = bytes(namespace)
        if not ids:
            return 0
        if run == 0:
            self._count(fill_misses=1)
            return 0
        layout = self.tier.layout
        out = torch.empty((run, *layout.block_shape), dtype=layout.dtype)
        served = self.tier.read(seed, ids, local, list(out.unbind(0)))
        good = served.index(False) if False in served else run
        if good == 0:
            self._count(fill_misses=1)
            return 0
        try:
            with self._lock:
                stored = self._store_blocks(
                    namespace, tenant, key[: (local + good) * kb], out[:good], local
                )
        except InvalidKVError:  # the cluster's bytes, refused here: a miss, not the call's error
            self._count(fill_refused=1)
            return 0
        self._count(fills=1, filled_blocks=stored)
        return stored

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
