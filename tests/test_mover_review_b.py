"""A reservation refused for quota because of its prefix pin has nothing written down for it.

A review found `make_room_ahead`'s quota check left out the blocks the reservation's prefix pin
locks on gpu, which `reserve` counts (its pin taken before `place`): a reservation refused for
that quota had already had one of its tenant's host blocks written down to disk. The check now
counts them, as `place` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, kv_for, tiny_block_bytes

from kvtier.config import parse_config
from kvtier.errors import QuotaError
from kvtier.store import KVStore

BT = TINY_BLOCK_TOKENS
BLOCK = tiny_block_bytes()
MARKS = {"high_watermark": 0.99, "low_watermark": 0.98}


def tokens(*blocks: int) -> list[int]:
    return [10 * block + j for block in blocks for j in range(BT)]


def tiers(store: KVStore) -> dict[str, tuple[int, int]]:
    assert store.drain(10)
    return {name: (t["blocks"], t["demotions"]) for name, t in store.status()["tiers"].items()}


def test_a_reservation_over_quota_with_its_prefix_pin_writes_nothing_down(tmp_path: Path) -> None:
    config = {
        "model": {**TINY_MODEL, "dtype": "float32"},
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 6 * BLOCK, "device": "cpu", **MARKS},
            "host": {"capacity": 5 * BLOCK, "pinned": False, **MARKS},
            "disk": {"capacity": 64 * 1024, "path": str(tmp_path / "disk")},
        },
        "policy": {"write": "write_through", "disk_admission_hits": 0},
        "mover": {"background": True},
        "tenants": {"a": {"quota": {"gpu": f"{3 * BLOCK}B"}}, "b": {}},
    }
    with KVStore(parse_config(config)) as store:
        store.store(tokens(7, 7, 7), kv_for(store, 3 * BT, seed=1), tenant="a")
        store.store(tokens(0, 0), kv_for(store, 2 * BT), tenant="a")
        tiers(store)
        store.evict("gpu", 3)
        before = tiers(store)
        hit = store.lookup(tokens(7, 7, 7), tenant="a")
        with pytest.raises(QuotaError):
            store.reserve(tokens(0, 0, 1, 1), tenant="a")  # its pin holds 2 of the 3
        assert tiers(store) == before
        assert store.lookup(tokens(7, 7, 7), tenant="a") == hit
        store.check()
