"""The cached prefix a prefill reuses: leased pages it attends over, then gives back.

    prefix = open_prefix(cache, tokens)      # KVStore or Client; None when nothing is cached
    try:
        out = prefix.attend(layer, q, k, v)  # per layer: the prefix's pages + new tokens, causal
        kv = prefix.kv()                     # a copy of the prefix's KV, [L, 2, P, Hkv, D]
    finally:
        prefix.release()

Where the pages come from, by what the cache is:

    KVStore                 prefetch -> lease; `PagedAttention(store).extend` over the gpu pool
                            (checked: shapes, dtypes, and that the lease covers every slot read)
    Client, pools mapped    prefetch -> lease; the plain-torch extend kernel over the server's
                            gpu pool mapped in this process (same host: a CPU pool in /dev/shm);
                            the server holds the lease, so the slots keep their blocks
    Client, none mapped     `client.load` -> a local copy, attended as one page of P tokens

At most `len(tokens) - 1` tokens are reused: the last prompt token is always computed, since
its logits choose the first new token. q, k and v are cast to the pool's dtype for the kernel
and the output back to q's, so a bf16 pool serves an fp32 model (at bf16 precision).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.blocks import from_blocks
from kvtier.client import Client
from kvtier.kernels.attention import PagedAttention
from kvtier.kernels.reference import paged_extend_reference
from kvtier.results import Lease
from kvtier.store import KVStore

Cache = KVStore | Client
"""What an engine reuses prefixes from: the embedded store or the sidecar's client."""


class Prefix:
    """`num_tokens` cached tokens whose KV lies in pages: `buffer` `[slots, L, 2, bt, Hkv, D]`
    (a pool, or a local copy) at the slots `table`, in order. Valid until `release()`."""

    def __init__(
        self,
        buffer: torch.Tensor,
        table: Sequence[int],
        num_tokens: int,
        release: Callable[[], None],
    ) -> None:
        assert num_tokens > 0 and len(table) * buffer.shape[3] >= num_tokens
        self.buffer = buffer
        self.table = tuple(table)
        self.num_tokens = num_tokens
        self._release = release

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the T new tokens (q `[T, H, D]`, k and v `[T, Hkv, D]`, positions
        num_tokens ..) over the prefix and causally over themselves: `[T, H * D]` in q's dtype."""
        dtype = self.buffer.dtype
        out = self._extend(q.to(dtype), k.to(dtype).contiguous(), v.to(dtype).contiguous(), layer)
        return out.to(q.dtype).reshape(q.shape[0], -1)

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        table = torch.tensor([self.table], dtype=torch.int32)
        prefix = torch.tensor([self.num_tokens], dtype=torch.int32)
        new = torch.tensor([q.shape[0]], dtype=torch.int32)
        return paged_extend_reference(q, k, v, self.buffer, layer, table, prefix, new)

    def kv(self) -> torch.Tensor:
        """A new tensor `[L, 2, num_tokens, Hkv, D]` with the prefix's KV (pool dtype)."""
        return from_blocks(self.buffer[list(self.table)])[:, :, : self.num_tokens]

    def release(self) -> None:
        """Give the pages back (release the lease); the prefix must not be read after."""
        self._release()


class LeasedPrefix(Prefix):
    """A prefix leased from an embedded `KVStore`: attention goes through the checked
    `PagedAttention` (Triton under `TRITON_INTERPRET=1` or on CUDA, the torch reference else)."""

    def __init__(self, store: KVStore, lease: Lease) -> None:
        super().__init__(
            store.gpu_pool.buffer, lease.block_table, lease.num_tokens, lambda: store.release(lease)
        )
        self.lease = lease
        self.attention = PagedAttention(store)

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        return self.attention.extend(q, k, v, layer, [self.lease], [q.shape[0]])


def open_prefix(cache: Cache, tokens: Sequence[int], *, tenant: str = "default") -> Prefix | None:
    """The cached prefix of `tokens[:-1]`, held until its `release()`; None when none of it
    could be had (nothing cached, or evicted since a lookup; then nothing is held). Raises
    what the cache raises (`CapacityError` when the gpu tier cannot lease the prefix,
    `ServiceError` from the sidecar)."""
    reusable = list(tokens[:-1])
    if isinstance(cache, Client) and cache.pool_buffer("gpu") is None:
        return _loaded(cache, reusable, tenant)
    # a client's pages are those of the server mapped when the lease came, and a restart between
    # the lease and the pool (another thread re-mapping) would read the new server's slots
    instance = cache.mapped_instance if isinstance(cache, Client) else None
    lease = cache.prefetch(reusable, tenant=tenant)
    if lease.num_tokens == 0:  # evicted (or found corrupt) since the lookup
        cache.release(lease)
        return None
    if isinstance(cache, KVStore):
        return LeasedPrefix(cache, lease)
    pool = cache.pool_buffer("gpu")
    if pool is None or cache.mapped_instance != instance:  # re-mapped meanwhile: not its pages
        cache.release(lease)
        return _loaded(cache, reusable, tenant)
    return Prefix(pool, lease.block_table, lease.num_tokens, lambda: cache.release(lease))


def _loaded(cache: Client, tokens: list[int], tenant: str) -> Prefix | None:
    """The cached prefix of `tokens` copied out (`load`), for a client without the pool mapped."""
    loaded = cache.load(tokens, tenant=tenant)
    if loaded.num_tokens == 0:
        return None
    return Prefix(loaded.kv.unsqueeze(0), [0], loaded.num_tokens, lambda: None)
