"""Audit BO: the background mover, demotion, prefetch and eviction under load.

What the audit found in its files, each a deterministic test here:
- A store of KV an int8 host tier cannot keep (a NaN), below a prefix that lives only on disk,
  with a background mover: the insert staged its blocks in host slots, and the host's refusal
  raised after the pin on the prefix and the staging slots were taken, so both leaked for good
  (`check()` failed: 2 host slots in use, 0 resident; the prefix could never be cleared).
- A store while gpu's watermark demotions were in the air, every gpu block pinned by them,
  dropped all its blocks at once instead of waiting (`mover.store_wait_s`) for them to land:
  30 4-block prompts into gpu 8 / host 8 over a 200 KB/s path kept 8 of 120 blocks, or 36 with
  `disk_admission_hits` 1, in some runs (120 of 120 in others: a race with the mover thread);
  now 120 of 120 (116-120 with admission 1) in every run (`Mover._landing`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import KVStore, parse_config
from kvtier.errors import InvalidKVError
from kvtier.transfer.threads import ThreadExecutor

BT = 4
BLOCK_BYTES = 1024  # 2 layers, K|V, 4 tokens, 2 heads, 16 dims, fp16


def config(disk: Path, host_codec: str = "none", background: bool = True) -> dict[str, Any]:
    return {
        "model": {
            "name": "bo",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 16,
            "dtype": "float16",
        },
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 4 * BLOCK_BYTES, "device": "cpu"},
            "host": {"capacity": 8 * BLOCK_BYTES, "pinned": False, "codec": host_codec},
            "disk": {"capacity": 16 * 8192, "path": str(disk)},
        },
        "policy": {"write": "write_through", "disk_admission_hits": 0},
        "mover": {"background": background},
    }


def kv(tokens: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, len(tokens), 2, 16), generator=gen).to(torch.float16)


def disk_only(store: KVStore, tokens: list[int]) -> None:
    """Store `tokens` and move them down until only their disk copies are left."""
    store.store(tokens, kv(tokens, 1))
    assert store.drain()
    store.evict("gpu", 8)
    store.evict("host", 8)
    assert store.drain()
    assert store.lookup(tokens).disk_tokens == len(tokens)
    store.check()


@pytest.mark.parametrize("background", [True, False])
def test_unkeepable_kv_below_a_disk_only_prefix_is_refused_holding_nothing(
    tmp_path: Path, background: bool
) -> None:
    store = KVStore(parse_config(config(tmp_path / "disk", "int8", background)))
    try:
        prefix = list(range(2 * BT))
        disk_only(store, prefix)
        tokens = prefix + list(range(100, 100 + 2 * BT))
        bad = kv(tokens, 2)
        bad[:, :, 2 * BT :] = float("nan")
        if background:  # staged in the int8 host: refused, as any store of such KV is
            with pytest.raises(InvalidKVError, match="cannot keep"):
                store.store(tokens, bad)
        else:  # written to disk from the caller's tensor (raw disk): kept as it is
            store.store(tokens, bad)
        assert store.drain()
        store.check()  # before the fix: host slots in use with nothing resident
        host = store.status()["tiers"]["host"]
        assert host["free_slots"] == host["slots"], host
        # the prefix is held by nothing: a clear drops it (before, a pin held it for good)
        store.clear()
        store.check()
        assert store.lookup(prefix).num_tokens == 0
        for pool in store.pools:
            assert pool.num_free == pool.num_slots, (pool.name, pool.num_free)
    finally:
        store.close()


def test_a_store_waits_for_gpu_demotions_in_the_air_rather_than_drop_its_blocks(
    tmp_path: Path,
) -> None:
    """gpu 8 slots, watermarks 0.7/0.4: two 4-block prompts fill it and the mover's watermark
    flights (5 blocks, down to host on a path of 10 KB/s: 0.5 s) pin every gpu block (a
    flight pins its node whole). A store of a third prompt then found no room and dropped all
    4 blocks at once, without waiting (`store_wait_s` 5 s), though the copies that free the
    room were a fraction of a second from landing: it now waits for them, and stores all."""
    cfg = config(tmp_path / "disk")
    cfg["tiers"]["gpu"] = {"capacity": 8 * BLOCK_BYTES, "device": "cpu"}
    for tier in ("gpu", "host"):
        cfg["tiers"][tier].update(high_watermark=0.7, low_watermark=0.4)
    cfg["policy"]["write"] = "write_back"
    cfg["mover"]["store_wait_s"] = 5.0
    store = KVStore(parse_config(cfg), executor=ThreadExecutor(throttle_bytes_per_s=10_000))
    try:
        prompts = [[p * 1000 + j for j in range(4 * BT)] for p in range(3)]
        for tokens in prompts[:2]:
            assert store.store(tokens, kv(tokens, 1)).stored_tokens == 4 * BT
        deadline = time.monotonic() + 5.0
        while not store.status()["mover"]["in_flight"]:  # the thread plans the flights
            assert time.monotonic() < deadline, "no watermark flight was planned"
            time.sleep(0.005)
        began = time.monotonic()  # a prompt cached whole needs no gpu room: no wait (review R1)
        assert store.store(prompts[0], kv(prompts[0], 1)).stored_tokens == 0
        assert time.monotonic() - began < 0.3 and store.status()["mover"]["in_flight"]
        result = store.store(prompts[2], kv(prompts[2], 1))
        assert result.stored_tokens == 4 * BT, result  # before: 0 stored, 16 tokens dropped
        assert store.drain()
        store.check()
        for tokens in prompts:
            loaded = store.load(tokens)
            assert loaded.num_tokens == 4 * BT
            assert torch.equal(loaded.kv, kv(tokens, 1))
    finally:
        store.close()
