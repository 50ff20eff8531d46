"""KVStore scenarios: tiny stores (4 tokens a block), exact slots, counts and bytes, bit-exact KV.

Every test calls `store.check()` after each step; `make_store` and `kv_for` are in conftest.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import bits, kv_for, leased_kv, tiny_block_bytes

from kvtier.errors import (
    CapacityError,
    ClosedError,
    LeaseError,
    UnknownTenantError,
)
from kvtier.results import LookupResult, StoreResult
from kvtier.store import KVStore

MakeStore = Callable[..., KVStore]
BLOCK_BYTES = tiny_block_bytes("float32")
WRITE_POLICIES = ("write_through", "write_back", "selective")


def seq(first: int, num_tokens: int) -> list[int]:
    """`num_tokens` consecutive token ids from `first`: sequences from far-apart `first`s share
    no block, so each is its own branch of the tree."""
    return list(range(first, first + num_tokens))


A, B, C, D = seq(0, 8), seq(100, 8), seq(200, 8), seq(300, 8)


def tier(store: KVStore, name: str) -> dict[str, int]:
    status: dict[str, int] = store.status()["tiers"][name]
    return status


def hit(gpu: int = 0, host: int = 0) -> LookupResult:
    return LookupResult(gpu + host, gpu, host, 0)


# ---- store ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("write", "host_blocks"), [("write_through", 3), ("write_back", 0)])
def test_store_three_blocks_fills_gpu_slots_0_1_2(
    make_store: MakeStore, write: str, host_blocks: int
) -> None:
    store = make_store(gpu_blocks=8, host_blocks=8, write=write)
    tokens = seq(0, 12)
    assert store.store(tokens, kv_for(store, 12)) == StoreResult(12, 12, 0)
    store.check()
    assert store.lookup(tokens) == hit(gpu=12)
    lease = store.prefetch(tokens)
    store.check()
    assert (lease.num_tokens, lease.block_table) == (12, (0, 1, 2))
    gpu, host = tier(store, "gpu"), tier(store, "host")
    assert (gpu["blocks"], gpu["used_bytes"], gpu["free_slots"]) == (3, 3 * BLOCK_BYTES, 5)
    assert (host["blocks"], host["used_bytes"]) == (host_blocks, host_blocks * BLOCK_BYTES)
    store.release(lease)
    store.check()


def test_a_cached_prefix_is_stored_once_and_only_new_blocks_are_added(
    make_store: MakeStore,
) -> None:
    store = make_store(gpu_blocks=8, host_blocks=8)
    kv = kv_for(store, 18)
    assert store.store(seq(0, 8), kv[:, :, :8]) == StoreResult(8, 8, 0)
    store.check()
    used = tier(store, "gpu")["used_bytes"]
    assert store.store(seq(0, 8), kv[:, :, :8]) == StoreResult(8, 0, 0)
    store.check()
    assert tier(store, "gpu")["used_bytes"] == used == 2 * BLOCK_BYTES
    assert store.store(seq(0, 4), kv[:, :, :4]) == StoreResult(4, 0, 0)  # a cached prefix of it
    store.check()
    assert store.store(seq(0, 16), kv[:, :, :16]) == StoreResult(16, 8, 0)  # 2 new blocks
    store.check()
    assert store.store(seq(0, 18), kv) == StoreResult(16, 0, 0)  # the partial block is ignored
    store.check()
    assert store.store(seq(500, 3), kv_for(store, 3)) == StoreResult(0, 0, 0)  # under a block
    store.check()
    gpu = tier(store, "gpu")
    assert (gpu["blocks"], gpu["used_bytes"]) == (4, 4 * BLOCK_BYTES)
    assert store.status()["index"]["blocks"] == 4
    assert store.lookup(seq(0, 18)) == hit(gpu=16)
    assert store.status()["ops"]["stored_tokens"] == 16
    assert torch.equal(store.load(seq(0, 18)).kv, kv[:, :, :16])
    store.check()


def test_a_sequence_grown_block_by_block_stays_one_node(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=8, host_blocks=8)
    kv = kv_for(store, 24)
    for n in range(4, 25, 4):
        assert store.store(seq(0, n), kv[:, :, :n]) == StoreResult(n, 4, 0)
        store.check()
    assert store.status()["index"]["nodes"] == 1  # path compression: no one-child chain
    assert torch.equal(store.load(seq(0, 24)).kv, kv)


def test_a_new_branch_shares_the_cached_trunk(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=8, host_blocks=8)
    trunk_kv = kv_for(store, 8, seed=1)
    store.store([*seq(0, 8), 50, 51, 52, 53], torch.cat([trunk_kv, kv_for(store, 4, 2)], 2))
    store.check()
    other = kv_for(store, 12, seed=3)
    assert store.store([*seq(0, 8), 60, 61, 62, 63], other) == StoreResult(12, 4, 0)
    store.check()
    assert tier(store, "gpu")["blocks"] == 4
    loaded = store.load([*seq(0, 8), 60, 61, 62, 63]).kv
    assert torch.equal(loaded[:, :, :8], trunk_kv)  # the trunk kept the first store's KV
    assert torch.equal(loaded[:, :, 8:], other[:, :, 8:])
    store.check()


# ---- load ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("evicted", "expected"),
    [(0, hit(gpu=16)), (4, hit(host=16)), (2, hit(gpu=8, host=8))],
    ids=["gpu", "host", "gpu+host"],
)
def test_load_is_bit_exact_from_every_tier(
    make_store: MakeStore, dtype: str, evicted: int, expected: LookupResult
) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8, dtype=dtype)
    tokens = seq(0, 16)
    kv = kv_for(store, 16, seed=7)
    store.store(tokens, kv)
    store.check()
    assert store.evict("gpu", evicted) == evicted
    store.check()
    assert store.lookup([*tokens, 1000, 1001]) == expected
    result = store.load([*tokens, 1000, 1001])  # an uncached block and a partial one
    store.check()
    assert result.num_tokens == 16
    assert result.kv.dtype == kv.dtype and result.kv.shape == kv.shape
    assert torch.equal(bits(result.kv), bits(kv))
    result.kv.zero_()  # a new tensor: writing to it changes nothing stored
    assert torch.equal(bits(store.load(tokens).kv), bits(kv))
    assert torch.equal(bits(store.load(seq(0, 6)).kv), bits(kv[:, :, :4]))
    assert store.load(seq(900, 8)).kv.shape == (2, 2, 0, 2, 4)
    store.check()


# ---- demotion ------------------------------------------------------------------------------


@pytest.mark.parametrize(("write", "copied"), [("write_through", 0), ("write_back", 2)])
def test_lru_demotion_moves_the_least_recent_sequence_to_host(
    make_store: MakeStore, write: str, copied: int
) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8, write=write)
    kvs = {name: kv_for(store, 8, seed) for seed, name in enumerate("ABC")}
    store.store(A, kvs["A"])
    store.store(B, kvs["B"])
    store.check()
    assert store.lookup(A) == hit(gpu=8)  # A is now more recent than B
    assert store.store(C, kvs["C"]) == StoreResult(8, 8, 0)
    store.check()
    assert (store.lookup(A), store.lookup(B), store.lookup(C)) == (
        hit(gpu=8),
        hit(host=8),
        hit(gpu=8),
    )
    lease_c, lease_a = store.prefetch(C), store.prefetch(A)
    assert (lease_a.block_table, lease_c.block_table) == ((0, 1), (2, 3))  # C took B's slots
    gpu, host = tier(store, "gpu"), tier(store, "host")
    assert (gpu["demotions"], gpu["evictions"], gpu["blocks"]) == (2, 0, 4)
    assert gpu["bytes_out"] == host["bytes_in"] == copied * BLOCK_BYTES
    assert host["blocks"] == (6 if write == "write_through" else 2)
    for name, tokens in zip("ABC", (A, B, C), strict=True):
        assert torch.equal(store.load(tokens).kv, kvs[name])
    store.check()


def test_a_full_host_drops_its_least_recent_host_only_leaves(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=2, host_blocks=4, write="write_back")
    kvs = {name: kv_for(store, 8, seed) for seed, name in enumerate("ABCD")}
    for name, tokens in zip("ABC", (A, B, C), strict=True):
        assert store.store(tokens, kvs[name]) == StoreResult(8, 8, 0)
        store.check()
    assert (store.lookup(A), store.lookup(B), store.lookup(C)) == (
        hit(host=8),
        hit(host=8),
        hit(gpu=8),
    )
    assert store.lookup(A) == hit(host=8)  # B is now the least recent on host
    store.store(D, kvs["D"])
    store.check()
    assert store.lookup(B) == hit()
    assert (store.lookup(A), store.lookup(C), store.lookup(D)) == (
        hit(host=8),
        hit(host=8),
        hit(gpu=8),
    )
    host = tier(store, "host")
    assert (host["evictions"], host["blocks"], host["free_slots"]) == (2, 4, 0)
    assert store.status()["index"]["blocks"] == 6
    for name, tokens in zip("ACD", (A, C, D), strict=True):
        assert torch.equal(store.load(tokens).kv, kvs[name])
    store.check()


def test_a_store_that_drops_all_else_of_its_namespace_stays_reachable(
    make_store: MakeStore,
) -> None:
    store = make_store(gpu_blocks=2, host_blocks=4, write="selective")
    store.store(A, kv_for(store, 8))
    b_kv = kv_for(store, 8, seed=1)
    assert store.store(B, b_kv) == StoreResult(8, 8, 0)  # A is cold: dropped to make room
    store.check()
    assert (store.lookup(A), store.lookup(B)) == (hit(), hit(gpu=8))
    assert torch.equal(store.load(B).kv, b_kv)
    assert tier(store, "gpu")["evictions"] == 2
    assert store.status()["index"] == {
        "blocks": 2,
        "nodes": 1,
        "namespaces": 1,
        "tenants": 1,
        "leases": 0,
        "reservations": 0,
    }
    store.check()


def test_passing_the_high_watermark_demotes_down_to_the_low_one_in_the_background(
    make_store: MakeStore,
) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8, gpu_watermarks=(0.5, 0.25), background=True)
    kv = kv_for(store, 12)
    store.store(seq(0, 12), kv)  # 3 of 4 slots > 0.5: demote to 1 slot in use
    store.check()
    assert store.drain(timeout_s=10)  # the mover's thread does it
    assert store.lookup(seq(0, 12)) == hit(gpu=4, host=8)
    assert tier(store, "gpu")["used_bytes"] == BLOCK_BYTES
    assert torch.equal(store.load(seq(0, 12)).kv, kv)
    store.check()


def test_inline_a_block_leaves_a_tier_only_when_its_slot_is_needed(make_store: MakeStore) -> None:
    store = make_store(
        gpu_blocks=4,
        host_blocks=8,
        gpu_watermarks=(0.5, 0.25),
        background=False,
        write="write_back",
    )
    kv = kv_for(store, 12)
    store.store(seq(0, 12), kv)  # 3 of 4 slots, over 0.5: nothing moves
    assert store.drain(timeout_s=10)
    store.check()
    assert store.lookup(seq(0, 12)) == hit(gpu=12)
    gpu, host = tier(store, "gpu"), tier(store, "host")
    assert (gpu["used_bytes"], gpu["dirty_blocks"], host["blocks"]) == (3 * BLOCK_BYTES, 3, 0)
    store.store(seq(100, 8), kv_for(store, 8, seed=1))  # needs 2 slots, 1 free: the LRU leaves
    store.check()
    assert store.lookup(seq(0, 12)) == hit(gpu=8, host=4)
    gpu, host = tier(store, "gpu"), tier(store, "host")
    assert (gpu["dirty_blocks"], host["dirty_blocks"], gpu["demotions"]) == (4, 1, 1)
    assert torch.equal(store.load(seq(0, 12)).kv, kv)
    store.check()


def test_selective_copies_only_blocks_hit_often_enough(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=2, host_blocks=8, write="selective", selective_hits=2)
    hot, cold = seq(0, 4), seq(100, 4)
    hot_kv = kv_for(store, 4, seed=1)
    store.store(hot, hot_kv)
    store.store(cold, kv_for(store, 4, seed=2))
    store.check()
    assert tier(store, "host")["blocks"] == 0  # selective: no copy when stored
    store.lookup(hot)
    store.lookup(hot)  # 2 hits
    store.store(seq(200, 8), kv_for(store, 8, seed=3))  # both must leave the gpu
    store.check()
    assert store.lookup(cold) == hit()  # 0 hits: dropped
    assert store.lookup(hot) == hit(host=4)  # copied down
    gpu = tier(store, "gpu")
    assert (gpu["demotions"], gpu["evictions"], gpu["bytes_out"]) == (1, 1, BLOCK_BYTES)
    assert torch.equal(store.load(hot).kv, hot_kv)
    store.check()


def test_evict_frees_at_most_what_was_asked(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=4, host_blocks=4, write="write_back")
    store.store(seq(0, 16), kv_for(store, 16))
    assert store.evict("gpu", 0) == 0
    assert store.evict("gpu", 3) == 3
    store.check()
    assert store.lookup(seq(0, 16)) == hit(gpu=4, host=12)
    assert store.evict("host", 2) == 2  # the lowest tier drops its leaves
    store.check()
    assert store.lookup(seq(0, 16)) == hit(gpu=4, host=4)
    assert store.evict("host", 10) == 1
    assert store.evict("gpu", 10) == 1
    store.check()
    assert store.lookup(seq(0, 16)) == hit(host=4)
    assert tier(store, "host")["evictions"] == 3


# ---- prefetch and leases -------------------------------------------------------------------


def test_prefetch_brings_a_host_prefix_back_to_gpu(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8)
    tokens = seq(0, 12)
    kv = kv_for(store, 12, seed=5)
    store.store(tokens, kv)
    assert store.evict("gpu", 3) == 3
    store.check()
    assert store.lookup(tokens) == hit(host=12)
    lease = store.prefetch([*tokens, 7, 7])
    store.check()
    assert (lease.num_tokens, lease.block_table, lease.tenant) == (12, (0, 1, 2), "default")
    assert torch.equal(leased_kv(store, lease), kv)
    assert store.lookup(tokens) == hit(gpu=12)
    assert store.leases() == [lease]
    gpu = tier(store, "gpu")
    assert (gpu["promotions"], gpu["leased_blocks"], gpu["bytes_in"]) == (3, 3, 3 * BLOCK_BYTES)
    store.release(lease)
    store.check()
    assert store.leases() == []
    assert tier(store, "gpu")["leased_blocks"] == 0


def test_prefetch_of_a_partly_demoted_prefix_promotes_only_the_missing_blocks(
    make_store: MakeStore,
) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8, write="write_back")
    tokens = seq(0, 16)
    kv = kv_for(store, 16, seed=5)
    store.store(tokens, kv)
    assert store.evict("gpu", 2) == 2
    lease = store.prefetch(tokens)
    store.check()
    assert lease.block_table[:2] == (0, 1)
    assert sorted(lease.block_table) == [0, 1, 2, 3]
    assert torch.equal(leased_kv(store, lease), kv)
    assert tier(store, "gpu")["promotions"] == 2


def test_leased_blocks_stay_on_gpu_and_other_blocks_make_room(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8)
    kvs = {name: kv_for(store, 8, seed) for seed, name in enumerate("ABCD")}
    store.store(A, kvs["A"])
    lease = store.prefetch(A)
    store.store(B, kvs["B"])
    store.check()
    for name, tokens in (("C", C), ("D", D)):  # A is least recent each time, but leased
        assert store.store(tokens, kvs[name]) == StoreResult(8, 8, 0)
        store.check()
        assert store.lookup(A) == hit(gpu=8)
        assert torch.equal(leased_kv(store, lease), kvs["A"])
    assert (store.lookup(B), store.lookup(C), store.lookup(D)) == (
        hit(host=8),
        hit(host=8),
        hit(gpu=8),
    )
    assert tier(store, "gpu")["leased_blocks"] == 2
    store.release(lease)
    store.check()


def test_with_gpu_all_leased_a_store_goes_to_host(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=2, host_blocks=4)
    store.store(A, kv_for(store, 8))
    lease = store.prefetch(A)
    b_kv = kv_for(store, 8, seed=1)
    assert store.store(B, b_kv) == StoreResult(8, 8, 0)
    store.check()
    assert store.lookup(B) == hit(host=8)
    assert torch.equal(store.load(B).kv, b_kv)
    assert tier(store, "gpu")["demotions"] == 0
    store.release(lease)
    store.check()


def test_with_gpu_leased_and_host_unfreeable_a_store_is_dropped(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=2, host_blocks=2)  # host holds A's write-through copies
    store.store(A, kv_for(store, 8))
    lease = store.prefetch(A)
    assert store.store(B, kv_for(store, 8, seed=1)) == StoreResult(0, 0, 8)
    store.check()
    assert store.lookup(B) == hit()
    assert store.lookup(A) == hit(gpu=8)
    assert store.status()["ops"]["dropped_tokens"] == 8
    assert (tier(store, "gpu")["blocks"], tier(store, "host")["blocks"]) == (2, 2)
    store.release(lease)
    store.check()


@pytest.mark.parametrize("write", WRITE_POLICIES)
def test_prefetch_that_cannot_fit_raises_and_moves_nothing(
    make_store: MakeStore, write: str
) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8, write=write)
    long = seq(0, 16)
    store.store(long, kv_for(store, 16))
    store.lookup(long)
    store.lookup(long)  # hot enough for `selective` to keep it
    assert store.evict("gpu", 4) == 4
    store.store(B, kv_for(store, 8, seed=1))
    lease = store.prefetch(B)
    store.store(C, kv_for(store, 8, seed=2))  # gpu: B leased, C evictable
    store.check()
    before = [store.lookup(t) for t in (long, B, C)]
    assert before == [hit(host=16), hit(gpu=8), hit(gpu=8)]
    status = store.status()["tiers"]
    with pytest.raises(CapacityError, match=r"4 blocks must come up to gpu, but only 2 of 4"):
        store.prefetch(long)
    store.check()
    assert store.leases() == [lease]
    assert [store.lookup(t) for t in (long, B, C)] == before
    after = store.status()["tiers"]
    for name in ("gpu", "host"):
        assert after[name]["used_bytes"] == status[name]["used_bytes"]


def test_prefetch_of_a_prefix_longer_than_the_gpu_raises(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=2, host_blocks=8)
    assert store.store(seq(0, 12), kv_for(store, 12)) == StoreResult(12, 12, 0)
    store.check()
    assert store.lookup(seq(0, 12)) == hit(host=12)  # 3 blocks never fit the gpu: all on host
    with pytest.raises(CapacityError, match=r"3 blocks must come up to gpu, but only 2 of 2"):
        store.prefetch(seq(0, 12))
    store.check()
    assert store.leases() == []
    assert store.lookup(seq(0, 12)) == hit(host=12)
    assert tier(store, "gpu")["used_bytes"] == 0


def test_extending_a_leased_sequence_leaves_the_lease_as_it_was(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=8, host_blocks=8)
    kv = kv_for(store, 16)
    store.store(seq(0, 8), kv[:, :, :8])
    lease = store.prefetch(seq(0, 8))
    assert store.store(seq(0, 16), kv) == StoreResult(16, 8, 0)
    store.check()
    assert store.leases() == [lease]
    assert tier(store, "gpu")["leased_blocks"] == 2
    assert torch.equal(leased_kv(store, lease), kv[:, :, :8])
    assert store.evict("gpu", 8) == 2  # the new blocks are not leased
    store.check()
    assert store.lookup(seq(0, 16)) == hit(gpu=8, host=8)


def test_release_twice_raises_lease_error(make_store: MakeStore) -> None:
    store = make_store()
    store.store(A, kv_for(store, 8))
    first, second = store.prefetch(A), store.prefetch(A)
    assert first.lease_id != second.lease_id
    assert first.block_table == second.block_table == (0, 1)
    assert tier(store, "gpu")["leased_blocks"] == 2
    store.release(first)
    store.check()
    with pytest.raises(LeaseError, match=rf"lease {first.lease_id}: unknown, released or expired"):
        store.release(first)
    store.check()
    assert store.leases() == [second]
    store.release(second.lease_id)  # by id
    with pytest.raises(LeaseError):
        store.release(second.lease_id)
    store.check()
    assert store.leases() == []


def test_overlapping_leases_count_each_leased_block_once(make_store: MakeStore) -> None:
    store = make_store()
    tokens = seq(0, 16)
    store.store(tokens, kv_for(store, 16))
    short, long = store.prefetch(tokens[:8]), store.prefetch(tokens)
    store.check()
    assert (short.block_table, long.block_table) == ((0, 1), (0, 1, 2, 3))
    assert tier(store, "gpu")["leased_blocks"] == 4
    assert store.status()["index"]["leases"] == 2
    store.release(long)
    store.check()
    assert tier(store, "gpu")["leased_blocks"] == 2
    assert store.evict("gpu", 4) == 2  # the short lease holds the first two
    store.check()
    assert store.lookup(tokens) == hit(gpu=8, host=8)


def test_an_empty_prefix_gives_an_empty_lease_to_release(make_store: MakeStore) -> None:
    store = make_store()
    lease = store.prefetch(A)
    store.check()
    assert (lease.num_tokens, lease.block_table) == (0, ())
    assert store.leases() == [lease]
    store.release(lease)
    store.check()
    assert store.leases() == []


def test_leases_expire_on_the_stores_clock(make_store: MakeStore) -> None:
    now = [100.0]
    store = make_store(gpu_blocks=4, host_blocks=8, clock=lambda: now[0])
    store.store(seq(0, 12), kv_for(store, 12))
    lease = store.prefetch(seq(0, 12), ttl_s=5)
    default = store.prefetch(seq(0, 4))
    store.check()
    assert (lease.expires_at, default.expires_at) == (105.0, 160.0)  # ttl_s, lease_ttl_s
    now[0] = 104.5
    assert store.evict("gpu", 3) == 0  # leased: nothing to free
    assert store.leases() == [lease, default]
    now[0] = 105.0
    assert store.leases() == [default]
    store.check()
    assert store.status()["ops"]["leases_expired"] == 1
    assert tier(store, "gpu")["leased_blocks"] == 1
    with pytest.raises(LeaseError, match="unknown, released or expired"):
        store.release(lease)
    assert store.evict("gpu", 3) == 2  # evictable now, but for the first block
    store.check()
    assert store.lookup(seq(0, 12)) == hit(gpu=4, host=8)
    now[0] = 160.0
    with pytest.raises(LeaseError):
        store.release(default)  # expired before anything else looked at it
    assert store.evict("gpu", 1) == 1
    store.check()
    assert store.leases() == []


# ---- tenants, status, close ----------------------------------------------------------------


def test_tenants_share_nothing(make_store: MakeStore) -> None:
    store = make_store(tenants=("alice", "bob"))
    alice_kv, bob_kv = kv_for(store, 8, 1), kv_for(store, 8, 2)
    assert store.store(A, alice_kv, tenant="alice") == StoreResult(8, 8, 0)
    store.check()
    assert store.lookup(A, tenant="bob") == hit()
    assert store.load(A, tenant="bob").num_tokens == 0
    assert store.prefetch(A, tenant="bob").num_tokens == 0
    assert store.store(A, bob_kv, tenant="bob") == StoreResult(8, 8, 0)  # stored again
    store.check()
    assert tier(store, "gpu")["blocks"] == 4
    assert store.status()["index"]["namespaces"] == 2
    assert torch.equal(store.load(A, tenant="alice").kv, alice_kv)
    assert torch.equal(store.load(A, tenant="bob").kv, bob_kv)
    with pytest.raises(UnknownTenantError, match=r"tenant 'default': unknown.*'alice', 'bob'"):
        store.lookup(A)
    store.check()


def test_status_figures_match_pools_and_index(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8)
    store.store(seq(0, 12), kv_for(store, 12))
    store.evict("gpu", 1)
    assert store.lookup(seq(0, 16)) == hit(gpu=8, host=4)  # 12 of 16 tokens
    assert store.lookup(seq(0, 8)) == hit(gpu=8)  # 8 of 8
    status = store.status()
    assert status["hit_rate"] == pytest.approx(20 / 24)
    assert status["layout"] == {
        "model": "tiny",
        "block_tokens": 4,
        "block_bytes": BLOCK_BYTES,
        "dtype": "float32",
    }
    for index, (name, pool) in enumerate(zip(("gpu", "host"), store.pools, strict=True)):
        figures = status["tiers"][name]
        assert figures["capacity_bytes"] == pool.capacity_bytes == pool.num_slots * BLOCK_BYTES
        assert figures["used_bytes"] == pool.used_bytes == figures["blocks"] * BLOCK_BYTES
        assert figures["blocks"] == store.index.resident(index)
        assert figures["free_slots"] == pool.num_free == figures["slots"] - figures["blocks"]
    assert (status["tiers"]["gpu"]["slots"], status["tiers"]["host"]["slots"]) == (4, 8)
    assert (status["tiers"]["gpu"]["blocks"], status["tiers"]["host"]["blocks"]) == (2, 3)
    assert (status["tiers"]["gpu"]["hits"], status["tiers"]["host"]["hits"]) == (4, 1)
    assert status["index"] == {
        "blocks": 3,
        "nodes": store.index.num_nodes,
        "namespaces": 1,
        "tenants": 1,
        "leases": 0,
        "reservations": 0,
    }
    assert status["policy"] == {"write": "write_through"}
    assert status["ops"]["lookups"] == 2 and status["ops"]["stores"] == 1
    store.check()


def test_a_fresh_store_reports_zero_hit_rate(make_store: MakeStore) -> None:
    store = make_store()
    assert store.status()["hit_rate"] == 0.0
    assert store.lookup(A) == hit()
    assert store.status()["hit_rate"] == 0.0
    store.check()


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.lookup(A),
        lambda s: s.store(A, kv_for(s, 8)),
        lambda s: s.load(A),
        lambda s: s.prefetch(A),
        lambda s: s.release(1),
        lambda s: s.leases(),
        lambda s: s.evict("gpu", 1),
        lambda s: s.status(),
        lambda s: s.check(),
    ],
    ids=["lookup", "store", "load", "prefetch", "release", "leases", "evict", "status", "check"],
)
def test_every_call_after_close_raises_closed_error(
    make_store: MakeStore, call: Callable[[KVStore], object]
) -> None:
    store = make_store()
    store.store(A, kv_for(store, 8))
    store.prefetch(A)
    store.close()
    store.close()  # idempotent
    with pytest.raises(ClosedError, match="closed"):
        call(store)


def test_a_store_used_as_a_context_manager_closes(make_store: MakeStore) -> None:
    with make_store() as store:
        store.store(A, kv_for(store, 8))
        store.check()
    with pytest.raises(ClosedError):
        store.lookup(A)


def test_selective_copies_to_host_at_the_nth_hit(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8, write="selective", selective_hits=3)
    hot = seq(0, 8)
    hot_kv = kv_for(store, 8, seed=1)
    store.store(hot, hot_kv)  # a new node: 0 hits
    store.load(hot)  # 1 hit
    store.lookup(hot)  # 2 hits: not yet (lookups count, but copy nothing)
    assert tier(store, "host")["blocks"] == 0
    lease = store.prefetch(hot)  # 3 hits: both blocks get a host copy, once
    assert tier(store, "host")["blocks"] == 2
    assert store.status()["paths"]["gpu->host"]["bytes"] == 2 * BLOCK_BYTES
    store.release(lease)
    store.load(hot)
    assert store.status()["paths"]["gpu->host"]["bytes"] == 2 * BLOCK_BYTES  # not copied twice
    assert store.evict("gpu", 2) == 2  # its demotion is free now: the host copy is there
    assert store.lookup(hot) == hit(host=8)
    assert torch.equal(store.load(hot).kv, hot_kv)
    store.check()


def test_reserve_write_commit_is_store_without_the_copy_in(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=8, host_blocks=16)
    tokens, kv = seq(0, 10), kv_for(store, 10)  # 2 whole blocks and a partial one
    store.store(tokens[:4], kv[:, :, :4])
    reservation = store.reserve(tokens)
    assert (reservation.cached_tokens, reservation.num_tokens, reservation.tier) == (4, 4, "gpu")
    store.check()  # reserved slots are accounted for, and invisible
    assert store.lookup(tokens) == hit(gpu=4)
    pool = store.gpu_pool.buffer
    pool[list(reservation.slots)] = (
        kv[:, :, 4:8].reshape(2, 2, 1, 4, 2, 4).permute(2, 0, 1, 3, 4, 5)
    )
    assert store.commit(reservation) == StoreResult(8, 4, 0)
    assert store.lookup(tokens) == hit(gpu=8)
    assert torch.equal(store.load(tokens).kv, kv[:, :, :8])
    assert tier(store, "host")["blocks"] == 2  # write_through copied the written block too
    store.check()
    with pytest.raises(LeaseError, match="reservation"):
        store.commit(reservation)


def test_an_aborted_or_expired_reservation_gives_its_slots_back(make_store: MakeStore) -> None:
    now = [100.0]
    store = make_store(gpu_blocks=8, host_blocks=16, clock=lambda: now[0])
    first = store.reserve(seq(0, 8))
    store.abort(first)
    assert tier(store, "gpu")["free_slots"] == 8  # aborted: free at once
    second = store.reserve(seq(0, 8), ttl_s=5)
    assert tier(store, "gpu")["free_slots"] == 6
    now[0] += 5
    store.check()
    # expired: quarantined (a late writer may still write), so still allocated, never visible
    assert tier(store, "gpu")["free_slots"] == 6 and store.lookup(seq(0, 8)) == hit()
    with pytest.raises(LeaseError):
        store.commit(second)
    store.check()
    now[0] += store.config.policy.reservation_quarantine_s
    assert tier(store, "gpu")["free_slots"] == 8
    store.check()
