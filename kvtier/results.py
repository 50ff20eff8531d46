"""The public result types of `KVStore` (and, later, of the sidecar client).

Token counts, not block counts: an engine thinks in tokens. Every count is a multiple of
`block_tokens`, because only whole blocks are cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class LookupResult(NamedTuple):
    """How many leading tokens are cached, split by the fastest tier holding each block.
    `gpu_tokens + host_tokens + disk_tokens == num_tokens`; the tiers come in that order along
    the prefix (whatever is on the GPU is a prefix of what is cached)."""

    num_tokens: int
    gpu_tokens: int
    host_tokens: int
    disk_tokens: int


class StoreResult(NamedTuple):
    """`stored_tokens` tokens were newly cached; `cached_tokens` of the sequence are cached now
    (the prefix that was already there plus the new blocks). `dropped_tokens` could not be
    placed in any tier (everything evictable was leased) and were not stored."""

    cached_tokens: int
    stored_tokens: int
    dropped_tokens: int


class LoadResult(NamedTuple):
    """The KV of the cached prefix: `kv` is `[num_layers, 2, num_tokens, num_kv_heads, head_dim]`
    (a new tensor; K at index 0, V at index 1)."""

    num_tokens: int
    kv: torch.Tensor


@dataclass(frozen=True)
class Lease:
    """A read lock on a prefix held on the `gpu` tier until released or `expires_at` (the
    store's clock). `block_table[i]` is the gpu slot of block i; while the lease lives, those
    slots hold exactly those blocks."""

    lease_id: int
    tenant: str
    num_tokens: int
    block_table: tuple[int, ...]
    expires_at: float
