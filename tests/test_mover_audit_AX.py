"""Audit AX: a store waits for the disk instead of dropping unwritten host blocks.

With a background mover, a store (or reservation) that host could take only by dropping blocks
not written to disk first waits, at most `mover.store_wait_s`, while host's least recently used
leaves are written down ahead (README, "The mover"). Two holes let it drop them with the disk
idle (`mover.backpressure_drops`):
- the check that host had room counted every host copy that has a disk copy as room, but
  room-making frees only the victims among them: a clean block that an unwritten one hangs
  below (an inner block of a prefix) counts for nothing, and the store went ahead;
- new blocks below a prefix that lives only on disk are staged in host slots
  (`insert_on_disk`), and that room was never written down ahead.
Every test stores one block at a time into tiers of a few blocks, host watermarks at 1.0 (no
watermark work of the mover's own), and a disk with room for everything: nothing may be lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvtier.config import parse_config
from kvtier.store import KVStore

BT = 4
LAYOUT = {"name": "ax", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16"}
BLOCK = 1 * 2 * BT * 1 * 8 * 2  # 64 bytes


def open_store(path: Path, write: str, gpu: int, host: int) -> KVStore:
    config: dict[str, Any] = {
        "model": LAYOUT,
        "block_tokens": BT,
        "tiers": {
            "gpu": {
                "capacity": gpu * BLOCK,
                "device": "cpu",
                "high_watermark": 1.0,
                "low_watermark": 1.0,
            },
            "host": {
                "capacity": host * BLOCK,
                "pinned": False,
                "high_watermark": 1.0,
                "low_watermark": 1.0,
            },
            "disk": {"capacity": "256KiB", "path": str(path)},
        },
        "mover": {"background": True, "store_wait_s": 5.0},
        "policy": {"write": write, "disk_admission_hits": 0},
    }
    return KVStore(parse_config(config))


def prompt(family: int, blocks: int) -> list[int]:
    return [1000 * family + j for j in range(blocks * BT)]


def kv(tokens: list[int]) -> torch.Tensor:
    """The KV of `tokens`: each token's values from its own id (a prefix's KV is the prefix of
    a longer prompt's)."""
    base = torch.tensor(tokens, dtype=torch.float32).remainder(1999)
    return (base.view(1, 1, -1, 1, 1) / 64 + torch.arange(8) / 8).expand(1, 2, -1, 1, 8).half()


def assert_whole(store: KVStore, tokens: list[int]) -> None:
    loaded = store.load(tokens)
    assert loaded.num_tokens == len(tokens), (tokens[0], loaded.num_tokens, store.status()["mover"])
    assert torch.equal(loaded.kv, kv(tokens))


def disk_only_prefix(store: KVStore, evict_others: bool) -> tuple[list[int], list[list[int]]]:
    """P (2 blocks) on disk only, then two 4-block prompts stored after it (moved off gpu when
    `evict_others`), the mover drained: (P, the others)."""
    p = prompt(1, 2)
    store.store(p, kv(p))
    assert store.evict("gpu", 2) == 2
    assert store.evict("host", 2) == 2  # written to disk in the call: P is disk-only
    others = [prompt(2 + i, 4) for i in range(2)]
    for tokens in others:
        store.store(tokens, kv(tokens))
        if evict_others:
            assert store.evict("gpu", 4) == 4
    assert store.drain(10)
    return p, others


def test_clean_inner_host_blocks_are_no_room_for_a_store(tmp_path: Path) -> None:
    """Host full: A's two blocks written to disk but with A's unwritten tail below them (no
    victims), and B. A 2-block store needs 2 host slots for its write_through copies; the
    room check counted A's clean inner blocks as those slots, the store did not wait, and two
    unwritten blocks were dropped with the disk idle."""
    with open_store(tmp_path, "write_through", gpu=8, host=8) as store:
        a = prompt(1, 2)
        store.store(a, kv(a))
        assert store.persist() == 2  # A durable on disk, its host copies clean
        assert store.evict("gpu", 2) == 2  # A now on host and disk
        tail = prompt(1, 4)  # A's two new blocks go where A is: host only, unwritten
        assert store.store(tail, kv(tail)).stored_tokens == 2 * BT
        b = prompt(2, 4)
        store.store(b, kv(b))
        assert store.evict("gpu", 4) == 4  # B on host only, unwritten: host is full
        assert store.drain(10)
        status = store.status()["tiers"]["host"]
        assert (status["free_slots"], status["dirty_blocks"]) == (0, 6)

        c = prompt(3, 2)
        assert store.store(c, kv(c)).stored_tokens == 2 * BT
        assert store.drain(10)
        store.check()
        assert store.status()["mover"]["backpressure_drops"] == 0
        for tokens in (tail, b, c):
            assert_whole(store, tokens)
        store.check()


def test_blocks_below_a_disk_only_prefix_get_their_staging_room_written_down(
    tmp_path: Path,
) -> None:
    """P lives only on disk, host is full of unwritten blocks. Storing P's 2-block tail stages
    it in 2 host slots; that room was made by dropping unwritten host blocks (the write-ahead
    skipped such stores), with the disk idle."""
    with open_store(tmp_path, "write_back", gpu=8, host=8) as store:
        p, others = disk_only_prefix(store, evict_others=True)
        hit = store.lookup(p)
        assert (hit.num_tokens, hit.disk_tokens) == (2 * BT, 2 * BT)
        status = store.status()["tiers"]["host"]
        assert (status["free_slots"], status["dirty_blocks"]) == (0, 8)

        longer = prompt(1, 4)
        result = store.store(longer, kv(longer))
        assert result.dropped_tokens == 0, result
        assert store.drain(10)
        store.check()
        assert store.status()["mover"]["backpressure_drops"] == 0
        for tokens in (longer, *others):
            assert_whole(store, tokens)
        store.check()
