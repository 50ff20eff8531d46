"""Audit AD: the background mover's own watermark demotion never drops a block that the disk
could keep.

gpu's watermark demotion copies its LRU leaves to host; when host has no free slot, room is
made there. That room-making is the mover's own work, not a call that needs room now: a host
leaf that needs a disk write must wait for host's own watermark demotion to write it down (a
flight), not be dropped (`mover.backpressure_drops`). Before, with `mover.store_wait_s: 0` (no
write-ahead by the stores), six 2-block prompts stored one after the other, each followed by
`drain()`, into gpu and host of 4 blocks lost 3 blocks (two prompts) with 12 of 16 disk slots
free; with the default wait the same loss came at random, from the mover thread racing the
stores (2-4 blocks of 28 lost with an idle disk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import parse_config
from kvtier.errors import ConfigError
from kvtier.store import KVStore

BT = 4
LAYOUT = {"name": "ad", "num_layers": 1, "num_kv_heads": 1, "head_dim": 6, "dtype": "float16"}
BLOCK = 1 * 2 * BT * 1 * 6 * 2  # 48 bytes


def open_store(path: Path) -> KVStore:
    """gpu of 4 blocks demoted down to 2 (watermarks 0.5), host of 4, a disk of 16, write_back,
    every block admitted to disk, stores that never wait for the disk."""
    config: dict[str, Any] = {
        "model": LAYOUT,
        "block_tokens": BT,
        "tiers": {
            "gpu": {
                "capacity": 4 * BLOCK,
                "device": "cpu",
                "high_watermark": 0.5,
                "low_watermark": 0.5,
            },
            "host": {"capacity": 4 * BLOCK, "pinned": False},
            "disk": {"capacity": "128KiB", "path": str(path)},
        },
        "mover": {"background": True, "store_wait_s": 0},
        "policy": {"write": "write_back", "disk_admission_hits": 0},
    }
    return KVStore(parse_config(config))


def kv(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 1, 6, generator=gen).half()


def test_watermark_demotion_writes_host_down_instead_of_dropping(tmp_path: Path) -> None:
    prompts = [[1000 * i + j for j in range(2 * BT)] for i in range(6)]
    with open_store(tmp_path) as store:
        for i, prompt in enumerate(prompts):
            result = store.store(prompt, kv(2 * BT, i))
            assert result.stored_tokens == 2 * BT  # gpu had room: the store made none
            assert store.drain(10)
            store.check()
        status = store.status()
        assert status["mover"]["backpressure_drops"] == 0
        assert status["tiers"]["disk"]["free_slots"] > 0
        for i, prompt in enumerate(prompts):  # every prompt whole, bit-exact
            loaded = store.load(prompt)
            assert loaded.num_tokens == 2 * BT, (i, [store.lookup(p).num_tokens for p in prompts])
            assert torch.equal(loaded.kv, kv(2 * BT, i))
        store.check()


def test_evict_writes_down_to_disk_with_the_background_mover(tmp_path: Path) -> None:
    """`evict(tier, n)` demotes a tier's LRU leaves now. With the background mover (the default)
    its host leaves that lacked a disk copy were dropped (`backpressure_drops`), the disk left
    empty; with the inline mover the same calls moved them to disk. Now both write them down."""
    config: dict[str, Any] = {
        "model": LAYOUT,
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 10 * BLOCK, "device": "cpu"},
            "host": {"capacity": 10 * BLOCK, "pinned": False},
            "disk": {"capacity": "128KiB", "path": str(tmp_path)},
        },
        "mover": {"background": True},
        "policy": {"write": "write_back", "disk_admission_hits": 0},
    }
    prompts = [[1000 * i + j for j in range(2 * BT)] for i in range(3)]
    with KVStore(parse_config(config)) as store:
        for i, prompt in enumerate(prompts):
            store.store(prompt, kv(2 * BT, i))
        assert store.drain(5)
        assert store.evict("gpu", 10) > 0 and store.evict("host", 10) > 0
        store.check()
        status = store.status()
        assert status["mover"]["backpressure_drops"] == 0
        blocks = {name: tier["blocks"] for name, tier in status["tiers"].items()}
        assert blocks == {"gpu": 0, "host": 0, "disk": 6}
        for i, prompt in enumerate(prompts):
            loaded = store.load(prompt)
            assert loaded.num_tokens == 2 * BT and torch.equal(loaded.kv, kv(2 * BT, i))
        store.check()


def test_more_tenants_than_gpu_slots_is_refused_at_start() -> None:
    """An equal split of a 2-slot gpu among 3 tenants is 0 blocks each: every prefetch, load
    lease and reservation of every tenant would be a QuotaError. It started without a word."""
    config: dict[str, Any] = {
        "model": LAYOUT,
        "block_tokens": BT,
        "tiers": {"gpu": {"capacity": 2 * BLOCK, "device": "cpu"}, "host": None, "disk": None},
        "tenants": {"a": {}, "b": {}, "c": {}},
    }
    with pytest.raises(ConfigError, match="2 slots // 3 tenants = 0 blocks") as refused:
        KVStore(parse_config(config)).close()
    assert refused.value.field == "tenants.a.quota.gpu"
    config["tenants"] = {name: {"quota": {"gpu": 0.5}} for name in "abc"}  # given: 1 block each
    with KVStore(parse_config(config)) as store:
        lease = store.prefetch(list(range(BT)), tenant="c", wait=False)
        store.release(lease)
        store.check()
    config["tenants"] = {"a": {}, "b": {}, "c": {}}  # a host split of 0 refuses nothing needed
    config["tiers"] = {"gpu": {"capacity": 6 * BLOCK, "device": "cpu"},
                       "host": {"capacity": 2 * BLOCK, "pinned": False}, "disk": None}  # fmt: skip
    with KVStore(parse_config(config)) as store:
        for i, name in enumerate("abc"):
            store.store(list(range(BT)), kv(BT, i), tenant=name)
            assert torch.equal(store.load(list(range(BT)), tenant=name).kv, kv(BT, i))
            store.release(store.prefetch(list(range(BT)), tenant=name))
        store.check()
