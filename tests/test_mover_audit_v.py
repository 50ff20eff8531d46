"""Audit V: with the background mover, a store whose room host can make only by dropping
unwritten blocks has them written down to disk ahead of it, and waits for that, instead of
dropping them (`mover.backpressure_drops`) while the disk has room and takes every write.
Pinned here through a real store with a disk tier, each store followed by `drain()`:

- two tenants at their default floors (equal shares), host full of both at their floor: the
  write-ahead is made for the storing tenant (`Background.make_room_ahead(need, owner)`),
  taking the victims its own room-making takes (its own oldest blocks), including those that
  become host victims only once gpu room-making clears their gpu copies (`_write_behind`).
  Before, nothing was written ahead (watermark victims come only from tenants above their
  floor) and the tenant kept 1 of its 20 prompts, 76 blocks dropped with 14 disk slots free;
- one tenant and a full disk: what survives is the most recent prompts, LRU of leaves (before,
  28 blocks dropped and every third recent prompt lost while older ones survived).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import parse_config
from kvtier.store import KVStore

BT = 16


def open_store(path: Path, tenants: bool) -> KVStore:
    """gpu and host of 8 blocks, a disk of 32, every block admitted to disk."""
    config: dict[str, Any] = {
        "model": {"name": "bp", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32},
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": "64KiB", "device": "cpu"},
            "host": {"capacity": "64KiB", "pinned": False},
            "disk": {"capacity": "384KiB", "path": str(path)},
        },
        "mover": {"background": True},
        "policy": {"disk_admission_hits": 0},
    }
    config["model"]["dtype"] = "float16"
    if tenants:
        config["tenants"] = {"a": {}, "b": {}}
    return KVStore(parse_config(config))


def kv(n: int, seed: int) -> torch.Tensor:
    return torch.randn(2, 2, n, 2, 32, generator=torch.Generator().manual_seed(seed)).half()


def run(store: KVStore, first: str, second: str) -> list[list[int]]:
    """`first` stores twelve 2-block prompts, then `second` twenty 4-block ones, each call
    followed by `drain()`; `second`'s prompts."""
    for i in range(12):
        store.store([10000 * i + j for j in range(2 * BT)], kv(2 * BT, i), tenant=first)
        assert store.drain(10)
    prompts = [[777000 + 100 * i + j for j in range(4 * BT)] for i in range(20)]
    for i, prompt in enumerate(prompts):
        store.store(prompt, kv(4 * BT, 100 + i), tenant=second)
        assert store.drain(10)
    return prompts


@pytest.fixture
def stores() -> Any:
    made: list[KVStore] = []
    yield made
    for store in made:
        store.close()


def test_a_tenant_at_its_floor_has_its_blocks_written_down_not_dropped(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    store = open_store(tmp_path, tenants=True)
    stores.append(store)
    prompts = run(store, "a", "b")
    status = store.status()
    assert status["mover"]["backpressure_drops"] == 0
    assert status["tiers"]["disk"]["refused_writes"] == 0
    cached = [store.lookup(p, tenant="b").num_tokens // BT for p in prompts]
    # its disk floor (16) and its host floor (4) hold its last five prompts
    assert cached[-5:] == [4] * 5
    assert store.status("b")["tiers"]["disk"]["blocks"] >= 16


def test_one_tenant_keeps_its_most_recent_prompts_with_a_full_disk(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    store = open_store(tmp_path, tenants=False)
    stores.append(store)
    prompts = run(store, "default", "default")
    assert store.status()["mover"]["backpressure_drops"] == 0
    cached = [store.lookup(p).num_tokens // BT for p in prompts]
    assert cached[-8:] == [4] * 8  # 32 disk slots: the last eight prompts whole
    assert cached == sorted(cached)  # LRU of leaves: no older prompt outlives a newer one
