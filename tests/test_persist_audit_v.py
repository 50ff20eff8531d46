"""Audit V: `persist()` writes into the disk's free slots only; it never drops a cached block.

Pins:
- On a full disk, `persist()` writes nothing and counts every block without a disk copy in
  `left_blocks`: the disk-only blocks (the cache's only copy, durable already) are kept, the
  index keeps every block, the disk counts no eviction; a restart recovers the durable ones.
  Before, it evicted disk-only leaves to write memory blocks in their place: no durable block
  gained, cached blocks lost, and `left_blocks` 0.
- On a disk with fewer free slots than blocks to write, it fills the free slots, root-first
  (a restart finds no orphan), and leaves the rest in memory, counted in `left_blocks`.
- `POST /v1/admin/persist` (the same code) answers the same on a full disk.
Inline and background mover; real stores on CPU, a real disk tier under tmp_path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import DISK_MODEL, disk_config, kv_for
from starlette.testclient import TestClient

from kvtier.config import KVTierConfig, parse_config
from kvtier.service.app import create_app
from kvtier.store import KVStore

OpenStore = Callable[[KVTierConfig], KVStore]
BT = 4  # tokens per block of DISK_MODEL's configs
SLOT = 8192  # a disk slot of DISK_MODEL: 4 KiB header region + a 4 KiB block
ADMIN_KEY = "admin-key-0123456789"


def prompts(n: int) -> list[list[int]]:
    """`n` unrelated prompts of 2 blocks each."""
    return [list(range(1000 * i, 1000 * i + 2 * BT)) for i in range(n)]


def fill(store: KVStore, n: int) -> list[list[int]]:
    """Store `n` prompts of 2 blocks, oldest first, each settled before the next: with 4 gpu
    and 4 host slots, the last 4 blocks stay on gpu, the 4 before on host, the rest on disk."""
    stored = prompts(n)
    for i, prompt in enumerate(stored):
        store.store(prompt, kv_for(store, 2 * BT, seed=i))
        assert store.drain()
    return stored


def tiers(store: KVStore) -> dict[str, tuple[int, int, int]]:
    """Per tier: (blocks, free slots, evictions)."""
    st = store.status()["tiers"]
    return {t: (st[t]["blocks"], st[t]["free_slots"], st[t]["evictions"]) for t in st}


def where(store: KVStore, stored: list[list[int]]) -> list[tuple[int, int, int]]:
    """Per prompt: its blocks whose fastest copy is on gpu, host, disk."""
    found = [store.lookup(prompt) for prompt in stored]
    return [(f.gpu_tokens // BT, f.host_tokens // BT, f.disk_tokens // BT) for f in found]


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_persist_on_a_full_disk_drops_no_disk_only_block(
    tmp_path: Path, open_store: OpenStore, background: bool
) -> None:
    """16 blocks: 8 only on disk (full, 8 slots), 4 on host, 4 on gpu. Nothing written, 8
    left, nothing dropped; a restart recovers the 8 durable blocks."""
    config = disk_config(tmp_path / "disk", capacity=8 * SLOT, background=background)
    store = open_store(config)
    stored = fill(store, 8)
    before = [(0, 0, 2)] * 4 + [(0, 2, 0)] * 2 + [(2, 0, 0)] * 2
    assert where(store, stored) == before
    assert tiers(store) == {"gpu": (4, 0, 0), "host": (4, 0, 0), "disk": (8, 0, 0)}
    done = store.persist()
    assert repr(done) == "Persisted(0, left_blocks=8)"
    assert store.status()["index"]["blocks"] == 16  # was 8: it dropped the 8 disk-only blocks
    assert tiers(store) == {"gpu": (4, 0, 0), "host": (4, 0, 0), "disk": (8, 0, 0)}
    assert where(store, stored) == before
    store.close()
    again = open_store(config)
    assert again.status()["recovery"]["recovered"] == 8
    assert where(again, stored) == [(0, 0, 2)] * 4 + [(0, 0, 0)] * 4


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_persist_fills_the_free_slots_root_first_and_leaves_the_rest(
    tmp_path: Path, open_store: OpenStore, background: bool
) -> None:
    """12 blocks: 4 only on disk (4 of its 8 slots free), 4 on host, 4 on gpu. The 4 free
    slots take 4 blocks, whole prompts root-first (no orphan after a restart); 4 are left;
    the disk-only blocks stay."""
    config = disk_config(tmp_path / "disk", capacity=8 * SLOT, background=background)
    store = open_store(config)
    stored = fill(store, 6)
    before = [(0, 0, 2)] * 2 + [(0, 2, 0)] * 2 + [(2, 0, 0)] * 2
    assert where(store, stored) == before
    assert tiers(store) == {"gpu": (4, 0, 0), "host": (4, 0, 0), "disk": (4, 4, 0)}
    done = store.persist()
    assert repr(done) == "Persisted(4, left_blocks=4)"  # was Persisted(8, left_blocks=0)
    assert store.status()["index"]["blocks"] == 12
    assert tiers(store) == {"gpu": (4, 0, 0), "host": (4, 0, 0), "disk": (8, 0, 0)}
    assert where(store, stored) == before
    store.close()
    again = open_store(config)
    recovery = again.status()["recovery"]
    assert (recovery["recovered"], recovery["orphans"]) == (8, 0)
    served = where(again, stored)
    assert served[:2] == [(0, 0, 2)] * 2  # the disk-only prompts survived persist
    assert sum(d for _, _, d in served) == 8


def test_admin_persist_on_a_full_disk_drops_nothing(tmp_path: Path) -> None:
    raw: dict[str, Any] = {
        "model": DISK_MODEL,
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 4 * 4096, "device": "cpu"},
            "host": {"capacity": 4 * 4096, "pinned": False},
            "disk": {"capacity": 8 * SLOT, "path": str(tmp_path / "disk")},
        },
        "policy": {"write": "write_back", "disk_admission_hits": 0},
        "mover": {"background": False},
        "service": {"admin_key": ADMIN_KEY, "shared_memory": False},
    }
    config = parse_config(raw)
    stores: list[KVStore] = []

    def factory() -> KVStore:
        stores.append(KVStore(config))
        return stores[-1]

    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with TestClient(create_app(config, factory), base_url="http://127.0.0.1") as client:
        deadline = time.monotonic() + 10
        while not stores:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        store = stores[0]
        stored = fill(store, 8)
        assert tiers(store)["disk"] == (8, 0, 0)
        reply = client.post("/v1/admin/persist", headers=admin)
        while reply.status_code == 503 and time.monotonic() < deadline:  # still starting
            time.sleep(0.01)
            reply = client.post("/v1/admin/persist", headers=admin)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"persisted_blocks": 0, "left_blocks": 8}
        assert store.status()["index"]["blocks"] == 16
        assert where(store, stored)[:4] == [(0, 0, 2)] * 4
