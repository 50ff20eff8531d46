"""Shared test helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvtier.config import parse_config
from kvtier.layout import KVLayout
from kvtier.results import Lease
from kvtier.store import KVStore

# ---- KVStore factory (tests/test_store*.py) ---------------------------------------------------
#
# A tiny layout: 2 layers, 2 kv heads, head_dim 4, 4 tokens per block. Capacities are given in
# whole blocks; watermarks default to 1.0/1.0 so that nothing moves unless a tier is full.

TINY_MODEL = {"name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4}
TINY_BLOCK_TOKENS = 4


def tiny_block_bytes(dtype: str = "float32") -> int:
    """Bytes of one block of the tiny layout in `dtype`."""
    layout = KVLayout(
        "tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype_name=dtype, block_tokens=4
    )
    return layout.block_bytes


def build_store(
    *,
    gpu_blocks: int = 8,
    host_blocks: int = 16,
    write: str = "write_through",
    dtype: str = "float32",
    tenants: tuple[str, ...] = ("default",),
    clock: Callable[[], float] | None = None,
    selective_hits: int = 2,
    lease_ttl_s: float = 60.0,
    gpu_watermarks: tuple[float, float] = (1.0, 1.0),
    host_watermarks: tuple[float, float] = (1.0, 1.0),
) -> KVStore:
    """A `KVStore` over the tiny layout with `gpu_blocks` and `host_blocks` slots on the CPU."""
    block_bytes = tiny_block_bytes(dtype)
    config = parse_config(
        {
            "model": {**TINY_MODEL, "dtype": dtype},
            "block_tokens": TINY_BLOCK_TOKENS,
            "tiers": {
                "gpu": {
                    "capacity": gpu_blocks * block_bytes,
                    "high_watermark": gpu_watermarks[0],
                    "low_watermark": gpu_watermarks[1],
                    "device": "cpu",
                },
                "host": {
                    "capacity": host_blocks * block_bytes,
                    "high_watermark": host_watermarks[0],
                    "low_watermark": host_watermarks[1],
                    "pinned": False,
                },
            },
            "policy": {
                "write": write,
                "selective_hits": selective_hits,
                "lease_ttl_s": lease_ttl_s,
            },
            "tenants": {tenant: {} for tenant in tenants},
        }
    )
    if clock is None:
        return KVStore(config)
    return KVStore(config, clock=clock)


@pytest.fixture
def make_store() -> Iterator[Callable[..., KVStore]]:
    """`make_store(gpu_blocks=..., host_blocks=..., write=..., dtype=..., tenants=..., clock=...)`
    builds a tiny store (see `build_store`); every store built is closed after the test."""
    stores: list[KVStore] = []

    def factory(**kwargs: Any) -> KVStore:
        store = build_store(**kwargs)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


def kv_for(store: KVStore, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """Random KV `[num_layers, 2, n_tokens, num_kv_heads, head_dim]` in the store's dtype."""
    layout = store.layout
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, n_tokens, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=gen).to(layout.dtype)


def leased_kv(store: KVStore, lease: Lease) -> torch.Tensor:
    """What the gpu slots of `lease` hold, as `[num_layers, 2, num_tokens, heads, head_dim]`."""
    blocks = store.gpu_pool.buffer[list(lease.block_table)]
    n, layers, two, bt, heads, dim = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * bt, heads, dim)


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as same-width integers, so that equality is bit equality (NaN, -0.0 too)."""
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return t.view(view[t.dtype])


# ---- end of the KVStore factory ---------------------------------------------------------------
