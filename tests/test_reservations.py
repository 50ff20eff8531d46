"""Reservations publish only what their writer wrote; ids tell nothing (DESIGN invariant 8,
issue 11 points 1, 2 and 4), in process: the store, its pools and a fake clock.

The tiny layout (conftest): fp32, 4 tokens and 512 bytes a block, so one canary a slot; the
canary tests of several pages use a pool of their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from conftest import hit, kv_for, same, tier

from kvtier.blocks import KVLayout, fresh_id, to_blocks
from kvtier.canaries import PAGE_BYTES, Canaries
from kvtier.config import parse_config
from kvtier.errors import InvariantError, LeaseError, NotWrittenError
from kvtier.results import Reservation, StoreResult
from kvtier.store import KVStore
from kvtier.tiers.base import GPU
from kvtier.tiers.pool import SlotPool

MakeStore = Callable[..., KVStore]
BT = 4
CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


def seq(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + num_tokens))


def write(store: KVStore, reservation: Reservation, kv: torch.Tensor) -> None:
    """What a zero-copy writer does: every new block whole into its slot of the mapped pool."""
    pool = store.gpu_pool if reservation.tier == "gpu" else store.host_pool
    start = reservation.cached_tokens
    blocks = to_blocks(kv[:, :, start : start + reservation.num_tokens], BT)
    pool.buffer[list(reservation.slots)] = blocks


# ---- point 1: a commit of unwritten slots publishes nothing -----------------------------------


def test_a_commit_without_writing_is_refused_and_never_serves_the_slots_old_bytes(
    make_store: MakeStore,
) -> None:
    store = make_store(gpu_blocks=4, host_blocks=4, tenants=("a", "b"))
    secret = kv_for(store, 16, seed=1)
    assert store.store(seq(0, 16), secret, tenant="a") == StoreResult(16, 16, 0)
    # b's reservation takes 2 slots of each tier: LRU demotes a's last 2 blocks from gpu and
    # drops them from host; their bytes stay in the slots that b now holds
    reservation = store.reserve(seq(500, 8), tenant="b")
    assert (reservation.num_tokens, reservation.tier) == (8, "gpu")
    assert store.lookup(seq(0, 16), tenant="a") == hit(gpu=8)
    before = (store.index.num_blocks, tier(store, "gpu")["free_slots"])
    with pytest.raises(NotWrittenError, match=f"reservation {reservation.reservation_id}: slots"):
        store.commit(reservation)
    # nothing published, nothing freed: the reservation stays live for its writer
    assert store.lookup(seq(500, 8), tenant="b") == hit()
    assert store.load(seq(500, 8), tenant="b").num_tokens == 0
    assert store.reservation(reservation.reservation_id, tenant="b") == reservation
    assert (store.index.num_blocks, tier(store, "gpu")["free_slots"]) == before == (2, 0)
    store.check()
    own = kv_for(store, 8, seed=2)
    write(store, reservation, own)
    assert store.commit(reservation) == StoreResult(8, 8, 0)
    loaded = store.load(seq(500, 8), tenant="b")
    assert loaded.num_tokens == 8 and same(loaded.kv, own)
    store.check()


def test_a_block_written_in_part_is_refused_by_name_and_the_rest_can_follow(
    make_store: MakeStore,
) -> None:
    store = make_store(gpu_blocks=8, host_blocks=16)
    kv = kv_for(store, 12, seed=3)
    reservation = store.reserve(seq(0, 12))
    first, second, third = reservation.slots
    blocks = to_blocks(kv, BT)
    store.gpu_pool.buffer[[first, third]] = blocks[[0, 2]]
    with pytest.raises(NotWrittenError, match=rf"slots \[{second}\] of tier 'gpu'"):
        store.commit(reservation)
    store.gpu_pool.buffer[second] = blocks[1]
    assert store.commit(reservation) == StoreResult(12, 12, 0)
    assert same(store.load(seq(0, 12)).kv, kv)
    assert tier(store, "host")["blocks"] == 3  # write_through copied what was written
    store.check()


def test_an_abort_after_a_refused_commit_frees_the_slots_at_once(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=4, host_blocks=8)
    reservation = store.reserve(seq(0, 8))
    with pytest.raises(NotWrittenError):
        store.commit(reservation)
    store.abort(reservation)
    assert tier(store, "gpu")["free_slots"] == 4 and tier(store, "host")["free_slots"] == 8
    with pytest.raises(LeaseError, match="unknown, committed, aborted or expired"):
        store.commit(reservation)
    store.check()


LAYOUT = KVLayout(
    "pages", num_layers=2, num_kv_heads=2, head_dim=136, dtype_name="float32", block_tokens=4
)  # 17408 bytes a block: 4 whole pages and a quarter of one


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("page", range(5))
def test_a_canary_in_every_page_catches_any_one_page_left_unwritten(page: int, device: str) -> None:
    pool = SlotPool("gpu", LAYOUT, 4, torch.device(device))
    slots = pool.allocate(3)
    canaries = Canaries(pool, slots[1:])
    assert canaries.unwritten() == slots[1:]
    flat = pool.buffer.view(-1).view(torch.uint8)
    block = LAYOUT.block_bytes
    data = torch.randint(0, 256, (2 * block,), dtype=torch.uint8, device=device)
    start = slots[1] * block
    assert slots[2] == slots[1] + 1  # a fresh pool hands out 0, 1, 2: the two slots are adjacent
    skip = block + page * PAGE_BYTES  # this page of the second slot stays as it was
    flat[start : start + skip] = data[:skip]
    flat[start + skip + PAGE_BYTES : start + 2 * block] = data[skip + PAGE_BYTES :]
    assert canaries.unwritten() == [slots[2]]
    flat[start : start + 2 * block] = data
    assert canaries.unwritten() == []


def test_canaries_are_fresh_for_every_reservation_and_fit_a_block_under_8_bytes() -> None:
    pool = SlotPool("gpu", LAYOUT, 2, torch.device("cpu"))
    (slot,) = pool.allocate(1)
    Canaries(pool, [slot])
    first = pool.buffer[slot].clone()
    Canaries(pool, [slot])
    assert not torch.equal(pool.buffer[slot], first)  # another word, or the same at another place
    small = KVLayout("small", 1, 1, 1, "float16", 1)  # 4 bytes a block
    tiny_pool = SlotPool("host", small, 3, torch.device("cpu"))
    tiny_slots = tiny_pool.allocate(3)
    canaries = Canaries(tiny_pool, tiny_slots)
    assert canaries.unwritten() == tiny_slots
    tiny_bytes = tiny_pool.buffer.view(-1).view(torch.uint8)
    tiny_bytes[tiny_slots[0] * 4 : tiny_slots[0] * 4 + 4] ^= 0xFF  # every byte changes
    assert canaries.unwritten() == tiny_slots[1:]


# ---- point 2: late writers write into quarantine ---------------------------------------------


def test_an_expired_reservations_slots_are_quarantined_so_a_late_writer_harms_no_one(
    make_store: MakeStore,
) -> None:
    now = [100.0]
    store = make_store(gpu_blocks=4, host_blocks=8, tenants=("a", "b"), clock=lambda: now[0])
    late = store.reserve(seq(900, 8), tenant="b", ttl_s=5)
    now[0] += 5
    with pytest.raises(LeaseError):
        store.commit(late)  # commit after expiry fails
    kvs = [kv_for(store, 8, seed=10 + i) for i in range(2)]
    for i, kv in enumerate(kvs):
        assert store.store(seq(100 * i, 8), kv, tenant="a") == StoreResult(8, 8, 0)
    # the late writer, still holding the pool, writes its blocks now
    store.gpu_pool.buffer[list(late.slots)] = to_blocks(kv_for(store, 8, seed=99), BT)
    for i, kv in enumerate(kvs):
        loaded = store.load(seq(100 * i, 8), tenant="a")
        assert loaded.num_tokens == 8 and same(loaded.kv, kv)
    assert store.lookup(seq(900, 8), tenant="b") == hit()
    gpu = tier(store, "gpu")
    assert (store.reservations.quarantined(GPU), store.reservations.quarantined(GPU, "a")) == (2, 0)
    assert gpu["slots"] - gpu["free_slots"] == gpu["blocks"] + 2  # counted as used, exactly
    store.check()
    now[0] += store.config.policy.reservation_quarantine_s
    assert tier(store, "gpu")["free_slots"] == 4 - tier(store, "gpu")["blocks"]
    assert store.reservations.held(GPU) == 0
    store.check()


def test_check_verifies_the_reservation_table_against_the_pools(make_store: MakeStore) -> None:
    now = [0.0]
    store = make_store(gpu_blocks=4, host_blocks=8, clock=lambda: now[0])
    live = store.reserve(seq(0, 4), ttl_s=5)
    store.reserve(seq(100, 4), ttl_s=1)
    now[0] = 2.0
    assert tier(store, "gpu")["free_slots"] == 2  # the first expired here, into quarantine
    store.check()
    assert (store.reservations.live(GPU), store.reservations.quarantined(GPU)) == (1, 1)
    store.gpu_pool.free(list(live.slots))  # freed behind the table's back
    with pytest.raises(InvariantError, match=f"gpu slot {live.slots[0]} is free in the pool"):
        store.check()


# ---- point 4: ids count nothing and guess nothing --------------------------------------------


def _no_stride(ids: list[int]) -> None:
    assert len(set(ids)) == len(ids) and all(0 < i < 2**63 for i in ids)
    steps = {b - a for a, b in itertools.pairwise(ids)}
    assert len(steps) == len(ids) - 1  # no two gaps alike, so no counter behind them
    assert max(ids) >= 2**61  # spread over the whole range (odds of a miss: 4**-20)


def test_reservation_and_lease_ids_are_random(make_store: MakeStore) -> None:
    store = make_store(gpu_blocks=8, host_blocks=16)
    store.store(seq(0, 4), kv_for(store, 4))
    reservation_ids, lease_ids = [], []
    for _ in range(20):
        reservation = store.reserve(seq(0, 8))
        reservation_ids.append(reservation.reservation_id)
        store.abort(reservation)
        lease = store.prefetch(seq(0, 4))
        lease_ids.append(lease.lease_id)
        store.release(lease)
    _no_stride(reservation_ids)
    _no_stride(lease_ids)
    store.check()


def test_another_tenants_id_is_refused_exactly_like_one_never_issued(
    make_store: MakeStore,
) -> None:
    store = make_store(gpu_blocks=8, host_blocks=16, tenants=("a", "b"))
    store.store(seq(0, 4), kv_for(store, 4), tenant="a")
    reservation = store.reserve(seq(0, 8), tenant="a")
    lease = store.prefetch(seq(0, 4), tenant="a")
    never = fresh_id({reservation.reservation_id, lease.lease_id})

    def refusal(call: Callable[[int], object], own: int) -> str:
        with pytest.raises(LeaseError) as caught:
            call(own)
        return str(caught.value).replace(str(own), "<id>")

    assert refusal(lambda i: store.reservation(i, tenant="b"), reservation.reservation_id) == (
        refusal(lambda i: store.reservation(i, tenant="b"), never)
    )
    assert refusal(lambda i: store.lease(i, tenant="b"), lease.lease_id) == (
        refusal(lambda i: store.lease(i, tenant="b"), never)
    )
    assert store.reservation(reservation.reservation_id, tenant="a") == reservation  # untouched
    store.release(lease)
    store.abort(reservation)
    store.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_gpu_tier_refuses_an_unwritten_commit_and_publishes_a_written_one() -> None:
    tiny = {"name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32"}
    config = parse_config(
        {
            "model": tiny,
            "block_tokens": BT,
            "tiers": {"gpu": {"capacity": 8 * 512, "device": "cuda"}, "host": {"capacity": 8192}},
        }
    )
    with KVStore(config) as store:
        reservation = store.reserve(seq(0, 8))
        assert reservation.tier == "gpu" and store.gpu_pool.device.type == "cuda"
        with pytest.raises(NotWrittenError):
            store.commit(reservation)
        kv = kv_for(store, 8, seed=4)
        write(store, reservation, kv.to("cuda"))
        assert store.commit(reservation) == StoreResult(8, 8, 0)
        assert same(store.load(seq(0, 8), device="cpu").kv, kv)
        store.check()
