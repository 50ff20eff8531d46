"""A prefetch's remote fill stops within what its tenant could hold on gpu, over a real Redis
Cluster. A prefetch is all or nothing: before, a fill stored every block the host tier took, so
a node whose gpu tier holds 8 blocks made a 64-block cached prefix of a prompt it had only 0
blocks of, and the prefetch raised `CapacityError` where it would have leased the first 8. A
load (no gpu residency needed) still fills all it can.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

from typing import Any

import torch
from test_remote_audit3 import config, kv_for, node

BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # `config`'s layout: layers, K/V, tokens, heads, dim, fp16


def sized(cfg: dict[str, Any], gpu: int, host: int) -> dict[str, Any]:
    """`cfg` (same cluster and key prefix) with tiers of `gpu` and `host` blocks."""
    tiers = {
        **cfg["tiers"],
        "gpu": {"capacity": gpu * BLOCK_BYTES, "device": "cpu"},
        "host": {"capacity": host * BLOCK_BYTES, "pinned": False},
    }
    return {**cfg, "tiers": tiers}


def test_a_prefetch_fills_only_what_the_gpu_tier_could_lease(redis_nodes: list[str]) -> None:
    ca = config(redis_nodes)
    tokens = list(range(40_000, 40_256))  # 64 blocks of 4 tokens
    kv = kv_for(tokens, seed=21)
    with node(ca) as a, node(sized(ca, 8, 128)) as b:
        assert a.store(tokens, kv).stored_tokens == 256
        assert a.drain()
        lease = b.prefetch(tokens)
        assert lease.num_tokens == 32  # the first 8 blocks: what gpu holds
        got = b.load(tokens[:32])
        assert got.num_tokens == 32 and torch.equal(got.kv, kv[:, :, :32])
        assert b.status()["remote"]["filled_blocks"] == 8
        b.release(lease.lease_id)
        b.check()
        got = b.load(tokens)  # a load takes the rest: the host tier holds it
        assert got.num_tokens == 256 and torch.equal(got.kv, kv)
        assert b.status()["remote"]["filled_blocks"] == 64
        b.check()
