"""Under write_through with a background mover, a store never drops unwritten host blocks to
make its host copies (audit AX's F5: 3-7 blocks lost in random mixes with an idle disk).

- `Writes.place` makes room for a store's host copies (spares of the blocks it puts on gpu)
  only from clean host blocks (a disk copy already); without such room the new blocks are
  gpu-only for now. Before, it dropped the host's unwritten leaves for them.
- `Mover.throttle` waits while flights hold host slots (gpu demotions landing there): once they
  land their blocks can be written down. Before, a store went ahead at once and its room-making
  dropped them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from test_mover_audit_AX import BLOCK, BT, LAYOUT, kv, prompt

from kvtier.config import parse_config
from kvtier.store import KVStore


def open_store(path: Path, gpu: int, host: int) -> KVStore:
    config: dict[str, Any] = {
        "model": LAYOUT,
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": gpu * BLOCK, "device": "cpu", "high_watermark": 1.0},
            "host": {"capacity": host * BLOCK, "pinned": False, "high_watermark": 1.0},
            "disk": {"capacity": "256KiB", "path": str(path)},
        },
        "mover": {"background": True, "store_wait_s": 5.0},
        "policy": {"write": "write_through", "disk_admission_hits": 0},
    }
    config["tiers"]["gpu"]["low_watermark"] = config["tiers"]["host"]["low_watermark"] = 1.0
    return KVStore(parse_config(config))


def drops(store: KVStore) -> int:
    dropped: int = store.status()["mover"]["backpressure_drops"]
    return dropped


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_mixes_drop_nothing_with_room_on_disk(tmp_path: Path, seed: int) -> None:
    """Gpu and host of 3 blocks, a disk with room for all, prompts of 1-3 blocks from 8
    families stored in a random order: every block ever stored still loads (the mover
    drained), none dropped. (A store may be refused whole when no tier can make room for it at
    that moment, leases of the mover's flights included: it says so, `dropped_tokens`.)"""
    rng = random.Random(seed)
    store = open_store(tmp_path, gpu=3, host=3)
    try:
        longest: dict[int, int] = {}
        for _ in range(100):
            family, blocks = rng.randrange(8), rng.randrange(1, 4)
            tokens = prompt(family, blocks)
            if store.store(tokens, kv(tokens)).dropped_tokens == 0:  # (one may find no room)
                longest[family] = max(longest.get(family, 0), blocks)
        assert store.drain()  # a tail below a disk-only prefix lands in a flight after the call
        store.check()
        assert drops(store) == 0  # before: 1-5 of them
        for family, blocks in longest.items():
            tokens = prompt(family, blocks)
            loaded = store.load(tokens)
            assert loaded.num_tokens == len(tokens), (family, json.dumps(store.status()))
            assert torch.equal(loaded.kv, kv(tokens))
        store.check()
    finally:
        store.close()
