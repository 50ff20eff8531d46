"""A refused operation leaves the store exactly as it was (issue 12, point 2).

Every entry point that can be refused for room checks every tier it needs before anything
moves (`Demoter.room`). Each test builds a store where the refusal comes from one tier while
another tier could have made room, snapshots the whole cache (every index node with its slots
per tier, every pool's free slots, the leases, the per-tier event counters and the backpressure
drops), makes the refused call, and compares. Real pools, a real disk tier, the real mover.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import disk_config, hit, kv_for, tier

from kvtier.config import KVTierConfig
from kvtier.errors import CapacityError, NotWrittenError
from kvtier.results import StoreResult
from kvtier.store import KVStore

OpenStore = Callable[[KVTierConfig], KVStore]
BT = 4  # tokens per block of both tiny layouts


def seq(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BT))


def snapshot(store: KVStore) -> dict[str, Any]:
    """Everything a refused call must leave as it was."""
    store.drain()
    nodes = []
    for root in store.index.roots():
        stack = [root]
        while stack:
            node = stack.pop()
            ids = store.index.forest.ids_of(node)  # ids chained on first read are no change
            nodes.append((bytes(ids), tuple(tuple(slots) for slots in node.slots)))
            stack.extend(node.children.values() if node.children else ())
    status = store.status()
    return {
        "nodes": sorted(nodes),
        "free": [pool.num_free for pool in store.pools],
        "leases": sorted(lease.lease_id for lease in store.leases()),
        "events": {
            name: {k: v for k, v in figures.items() if k in ("demotions", "evictions", "blocks")}
            for name, figures in status["tiers"].items()
        },
        "backpressure_drops": status["mover"]["backpressure_drops"],
    }


def test_store_refused_everywhere_changes_nothing(make_store: Callable[..., KVStore]) -> None:
    store = make_store(gpu_blocks=4, host_blocks=4, write="write_back")
    held_gpu = store.reserve(seq(0, 4))  # reserved slots are never evictable
    held_host = store.reserve(seq(1000, 4))
    assert (held_gpu.tier, held_host.tier) == ("gpu", "host")
    store.check()
    before = snapshot(store)
    assert store.store(seq(5000, 2), kv_for(store, 2 * BT)) == StoreResult(0, 0, 2 * BT)
    store.check()
    assert snapshot(store) == before


def test_reserve_refused_changes_nothing(make_store: Callable[..., KVStore]) -> None:
    store = make_store(gpu_blocks=4, host_blocks=4, write="write_back")
    store.store(seq(0, 2), kv_for(store, 2 * BT))  # evictable blocks on gpu
    store.reserve(seq(1000, 2))
    store.reserve(seq(2000, 4))  # host, all of it
    before = snapshot(store)
    empty = store.reserve(seq(3000, 3))  # gpu could free 2 of 3, host none
    assert (empty.reservation_id, empty.num_tokens) == (0, 0)
    store.check()
    assert snapshot(store) == before


def test_prefetch_refused_for_room_changes_nothing(make_store: Callable[..., KVStore]) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8, write="write_back")
    store.store(seq(0, 3), kv_for(store, 3 * BT))
    lease = store.prefetch(seq(0, 3))  # 3 gpu slots locked
    store.store(seq(1000, 3), kv_for(store, 3 * BT, seed=1))  # 1 free gpu slot: to host
    assert store.lookup(seq(1000, 3)) == hit(host=3 * BT)
    before = snapshot(store)
    with pytest.raises(CapacityError, match="3 blocks must come up to gpu"):
        store.prefetch(seq(1000, 3))
    store.check()
    assert snapshot(store) == before
    store.release(lease)


def test_commit_refused_changes_nothing(make_store: Callable[..., KVStore]) -> None:
    store = make_store(gpu_blocks=4, host_blocks=4)
    reservation = store.reserve(seq(0, 2))
    before = snapshot(store)
    with pytest.raises(NotWrittenError):
        store.commit(reservation)
    store.check()
    assert snapshot(store) == before


@pytest.mark.parametrize("background", [True, False])
def test_store_below_a_disk_only_prefix_refused_by_disk_changes_nothing(
    tmp_path: Path, open_store: OpenStore, background: bool
) -> None:
    """The disk is full of the prefix itself (pinned by the insert): the host could make room
    for the staging slots, but must not, since the disk cannot take the blocks. Before the one
    room call, host made room first (dropping a block in the background) and then refused."""
    config = disk_config(tmp_path / "disk", capacity=4 * 8192, background=background)
    store = open_store(config)
    prefix = seq(0, 4)
    kv_prefix = kv_for(store, 4 * BT)
    store.store(prefix, kv_prefix)
    assert store.persist() == 4  # the disk is full: 4 slots
    assert store.evict("gpu", 4) == 4  # the prefix is on disk only now
    store.store(seq(1000, 4), kv_for(store, 4 * BT, seed=1))
    assert store.evict("gpu", 4) == 4  # to host, which is now full too
    assert store.lookup(seq(1000, 4)) == hit(host=4 * BT)
    assert store.lookup(prefix) == hit(disk=4 * BT)
    assert (tier(store, "host")["free_slots"], tier(store, "disk")["free_slots"]) == (0, 0)
    store.check()
    before = snapshot(store)
    longer = [*prefix, *range(50, 54)]
    kv = kv_for(store, 5 * BT, seed=2)
    kv[:, :, : 4 * BT] = kv_prefix
    assert store.store(longer, kv) == StoreResult(4 * BT, 0, BT)
    store.check()
    assert snapshot(store) == before
