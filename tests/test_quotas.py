"""Fair shares between tenants, in-process (DESIGN invariant 9; issue 11, points 3 and 4).

Scenarios on a tiny store (4 tokens a block) with two tenants, `a` and `b`: by default each
gets half of every tier as its quota (what its leases and reservations may hold) and as its
floor (what no other tenant's call may evict). The mover runs inline, so every call returns
with its copies done and the tiers of each block can be asserted exactly.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, bits, kv_for, tiny_block_bytes

from kvtier.config import parse_config
from kvtier.errors import ConfigError, InvalidArgumentError, InvariantError, QuotaError
from kvtier.results import LookupResult
from kvtier.store import KVStore

BT = TINY_BLOCK_TOKENS
MakeShared = Callable[..., KVStore]


def seq(first: int, num_blocks: int) -> list[int]:
    return list(range(first, first + num_blocks * BT))


def hit(gpu: int = 0, host: int = 0) -> LookupResult:
    """A lookup result of `gpu` and `host` blocks (tokens counted as the store does)."""
    return LookupResult((gpu + host) * BT, gpu * BT, host * BT, 0)


@pytest.fixture
def make_shared() -> Iterator[MakeShared]:
    """`make_shared(gpu_blocks=8, host_blocks=16, tenants={"a": {}, "b": {}}, policy={})`: a
    tiny store with an inline mover (`background=True`: on a thread); closed after the test."""
    stores: list[KVStore] = []

    def factory(
        gpu_blocks: int = 8,
        host_blocks: int = 16,
        tenants: Mapping[str, Any] | None = None,
        policy: Mapping[str, Any] | None = None,
        gpu_watermarks: tuple[float, float] = (1.0, 1.0),
        background: bool = False,
    ) -> KVStore:
        block_bytes = tiny_block_bytes()
        config = parse_config(
            {
                "model": {**TINY_MODEL, "dtype": "float32"},
                "block_tokens": BT,
                "tiers": {
                    "gpu": {
                        "capacity": gpu_blocks * block_bytes,
                        "device": "cpu",
                        "high_watermark": gpu_watermarks[0],
                        "low_watermark": gpu_watermarks[1],
                    },
                    "host": {"capacity": host_blocks * block_bytes, "pinned": False},
                },
                "policy": {"write": "write_through", **(policy or {})},
                "mover": {"background": background},
                "tenants": dict(tenants if tenants is not None else {"a": {}, "b": {}}),
            }
        )
        store = KVStore(config)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


# ---- ttl bound -------------------------------------------------------------------------------


@pytest.mark.parametrize("ttl_s", [1e9, 1e300, 600.001], ids=repr)
def test_a_ttl_past_the_maximum_is_refused_and_nothing_is_held(
    make_shared: MakeShared, ttl_s: float
) -> None:
    store = make_shared()
    store.store(seq(0, 2), kv_for(store, 2 * BT), tenant="a")
    with pytest.raises(
        InvalidArgumentError, match=re.escape(f"ttl_s: got {ttl_s!r}") + r".*\(0, 600.0\]"
    ):
        store.prefetch(seq(0, 2), tenant="a", ttl_s=ttl_s)
    with pytest.raises(InvalidArgumentError, match=r"policy.max_ttl_s"):
        store.reserve(seq(100, 2), tenant="a", ttl_s=ttl_s)
    assert store.leases() == [] and len(store.reservations) == 0
    lease = store.prefetch(seq(0, 2), tenant="a", ttl_s=600.0)  # the maximum itself is allowed
    assert lease.num_tokens == 2 * BT
    store.check()


def test_the_maximum_ttl_must_allow_the_default_ttl() -> None:
    with pytest.raises(ConfigError, match=r"policy.max_ttl_s.*at least lease_ttl_s \(60.0\)"):
        parse_config({"policy": {"max_ttl_s": 30}})
    assert parse_config({"policy": {"lease_ttl_s": 5, "max_ttl_s": 5}}).policy.max_ttl_s == 5


# ---- limits ----------------------------------------------------------------------------------


def test_several_tenants_split_each_tier_and_a_single_one_keeps_it_all(
    make_shared: MakeShared,
) -> None:
    three = make_shared(gpu_blocks=9, host_blocks=16, tenants={"a": {}, "b": {}, "c": {}})
    limits = three.shares.limits["c"]
    assert (limits.quota, limits.floor, limits.leases) == ((3, 5), (3, 5), 4096)
    alone = make_shared(tenants={"solo": {}})
    assert alone.shares.limits["solo"].quota == (None, None)  # bounded by the tiers alone
    assert alone.shares.limits["solo"].floor == (0, 0)
    assert alone.index.floors == {}  # plain LRU, as before quotas existed
    given = make_shared(
        tenants={
            "a": {
                "quota": {"gpu": 0.25, "host": f"{3 * tiny_block_bytes()}B", "leases": 7},
                "floor": {"gpu": 0.25},
            },
            "b": {"floor": {"gpu": 0.75}},
        }
    )
    assert given.shares.limits["a"].quota == (2, 3) and given.shares.limits["a"].leases == 7
    assert given.shares.limits["b"].floor == (6, 8)


def test_floors_that_do_not_fit_in_a_tier_stop_the_start(make_shared: MakeShared) -> None:
    with pytest.raises(ConfigError, match=r"tenants.\*.floor.gpu.*9 blocks in all.*8 slots"):
        make_shared(tenants={"a": {"floor": {"gpu": 0.625}}, "b": {}})  # 5 + 4 of 8


# ---- quotas: leases and reservations ---------------------------------------------------------


def test_leases_past_the_gpu_quota_are_refused_and_change_nothing(
    make_shared: MakeShared,
) -> None:
    store = make_shared()  # gpu: 8 slots, a quota of 4 blocks each
    for first in (0, 100):
        store.store(seq(first, 3), kv_for(store, 3 * BT), tenant="b")
    held = store.prefetch(seq(0, 3), tenant="b")
    before = store.status()
    message = r"tenant 'b': a prefetch asked for 3 more gpu blocks beside the 3 it holds, over "
    with pytest.raises(QuotaError, match=message + r"its quota of 4 \(tenants.b.quota.gpu\)"):
        store.prefetch(seq(100, 3), tenant="b")
    assert [lease.lease_id for lease in store.leases()] == [held.lease_id]
    assert store.status()["tiers"] == before["tiers"]
    store.check()
    again = store.prefetch(seq(0, 3), tenant="b")  # the same blocks again: held once
    assert store.status(tenant="b")["tiers"]["gpu"]["held_blocks"] == 3
    store.release(held)
    store.release(again)
    store.prefetch(seq(100, 3), tenant="b")  # room in the quota again
    store.check()


def test_a_flood_of_leases_on_one_prefix_stops_at_the_lease_quota(
    make_shared: MakeShared,
) -> None:
    store = make_shared(tenants={"a": {}, "b": {"quota": {"leases": 3}}})
    store.store(seq(0, 1), kv_for(store, BT), tenant="b")
    leases = [store.prefetch(seq(0, 1), tenant="b") for _ in range(3)]
    with pytest.raises(QuotaError, match=r"tenant 'b': a prefetch asked for lease 4, over its "):
        store.prefetch(seq(0, 1), tenant="b")
    with pytest.raises(QuotaError, match=r"quota of 3 live leases"):
        store.prefetch(seq(500, 1), tenant="b")  # an empty lease counts too
    assert len(store.leases()) == 3
    store.release(leases[0])
    store.prefetch(seq(0, 1), tenant="b")
    assert store.status(tenant="b")["leases"] == {"live": 3, "quota": 3}
    assert store.prefetch(seq(0, 1), tenant="a").num_tokens == 0  # a's quota is its own
    store.check()


def test_reservations_count_against_the_quota_of_their_tier(make_shared: MakeShared) -> None:
    store = make_shared()  # gpu quota 4, host quota 8 for each tenant
    first = store.reserve(seq(0, 3), tenant="b")
    assert (first.tier, len(first.slots)) == ("gpu", 3)
    with pytest.raises(QuotaError, match=r"'b': a reservation asked for 2 more gpu blocks beside "):
        store.reserve(seq(100, 2), tenant="b")
    assert len(store.reservations) == 1
    gpu_b = store.status(tenant="b")["tiers"]["gpu"]
    assert (gpu_b["reserved_blocks"], gpu_b["held_blocks"], gpu_b["quota_blocks"]) == (3, 3, 4)
    assert store.status(tenant="b")["tiers"]["host"]["reserved_blocks"] == 3  # write_through
    store.abort(first)
    assert len(store.reserve(seq(100, 4), tenant="b").slots) == 4
    assert store.reserve(seq(200, 4), tenant="a").tier == "gpu"  # a's share is untouched
    store.check()


def test_a_lease_and_a_reservation_share_the_gpu_quota(make_shared: MakeShared) -> None:
    store = make_shared()
    store.store(seq(0, 2), kv_for(store, 2 * BT), tenant="b")
    store.prefetch(seq(0, 2), tenant="b")
    with pytest.raises(QuotaError, match=r"asked for 3 more gpu blocks beside the 2"):
        store.reserve(seq(100, 3), tenant="b")
    store.reserve(seq(100, 2), tenant="b")
    store.check()


# ---- fair-share floors -----------------------------------------------------------------------


def test_plain_stores_of_one_tenant_do_not_evict_another_below_its_floor(
    make_shared: MakeShared,
) -> None:
    store = make_shared()  # floors: 4 gpu and 8 host blocks each
    kv_a = kv_for(store, 4 * BT, seed=1)
    store.store(seq(0, 4), kv_a, tenant="a")
    for i in range(20):  # b writes 5x the gpu and more than the host tier
        assert store.store(seq(1000 + 100 * i, 4), kv_for(store, 4 * BT), tenant="b").stored_tokens
        store.check()
    assert store.lookup(seq(0, 4), tenant="a") == hit(gpu=4)
    assert bits(store.load(seq(0, 4), tenant="a").kv).equal(bits(kv_a))
    assert store.lookup(seq(2900, 4), tenant="b") == hit(gpu=4)  # b's newest, on b's own room
    b = store.status(tenant="b")["tiers"]
    assert (b["gpu"]["blocks"], b["host"]["blocks"]) == (4, 12)


def test_victims_come_first_from_a_tenant_above_its_floor(make_shared: MakeShared) -> None:
    store = make_shared()
    store.store(seq(0, 2), kv_for(store, 2 * BT), tenant="b")  # the least recently used
    store.store(seq(100, 6), kv_for(store, 6 * BT), tenant="a")  # a: 6 > its floor of 4
    store.store(seq(200, 2), kv_for(store, 2 * BT), tenant="b")  # room from a, not from b
    assert store.lookup(seq(0, 2), tenant="b") == hit(gpu=2)
    assert store.lookup(seq(100, 6), tenant="a") == hit(gpu=4, host=2)
    store.check()


def test_at_its_floor_a_tenant_makes_room_from_its_own_blocks(make_shared: MakeShared) -> None:
    store = make_shared()
    store.store(seq(0, 4), kv_for(store, 4 * BT), tenant="a")  # older than all of b's
    store.store(seq(100, 2), kv_for(store, 2 * BT), tenant="b")
    store.store(seq(200, 2), kv_for(store, 2 * BT), tenant="b")  # gpu full, both at floor
    store.store(seq(300, 1), kv_for(store, BT), tenant="b")
    assert store.lookup(seq(0, 4), tenant="a") == hit(gpu=4)
    assert store.lookup(seq(100, 2), tenant="b") == hit(gpu=1, host=1)  # b's own LRU went
    store.check()


def test_a_prefetch_does_not_demote_another_tenant_below_its_floor(
    make_shared: MakeShared,
) -> None:
    store = make_shared()
    store.store(seq(0, 4), kv_for(store, 4 * BT), tenant="a")
    store.store(seq(100, 4), kv_for(store, 4 * BT), tenant="b")
    store.evict("gpu", 8)  # the store's own work takes nothing within floors
    assert store.lookup(seq(0, 4), tenant="a") == hit(gpu=4)
    store.store(seq(200, 4), kv_for(store, 4 * BT), tenant="b")  # demotes b's own 4
    assert store.lookup(seq(100, 4), tenant="b") == hit(host=4)
    store.prefetch(seq(100, 4), tenant="b")  # back up: room from b's own blocks again
    assert store.lookup(seq(0, 4), tenant="a") == hit(gpu=4)
    assert store.lookup(seq(200, 4), tenant="b") == hit(host=4)
    store.check()


def test_a_tenants_reservations_come_off_its_floor_so_it_cannot_pin_a_tier(
    make_shared: MakeShared,
) -> None:
    """b caches its floor's worth of gpu blocks, then reserves its quota's worth: with the
    default split that was the whole gpu tier, and a's stores went to host and its prefetches
    failed (DESIGN invariant 9). Now b's reserved slots count toward its floor: its cached
    blocks above what is left of it give way to a, and come back under it when the
    reservations end."""
    store = make_shared()  # gpu: 8 slots, floor and quota 4 each
    kv_b = kv_for(store, 4 * BT, seed=2)
    store.store(seq(0, 4), kv_b, tenant="b")
    held = [store.reserve(seq(100 + 10 * i, 2), tenant="b", ttl_s=600) for i in range(2)]
    assert [r.tier for r in held] == ["gpu", "gpu"]  # b: 4 cached + 4 reserved = the tier
    store.check()
    kv_a = kv_for(store, 3 * BT, seed=3)
    assert store.store(seq(500, 3), kv_a, tenant="a").stored_tokens == 3 * BT
    assert store.lookup(seq(500, 3), tenant="a") == hit(gpu=3)  # was: host=3
    lease = store.prefetch(seq(500, 3), tenant="a")  # was: CapacityError, no gpu room
    assert lease.ready()
    store.release(lease)
    assert store.lookup(seq(0, 4), tenant="b") == hit(gpu=1, host=3)  # its LRU blocks gave way
    assert bits(store.load(seq(0, 4), tenant="b").kv).equal(bits(kv_b))
    store.check()
    for reservation in held:  # ended: b's floor is its cached blocks' again
        store.abort(reservation)
    store.check()
    store.store(seq(700, 1), kv_for(store, BT), tenant="a")  # room from a's own, not b's
    assert store.lookup(seq(0, 4), tenant="b") == hit(gpu=1, host=3)
    store.prefetch(seq(0, 4), tenant="b")  # b up to its floor: a's blocks above its floor go
    assert store.lookup(seq(0, 4), tenant="b") == hit(gpu=4)
    store.check()


def test_watermark_demotion_takes_only_what_is_above_floors(make_shared: MakeShared) -> None:
    store = make_shared(gpu_watermarks=(0.5, 0.25), background=True)
    store.store(seq(0, 2), kv_for(store, 2 * BT), tenant="a")
    store.store(seq(100, 6), kv_for(store, 6 * BT), tenant="b")  # b: 2 above its floor
    assert store.drain(timeout_s=10)  # the mover's thread demotes
    assert store.lookup(seq(0, 2), tenant="a") == hit(gpu=2)
    assert store.lookup(seq(100, 6), tenant="b") == hit(gpu=4, host=2)
    store.check()


def test_check_catches_a_namespace_count_that_drifted(make_shared: MakeShared) -> None:
    store = make_shared()
    store.store(seq(0, 2), kv_for(store, 2 * BT), tenant="a")
    store.check()
    store.index.residency._ns_resident[bytes(store.namespaces.seed("a"))][0] += 1
    with pytest.raises(InvariantError, match=r"copies per tier \[3, 2\] != recount \[2, 2\]"):
        store.check()


# ---- a tenant's status -----------------------------------------------------------------------


def test_a_tenants_status_has_its_own_figures_and_none_of_anothers_activity(
    make_shared: MakeShared,
) -> None:
    store = make_shared()
    store.store(seq(0, 2), kv_for(store, 2 * BT), tenant="b")
    store.lookup(seq(0, 3), tenant="b")
    before = store.status(tenant="b")
    assert before["tenant"] == "b"
    assert before["tiers"]["gpu"] == {
        "capacity_bytes": 8 * tiny_block_bytes(),
        "slots": 8,
        "blocks": 2,
        "reserved_blocks": 0,
        "held_blocks": 0,
        "quota_blocks": 4,
        "floor_blocks": 4,
        "hits": 2,
        "cleared": 0,
    }
    assert before["ops"]["lookups"] == 1 and before["ops"]["stored_tokens"] == 2 * BT
    assert not {"paths", "mover", "index", "recovery"} & set(before)
    for i in range(3):  # a is busy: stores, lookups, loads, a lease, a reservation
        store.store(seq(100 + 100 * i, 2), kv_for(store, 2 * BT), tenant="a")
        store.lookup(seq(100, 2), tenant="a")
        store.load(seq(100, 2), tenant="a")
    store.prefetch(seq(100, 2), tenant="a")
    store.reserve(seq(900, 1), tenant="a")
    assert store.status(tenant="b") == before
    assert store.status()["ops"]["lookups"] == 4  # the admin's view counts everyone


# ---- timing across tenants -------------------------------------------------------------------


def _median_ns(calls: list[Callable[[], object]], rounds: int) -> list[float]:
    """Median time of each call, sampled interleaved (so that load drifts hit all alike)."""
    samples: list[list[int]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, out in zip(calls, samples, strict=True):
            start = time.perf_counter_ns()
            call()
            out.append(time.perf_counter_ns() - start)
    return [statistics.median(s) for s in samples]


def _branched(store: KVStore, path: list[int], tenant: str) -> None:
    """Cache `path` (64 blocks) for `tenant` as 16 nodes of 4 blocks: a branch after each."""
    for node in range(16):
        end = (node + 1) * 4 * BT
        store.store(path[:end], kv_for(store, end), tenant=tenant)
        side = path[:end] + seq(50_000 + 1000 * node + path[0], 1)
        store.store(side, kv_for(store, end + BT), tenant=tenant)


def test_lookup_and_load_take_as_long_whether_another_tenant_caches_the_prefix(
    make_shared: MakeShared,
) -> None:
    """B's lookup and load of a prefix that A has cached, against one nobody has: medians of
    2000 interleaved samples each must agree within 25% (+ 0.5 us). Why that tolerance: on a
    shared 2-core machine medians of sub-10-us calls wander by ~10% between runs; a real
    leak walks A's tree (64 blocks in 16 nodes here), which costs several times a miss, as
    the control shows: B's lookup of its own cached prefix, timed the same way, must differ
    from a miss by more than the tolerance. Up to 3 attempts, to ride out a burst of load."""
    store = make_shared(gpu_blocks=192, host_blocks=192)
    cached, nobody, own = seq(0, 64), seq(10_000, 64), seq(20_000, 64)
    _branched(store, cached, "a")
    _branched(store, own, "b")
    assert store.lookup(cached, tenant="a").num_tokens == 64 * BT

    def close(x: float, y: float) -> bool:
        return abs(x - y) <= 0.25 * min(x, y) + 500

    for _attempt in range(3):
        lookups = _median_ns(
            [
                lambda: store.lookup(cached, tenant="b"),
                lambda: store.lookup(nobody, tenant="b"),
                lambda: store.lookup(own, tenant="b"),
            ],
            2000,
        )
        loads = _median_ns(
            [lambda: store.load(cached, tenant="b"), lambda: store.load(nobody, tenant="b")], 500
        )
        if close(lookups[0], lookups[1]) and close(loads[0], loads[1]):
            break
    assert close(lookups[0], lookups[1]), f"lookup medians (ns): {lookups}"
    assert close(loads[0], loads[1]), f"load medians (ns): {loads}"
    assert not close(lookups[2], lookups[1]), f"the control was not seen: {lookups}"
    assert store.lookup(cached, tenant="b").num_tokens == 0
