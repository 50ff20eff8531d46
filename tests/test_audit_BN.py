"""Audit BN: the write path's refusals and short room, as an engine author calls the store.

- A store below a disk-only prefix whose disk room-making ran and fell short (its check counted
  the disk copy of a block a lease holds on gpu, which no pass drops) dropped the blocks it had
  freed and stored none; now its first blocks take the slots it freed, as `Writes.place` does
  for gpu and host (`disk_route.insert_on_disk`). Random drives (a `/tmp` driver): 2 of 600
  before, 0 of 390 after.
- A reserve with a bad `release` was refused only after the throttle had written host blocks
  down to disk for it: a refused call moved blocks. Now `release` is checked first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, block_seq, salted_kv, tiny_block_bytes

from kvtier.config import parse_config
from kvtier.errors import InvalidArgumentError
from kvtier.store import KVStore

BT = TINY_BLOCK_TOKENS
DISK_SLOT = 8192  # a tiny block's disk slot: its 4 KiB header region and 4 KiB payload


def tiny(
    path: Path, disk_blocks: int, background: bool, host_blocks: int = 2, **policy: Any
) -> KVStore:
    """gpu of 2 slots, host of `host_blocks`, a disk of `disk_blocks`, one tenant."""
    bb = tiny_block_bytes()
    hold = {"high_watermark": 1.0, "low_watermark": 1.0}  # no write-down of its own
    config = {
        "model": {**TINY_MODEL, "dtype": "float32"},
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 2 * bb, "device": "cpu", **hold},
            "host": {"capacity": host_blocks * bb, "pinned": False, **hold},
            "disk": {"capacity": disk_blocks * DISK_SLOT, "path": str(path / "disk")},
        },
        "policy": {"write": "write_back", **policy},
        "mover": {"background": background},
    }
    return KVStore(parse_config(config))


def where(store: KVStore, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    return [tuple(store.lookup(tokens)) for tokens in prompts]


@pytest.mark.parametrize("background", [False, True])
def test_a_store_below_a_disk_prefix_keeps_the_disk_room_it_made(
    tmp_path: Path, background: bool
) -> None:
    store = tiny(tmp_path, 4, background, host_blocks=4, disk_admission_hits=0)
    leased, prefix, older, oldest = (block_seq(b, 1) for b in (1, 2, 3, 4))
    for tokens in (leased, prefix, older, oldest):  # each one down to disk only
        store.store(tokens, salted_kv(store, tokens, 0.5))
        assert store.drain(5)
        store.evict("gpu", 2)
        store.evict("host", 4)
    lease = store.prefetch(leased)  # on gpu, its disk copy kept: counted, never a victim
    store.check()
    assert store.status()["tiers"]["disk"]["free_slots"] == 0
    tokens = prefix + block_seq(10, 3)  # 3 new blocks below a disk-only prefix
    result = store.store(tokens, salted_kv(store, tokens, 0.5))
    store.check()
    # the two older prompts went for room: their slots hold the first two new blocks
    assert where(store, [older, oldest]) == [(0, 0, 0, 0, 0)] * 2
    done = result.pending_tokens if background else result.stored_tokens  # (staged in host)
    assert (done, result.dropped_tokens) == (2 * BT, BT)  # before: 0 and 3 blocks
    assert store.drain(5)
    loaded = store.load(tokens)
    assert loaded.num_tokens == 3 * BT
    assert torch.equal(loaded.kv, salted_kv(store, tokens, 0.5)[:, :, : 3 * BT])
    store.release(lease)
    store.check()
    store.close()


@pytest.mark.parametrize("release", ["bad", [1.5], (None,)])
def test_a_reserve_refused_for_its_release_moves_nothing(tmp_path: Path, release: Any) -> None:
    store = tiny(tmp_path, disk_blocks=16, background=True)
    prompts = [block_seq(10 * i + 1, 2) for i in range(3)]
    for tokens in prompts:  # gpu holds the last, host the one before it (unwritten)
        store.store(tokens, salted_kv(store, tokens, 0.5))
        assert store.drain(5)
    before = where(store, prompts)
    assert before[1] == (2 * BT, 0, 2 * BT, 0, 0)  # host full, its blocks without a disk copy
    with pytest.raises(InvalidArgumentError, match="release"):
        store.reserve(block_seq(100, 2), release=release)
    assert store.drain(5)
    store.check()
    assert where(store, prompts) == before  # before: the host blocks written down to disk
    store.close()
