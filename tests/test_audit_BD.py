"""Audit BD: the index's eviction under tenants (floors, quotas, leases), in-process.

A call that cannot get room must change nothing: `Demoter.can_make_room` is asked before any
block moves, and its answer has to be what `make_room` can really free. It counted the
caller's own leased copies as evictable (the fair-share bound ignored locks, the lock bound
ignored shares), so a reservation refused for its quota, or a store that found no room on gpu,
first demoted another tenant's block for nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, block_seq, salted_kv, tiny_block_bytes

from kvtier.config import parse_config
from kvtier.errors import QuotaError
from kvtier.store import KVStore

BT = TINY_BLOCK_TOKENS
kv, seq = salted_kv, block_seq


@pytest.fixture
def shared() -> Iterator[KVStore]:
    """gpu 8 slots, host 8; tenants a (gpu quota all of it, host quota 2) and b: floors 4
    each on gpu and host; an inline mover, so every call's moves are done when it returns."""
    bb = tiny_block_bytes()
    config: dict[str, Any] = {
        "model": {**TINY_MODEL, "dtype": "float32"},
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 8 * bb, "device": "cpu"},
            "host": {"capacity": 8 * bb, "pinned": False},
        },
        "policy": {"write": "write_back"},
        "mover": {"background": False},
        "tenants": {"a": {"quota": {"gpu": 1.0, "host": 0.25}}, "b": {}},
    }
    store = KVStore(parse_config(config))
    yield store
    store.close()


def gpu_blocks(store: KVStore, tenant: str) -> int:
    return int(store.status(tenant=tenant)["tiers"]["gpu"]["blocks"])


def setup_locked_owner(store: KVStore) -> list[int]:
    """a holds one gpu block under a lease; b holds 5 gpu blocks, one above its floor of 4;
    2 gpu slots free. b's prompt is returned."""
    mine = seq(100, 1)
    store.store(mine, kv(store, mine, 0.5), tenant="a")
    store.prefetch(mine, tenant="a", ttl_s=600)
    theirs = seq(200, 5)
    store.store(theirs, kv(store, theirs, 0.25), tenant="b")
    assert (gpu_blocks(store, "a"), gpu_blocks(store, "b")) == (1, 5)
    store.check()
    return theirs


def test_a_reservation_refused_for_quota_demotes_no_other_tenants_block(shared: KVStore) -> None:
    theirs = setup_locked_owner(shared)
    # 4 new blocks: gpu has 2 free + b's 1 above its floor; a's own block is leased, so gpu
    # cannot take them and the host tier's quota (2) refuses the reservation
    with pytest.raises(QuotaError, match=r"quota of 2 \(tenants.a.quota.host\)"):
        shared.reserve(seq(300, 4), tenant="a")
    assert gpu_blocks(shared, "b") == 5  # was 4: b's block demoted by a refused call
    hit = shared.lookup(theirs, tenant="b")
    assert (hit.num_tokens, hit.gpu_tokens) == (5 * BT, 5 * BT)
    shared.check()


def test_a_store_that_gpu_cannot_take_leaves_other_tenants_gpu_blocks(shared: KVStore) -> None:
    theirs = setup_locked_owner(shared)
    tokens = seq(300, 4)
    result = shared.store(tokens, kv(shared, tokens, 0.75), tenant="a")
    assert result.stored_tokens == 4 * BT  # on host: gpu cannot make room for 4
    hit = shared.lookup(tokens, tenant="a")
    assert (hit.num_tokens, hit.host_tokens) == (4 * BT, 4 * BT)
    assert gpu_blocks(shared, "b") == 5
    loaded = shared.load(theirs, tenant="b")
    assert torch.equal(loaded.kv, kv(shared, theirs, 0.25))
    shared.check()
