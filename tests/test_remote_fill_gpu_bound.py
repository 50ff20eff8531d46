"""A prefetch's remote fill stops within what its tenant could hold on gpu, over a real Redis
Cluster. A prefetch is all or nothing: before, a fill stored every block the host tier took, so
a node whose gpu tier holds 8 blocks made a 64-block cached prefix of a prompt it had only 0
blocks of, and the prefetch raised `CapacityError` where it would have leased the first 8. A
load (no gpu residency needed) still fills all it can.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_remote_audit3 import config, kv_for, node

from kvtier import KVStore
from kvtier.errors import QuotaError

BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # `config`'s layout: layers, K/V, tokens, heads, dim, fp16


def sized(cfg: dict[str, Any], gpu: int, host: int) -> dict[str, Any]:
    """`cfg` (same cluster and key prefix) with tiers of `gpu` and `host` blocks."""
    tiers = {
        **cfg["tiers"],
        "gpu": {"capacity": gpu * BLOCK_BYTES, "device": "cpu"},
        "host": {"capacity": host * BLOCK_BYTES, "pinned": False},
    }
    return {**cfg, "tiers": tiers}


def shared(a: KVStore, tokens: list[int], kv: torch.Tensor) -> None:
    """`a` stores `tokens`' KV whole and writes it to the cluster (checked)."""
    assert a.store(tokens, kv).stored_tokens == len(tokens)
    assert a.drain()


def test_a_prefetch_fills_only_what_the_gpu_tier_could_lease(redis_nodes: list[str]) -> None:
    ca = config(redis_nodes)
    tokens = list(range(40_000, 40_256))  # 64 blocks of 4 tokens
    kv = kv_for(tokens, seed=21)
    with node(ca) as a, node(sized(ca, 8, 128)) as b:
        shared(a, tokens, kv)
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


def test_a_prefetch_refused_for_its_lease_quota_fills_nothing(redis_nodes: list[str]) -> None:
    ca = config(redis_nodes)
    tokens, other = list(range(41_000, 41_032)), list(range(42_000, 42_016))
    kv = kv_for(tokens, seed=22)
    cb = {**sized(ca, 64, 128), "tenants": {"default": {"quota": {"leases": 1}}}}
    with node(ca) as a, node(cb) as b:
        shared(a, tokens, kv)
        assert b.store(other, kv_for(other, seed=23)).stored_tokens == 16
        held = b.prefetch(other)  # the one lease the quota allows
        with pytest.raises(QuotaError, match=r"quota\.leases"):
            b.prefetch(tokens)
        assert b.status()["remote"]["filled_blocks"] == 0  # a refused call changes nothing
        assert b.lookup(tokens).num_tokens - b.lookup(tokens).remote_tokens == 0
        b.release(held.lease_id)
        lease = b.prefetch(tokens)
        assert lease.num_tokens == 32 and b.status()["remote"]["filled_blocks"] == 8
        b.release(lease.lease_id)
        b.check()


def test_a_prefetch_fills_only_what_its_gpu_quota_leaves(redis_nodes: list[str]) -> None:
    ca = config(redis_nodes)
    tokens, other = list(range(43_000, 43_256)), list(range(44_000, 44_016))
    kv = kv_for(tokens, seed=24)
    cb = {**sized(ca, 64, 128), "tenants": {"default": {"quota": {"gpu": 12 * BLOCK_BYTES}}}}
    with node(ca) as a, node(cb) as b:
        shared(a, tokens, kv)
        assert b.store(other, kv_for(other, seed=25)).stored_tokens == 16
        held = b.prefetch(other)  # 4 of its 12 gpu blocks held
        lease = b.prefetch(tokens)
        assert lease.num_tokens == 32  # 8 blocks: what the quota leaves
        got = b.load(tokens[:32])
        assert got.num_tokens == 32 and torch.equal(got.kv, kv[:, :, :32])
        b.release(lease.lease_id)
        b.release(held.lease_id)
        b.check()


# ---- the bound counts what the prefetch holds and releases, and what others lock ----------------


def test_a_prefetch_extending_a_prefix_its_leases_hold_fills_to_its_quota(
    redis_nodes: list[str],
) -> None:
    ca = config(redis_nodes)
    tokens = list(range(50_000, 50_256))  # 64 blocks
    kv = kv_for(tokens, seed=31)
    cb = {**sized(ca, 64, 128), "tenants": {"default": {"quota": {"gpu": 12 * BLOCK_BYTES}}}}
    with node(ca) as a, node(cb) as b:
        shared(a, tokens, kv)
        first = b.prefetch(tokens[:32])  # 8 blocks held on gpu
        assert first.num_tokens == 32
        second = b.prefetch(tokens[:64])  # its own 8 cost nothing more: 4 new fit the 12
        assert second.num_tokens == 48
        got = b.load(tokens[:48])
        assert got.num_tokens == 48 and torch.equal(got.kv, kv[:, :, :48])
        b.release(first.lease_id)
        b.release(second.lease_id)
        b.check()


def test_a_prefetch_fills_no_further_than_the_slots_other_leases_leave(
    redis_nodes: list[str],
) -> None:
    ca = config(redis_nodes)
    tokens, other = list(range(52_000, 52_256)), list(range(53_000, 53_016))
    kv = kv_for(tokens, seed=33)
    with node(ca) as a, node(sized(ca, 8, 128)) as b:
        shared(a, tokens, kv)
        assert b.store(other, kv_for(other, seed=34)).stored_tokens == 16
        held = b.prefetch(other)  # 4 of 8 gpu slots leased
        lease = b.prefetch(tokens)  # before: filled 8, then CapacityError
        assert lease.num_tokens == 16
        b.release(lease.lease_id)
        b.release(held.lease_id)
        b.check()


@pytest.mark.parametrize("quota", ["leases", "gpu"])
def test_a_prefetch_releasing_what_its_quota_holds_fills_past_it(
    redis_nodes: list[str], quota: str
) -> None:
    ca = config(redis_nodes)
    tokens, other = list(range(54_000, 54_032)), list(range(55_000, 55_032))
    kv = kv_for(tokens, seed=35)
    limit = {"leases": 1} if quota == "leases" else {"gpu": 8 * BLOCK_BYTES}
    cb = {**sized(ca, 64, 128), "tenants": {"default": {"quota": limit}}}
    with node(ca) as a, node(cb) as b:
        shared(a, tokens, kv)
        assert b.store(other, kv_for(other, seed=36)).stored_tokens == 32
        held = b.prefetch(other)  # its one lease; 8 of 8 quota blocks
        lease = b.prefetch(tokens, release=[held.lease_id])  # released before the fill
        assert lease.num_tokens == 32 and b.status()["remote"]["filled_blocks"] == 8
        b.release(lease.lease_id)
        b.check()
