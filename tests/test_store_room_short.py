"""A store or reservation whose room-making falls short keeps what it moved a block for.

`Demoter.can_make_room` counts the copies of a tier that no lease holds, but `make_room` cannot
free all of them: a host copy of a block whose fastest copy is on gpu is a spare no victim pass
offers, and a gpu victim without a host copy needs room below that host may not have. A store
that passed the check then demoted (or dropped) blocks, found it still lacked room for all its
blocks and stored none: blocks lost for nothing, other tenants' among them (in 13 of 20 random
mixes of three tenants on gpu, host and disk, a `/tmp` driver; 0 of 60 now). Now it keeps the
room it made: its first blocks, as many as were freed, are stored (or reserved), the rest
counted dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, block_seq, salted_kv, tiny_block_bytes

from kvtier.blocks import to_blocks
from kvtier.config import parse_config
from kvtier.store import KVStore

BT = TINY_BLOCK_TOKENS
kv, seq = salted_kv, block_seq


def write_through(gpu_blocks: int, host_blocks: int) -> KVStore:
    """A store of the tiny layout: gpu and host tiers of these slots, write_through, no disk,
    an inline mover (every call's moves done when it returns)."""
    bb = tiny_block_bytes()
    config: dict[str, Any] = {
        "model": {**TINY_MODEL, "dtype": "float32"},
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": gpu_blocks * bb, "device": "cpu"},
            "host": {"capacity": host_blocks * bb, "pinned": False},
        },
        "policy": {"write": "write_through"},
        "mover": {"background": False},
    }
    return KVStore(parse_config(config))


def crowded() -> tuple[KVStore, list[int]]:
    """gpu 4 slots and host 4, write_through, one tenant: an older prompt lives on host only
    (2 blocks), a newer one on gpu with its host spares (2), leased there. Returns the older."""
    store = write_through(gpu_blocks=4, host_blocks=4)
    theirs, mine = seq(100, 2), seq(200, 2)
    store.store(theirs, kv(store, theirs, 0.5))
    store.store(mine, kv(store, mine, 0.25))
    assert store.evict("gpu", 2) == 2  # the older's: cleared, its host copy stays
    store.prefetch(mine, ttl_s=600)
    hit = store.lookup(theirs)
    assert (hit.num_tokens, hit.host_tokens) == (2 * BT, 2 * BT)
    store.check()
    return store, theirs


def test_a_store_short_of_room_keeps_the_blocks_it_made_room_for() -> None:
    store, theirs = crowded()
    tokens = seq(300, 3)  # gpu: 2 free, 2 leased; host: the older's 2 and 2 spares
    result = store.store(tokens, kv(store, tokens, 0.75))
    store.check()
    hit = store.lookup(theirs)
    assert (
        hit.num_tokens == 0
    )  # the older prompt's blocks went for room (LRU): the store must use it
    assert (result.stored_tokens, result.dropped_tokens) == (2 * BT, BT)
    loaded = store.load(tokens)
    assert loaded.num_tokens == 2 * BT
    assert torch.equal(loaded.kv, kv(store, tokens, 0.75)[:, :, : 2 * BT])
    store.close()


def test_a_reservation_short_of_room_reserves_the_blocks_it_made_room_for() -> None:
    store, theirs = crowded()
    tokens = seq(300, 3)
    reservation = store.reserve(tokens)
    store.check()
    assert store.lookup(theirs).num_tokens == 0
    assert (reservation.cached_tokens, reservation.num_tokens) == (0, 2 * BT)
    assert reservation.dropped_tokens == BT  # the commit's count, told at the reserve
    assert len(reservation.slots) == 2
    pool = store.gpu_pool if reservation.tier == "gpu" else store.host_pool
    pool.buffer[list(reservation.slots)] = to_blocks(kv(store, tokens, 0.75)[:, :, : 2 * BT], BT)
    result = store.commit(reservation)  # the block it had no room for: counted dropped
    assert (result.stored_tokens, result.dropped_tokens) == (2 * BT, BT)
    assert result.cached_tokens == 2 * BT
    assert store.status()["ops"]["dropped_tokens"] == BT
    store.check()
    loaded = store.load(tokens)
    assert torch.equal(loaded.kv, kv(store, tokens, 0.75)[:, :, : 2 * BT])
    store.close()


def test_a_write_through_copy_short_of_host_room_drops_no_host_block() -> None:
    """gpu 5 and host 4, no disk: one host-only block and three host copies of gpu blocks. A
    2-block store has gpu room; its host copies would need 2 host slots, and the one victim a
    pass offers frees 1: before, that block was dropped and no copy made; now nothing moves."""
    store = write_through(gpu_blocks=5, host_blocks=4)
    older, newer, tokens = seq(100, 1), seq(200, 3), seq(300, 2)
    store.store(older, kv(store, older, 0.5))
    store.store(newer, kv(store, newer, 0.25))
    assert store.evict("gpu", 1) == 1  # the older's: cleared, its host copy its only one
    store.check()
    result = store.store(tokens, kv(store, tokens, 0.75))
    store.check()
    assert result.stored_tokens == 2 * BT
    hit = store.lookup(older)
    assert (hit.num_tokens, hit.host_tokens) == (BT, BT)  # was 0: dropped for no copy
    assert torch.equal(store.load(older).kv, kv(store, older, 0.5))
    assert store.lookup(tokens).gpu_tokens == 2 * BT
    store.close()
