"""Audit T: the background mover (`mover.background: true`, what `kvtier serve` runs) keeps the
policy the inline mover keeps. Pinned here, each through a real store and its mover thread,
waited on with `store.drain()` (it steps the mover itself until nothing is left to do):

- a store too big for every memory tier places nothing and so evicts nothing: the room written
  down ahead of it (`Writes.make_room_ahead`) is only what its blocks could use (it emptied
  host of every other block);
- a reservation refused for quota changes nothing: its room is not made ahead (it dropped and
  demoted the caller's own blocks first);
- watermark demotion stops at the low watermark and leaves every tenant its floor: a flight
  takes no more blocks than either allows (a node's whole run went in one flight);
- `lift_on_lookup` never lifts gpu past its low watermark, so the mover never demotes other
  blocks to undo a lift.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, kv_for, tiny_block_bytes

from kvtier.config import parse_config
from kvtier.errors import QuotaError
from kvtier.store import KVStore

BT = TINY_BLOCK_TOKENS
BLOCK = tiny_block_bytes()


def tokens(*blocks: int) -> list[int]:
    """One block of `BT` tokens per entry, each block's tokens drawn from its entry."""
    return [10 * b + j for b in blocks for j in range(BT)]


THREE = {name: {"quota": {"gpu": 0.5}} for name in "abc"}
"""Three tenants of a gpu quota of half a 2-slot gpu (one block) each; the other shares equal."""


def open_store(
    stores: list[KVStore],
    gpu: int,
    host: int,
    *,
    disk: Path | None = None,
    write: str = "write_through",
    watermarks: tuple[float, float] | None = None,
    **more: Any,
) -> KVStore:
    """A tiny float32 store with the background mover (closed after the test): `gpu` and
    `host` slots, a disk tier at `disk`, both memory tiers on `watermarks` (high, low)."""
    marks = {}
    if watermarks is not None:
        marks = {"high_watermark": watermarks[0], "low_watermark": watermarks[1]}
    tiers: dict[str, Any] = {
        "gpu": {"capacity": gpu * BLOCK, "device": "cpu", **marks},
        "host": {"capacity": host * BLOCK, "pinned": False, **marks},
    }
    if disk is not None:
        tiers["disk"] = {"capacity": 64 * 1024, "path": str(disk)}
    config = {
        "model": {**TINY_MODEL, "dtype": "float32"},
        "block_tokens": BT,
        "tiers": tiers,
        "policy": {"write": write},
        "mover": {"background": True, **more.pop("mover", {})},
        **more,
    }
    store = KVStore(parse_config(config))
    stores.append(store)
    return store


@pytest.fixture
def stores() -> Any:
    made: list[KVStore] = []
    yield made
    for store in made:
        store.close()


def blocks(store: KVStore, tenant: str = "default") -> dict[str, int]:
    """`tenant`'s blocks per tier once the mover is done."""
    assert store.drain(10)
    return {name: t["blocks"] for name, t in store.status(tenant)["tiers"].items()}


def test_a_store_too_big_for_every_memory_tier_evicts_nothing(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    store = open_store(stores, 2, 8, disk=tmp_path)
    for p in range(3):
        store.store(tokens(p, p), kv_for(store, 2 * BT))
    assert blocks(store)["host"] == 6
    result = store.store(tokens(*[5] * 9), kv_for(store, 9 * BT))  # 9 blocks: no tier holds them
    assert (result.stored_tokens, result.dropped_tokens) == (0, 9 * BT)
    assert blocks(store)["host"] == 6
    assert [store.lookup(tokens(p, p)).num_tokens for p in range(3)] == [2 * BT] * 3
    assert store.status()["tiers"]["host"]["evictions"] == 0
    store.check()


def test_a_reservation_refused_for_quota_changes_nothing(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    """Three tenants on gpu 2 (a gpu quota of 1 block each, given: an equal split is none),
    host 5 (a default share): a's host quota is 1 block."""
    store = open_store(stores, 2, 5, disk=tmp_path, watermarks=(0.6, 0.3), tenants=THREE)
    store.store(tokens(0, 0, 0), kv_for(store, 3 * BT), tenant="a")
    before, seen = blocks(store, "a"), store.lookup(tokens(0, 0, 0), tenant="a")
    assert before["host"] == 3 and seen.num_tokens == 3 * BT
    with pytest.raises(QuotaError, match="quota"):
        store.reserve(tokens(1, 0, 0), tenant="a")  # 3 new blocks, none fits a's quota
    assert blocks(store, "a") == before
    assert store.lookup(tokens(0, 0, 0), tenant="a") == seen
    host = store.status()["tiers"]["host"]
    assert (host["evictions"], host["demotions"]) == (0, 0)
    store.check()


def test_watermark_demotion_stops_at_the_low_watermark(stores: list[KVStore]) -> None:
    """gpu 10 slots, high 5 and low 2 blocks: a 7-block prompt leaves 2 on gpu, not 0."""
    store = open_store(stores, 10, 16, write="write_back", watermarks=(0.5, 0.2))
    store.store(tokens(*range(7)), kv_for(store, 7 * BT))
    assert blocks(store) == {"gpu": 2, "host": 5}
    assert store.lookup(tokens(*range(7))).gpu_tokens == 2 * BT  # the head stays up
    store.check()


def test_watermark_demotion_leaves_each_tenant_its_gpu_floor(stores: list[KVStore]) -> None:
    """gpu 10 slots (high 5, low 2 blocks), floors of 2 gpu blocks for a and b: 4 + 3 blocks
    pass the high watermark, and demotion may take only what is above the floors."""
    floors = {"floor": {"gpu": f"{2 * BLOCK}B"}}
    store = open_store(
        stores,
        10,
        16,
        write="write_back",
        watermarks=(0.5, 0.2),
        tenants={"a": floors, "b": floors},
    )
    store.store(tokens(*range(4)), kv_for(store, 4 * BT), tenant="a")
    store.store(tokens(*range(10, 13)), kv_for(store, 3 * BT), tenant="b")
    assert blocks(store, "a") == {"gpu": 2, "host": 2}
    assert blocks(store, "b") == {"gpu": 2, "host": 1}
    store.check()


def test_watermark_demotion_to_disk_leaves_a_tenant_its_host_floor(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    """write_through, gpu 2 / host 5 (high 3, low 1 block), three tenants (host floor 1): b's
    store of one block passes host's high watermark, and a keeps its floor there (its blocks,
    looked up once, are admitted to disk: copied down in a flight, not dropped)."""
    store = open_store(stores, 2, 5, disk=tmp_path, watermarks=(0.6, 0.3), tenants=THREE)
    store.store(tokens(0, 0, 0), kv_for(store, 3 * BT), tenant="a")
    assert store.lookup(tokens(0, 0, 0), tenant="a").host_tokens == 3 * BT
    assert blocks(store, "a")["host"] == 3
    store.store(tokens(0), kv_for(store, BT), tenant="b")
    status = store.status("a")["tiers"]["host"]
    assert blocks(store, "a")["host"] == status["floor_blocks"] == 1
    store.check()


def test_a_lift_stops_at_the_low_watermark_and_demotes_nothing(stores: list[KVStore]) -> None:
    """gpu 10 slots (high 6, low 5 blocks): B's 4 blocks on gpu, A's 4 on host only. A lookup
    of A lifts one block (gpu at its low watermark), and B keeps its 4 on gpu."""
    store = open_store(stores, 10, 16, watermarks=(0.6, 0.5), mover={"lift_on_lookup": True})
    a, b = tokens(*range(4)), tokens(*range(10, 14))
    store.store(a, kv_for(store, 4 * BT))
    assert store.drain(10) and store.evict("gpu", 4) == 4
    store.store(b, kv_for(store, 4 * BT, seed=1))
    assert blocks(store)["gpu"] == 4
    demotions = store.status()["tiers"]["gpu"]["demotions"]
    assert store.lookup(a).host_tokens == 4 * BT
    assert blocks(store)["gpu"] == 5
    assert store.status()["mover"]["lifted_blocks"] == 1
    assert store.status()["tiers"]["gpu"]["demotions"] == demotions
    assert store.lookup(b).gpu_tokens == 4 * BT
    assert store.lookup(a).gpu_tokens == BT  # the head of A came up
    store.check()
