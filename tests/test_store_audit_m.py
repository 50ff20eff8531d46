"""Audit M, the store's side: persist's honesty, tenant sizes in slot bytes.

Pins:
- `persist()` on a disk with fewer slots than the cache has blocks says what it left without a
  durable copy (`Persisted.left_blocks`, still an int of the blocks written), and a restart
  serves exactly the blocks it said were durable; `POST /v1/admin/persist` answers
  `{persisted_blocks, left_blocks}`.
- Tenant quotas and floors given as sizes count the tier's own slot bytes: a disk slot (4 KiB
  header + payload) and an int8 host slot (a payload), not the raw block size.
Real stores on CPU, a real disk tier under tmp_path; no Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import DISK_MODEL, disk_config, kv_for
from starlette.testclient import TestClient

from kvtier.config import KVTierConfig, parse_config
from kvtier.service.app import create_app
from kvtier.store import KVStore

OpenStore = Callable[[KVTierConfig], KVStore]
BT = 4  # tokens per block of DISK_MODEL's configs
SLOT = 8192  # a disk slot of DISK_MODEL: 4 KiB header region + a 4 KiB block
ADMIN_KEY = "admin-key-0123456789"


def seq(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BT))


def quantized_config(
    path: Path, tenants: dict[str, Any], write: str = "write_back"
) -> KVTierConfig:
    """DISK_MODEL (4 KiB blocks) on a cpu gpu tier of 8 blocks, an int8 host of 32 KiB and a
    disk of 20 slots (160 KiB)."""
    return parse_config(
        {
            "model": DISK_MODEL,
            "block_tokens": BT,
            "tiers": {
                "gpu": {"capacity": 8 * 4096, "device": "cpu"},
                "host": {"capacity": "32KiB", "codec": "int8", "pinned": False},
                "disk": {"capacity": 20 * SLOT, "path": str(path)},
            },
            "policy": {"write": write},
            "tenants": tenants,
        }
    )


# ---- persist: what is left without a durable copy ----------------------------------------------


def test_persist_on_a_small_disk_says_what_it_left_and_a_restart_shows_it(
    tmp_path: Path, open_store: OpenStore
) -> None:
    """8 cached blocks (4 on gpu, 4 on host), a disk of 4 slots: 4 written, 4 left."""
    config = disk_config(tmp_path / "disk", capacity=4 * SLOT, gpu_blocks=4, host_blocks=4)
    store = open_store(config)
    prompts = [seq(0, 4), seq(1000, 4)]
    for i, prompt in enumerate(prompts):
        store.store(prompt, kv_for(store, 4 * BT, seed=i))
    done = store.persist()
    assert done == 4 and done.left_blocks == 4  # an int as before, and what it left
    assert repr(done) == "Persisted(4, left_blocks=4)"
    store.close()
    again = open_store(config)
    served = sum(again.lookup(prompt).num_tokens for prompt in prompts)
    assert served == (8 - done.left_blocks) * BT


def test_persist_with_room_for_everything_leaves_nothing(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(disk_config(tmp_path / "disk", capacity=16 * SLOT))
    store.store(seq(0, 4), kv_for(store, 4 * BT))
    store.store(seq(1000, 2), kv_for(store, 2 * BT, seed=1))
    done = store.persist()
    assert (int(done), done.left_blocks) == (6, 0)
    assert (int(store.persist()), store.persist().left_blocks) == (0, 0)  # all durable already


def test_admin_persist_replies_left_blocks(tmp_path: Path) -> None:
    raw = {
        "model": DISK_MODEL,
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 4 * 4096, "device": "cpu"},
            "host": {"capacity": 4 * 4096, "pinned": False},
            "disk": {"capacity": 4 * SLOT, "path": str(tmp_path / "disk")},
        },
        "policy": {"write": "write_back"},
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
        for i in range(2):
            store.store(seq(1000 * i, 4), kv_for(store, 4 * BT, seed=i))
        reply = client.post("/v1/admin/persist", headers=admin)
        while reply.status_code == 503 and time.monotonic() < deadline:  # still starting
            time.sleep(0.01)
            reply = client.post("/v1/admin/persist", headers=admin)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"persisted_blocks": 4, "left_blocks": 4}


# ---- tenant sizes count the tier's slot bytes --------------------------------------------------


def test_a_disk_floor_as_a_size_counts_disk_slots_with_their_header(
    tmp_path: Path, open_store: OpenStore
) -> None:
    """96 KiB of a 160 KiB disk of 8 KiB slots is 12 slots (not 24 blocks of 4 KiB, which
    would not fit in 20 slots and was refused)."""
    tenants = {"a": {"floor": {"disk": "96KiB"}}, "b": {"floor": {"disk": "16KiB"}}}
    store = open_store(quantized_config(tmp_path / "disk", tenants))
    disk = store.status()["tiers"]["disk"]
    assert (disk["slots"], disk["slot_bytes"]) == (20, SLOT)
    assert store.status(tenant="a")["tiers"]["disk"]["floor_blocks"] == 12
    assert store.status(tenant="b")["tiers"]["disk"]["floor_blocks"] == 2


def test_a_host_quota_as_a_size_counts_int8_payload_slots(
    tmp_path: Path, open_store: OpenStore
) -> None:
    tenants = {"a": {"quota": {"host": "10KiB"}, "floor": {"host": "4KiB"}}, "b": {}}
    store = open_store(quantized_config(tmp_path / "disk", tenants))
    host = store.status()["tiers"]["host"]
    slot = host["slot_bytes"]
    assert slot < 4096  # a payload, smaller than the block
    mine = store.status(tenant="a")["tiers"]["host"]
    assert mine["quota_blocks"] == 10 * 1024 // slot > 10 * 1024 // 4096
    assert mine["floor_blocks"] == 4 * 1024 // slot
