"""An outside audit of the embedded `KVStore`'s engine-facing API (its second): each test
fails on the code before its fix.

- A store whose copy into the slots fails with any error (not only `InvalidKVError`) frees the
  slots it took: `check()` passes after it, every slot is free again, nothing is indexed. A KV
  in memory no copy can read ("meta", sparse) is an `InvalidKVError` naming its device and
  what is expected, before a slot is taken.
- A reservation's commit is refused, every time, when its writer skipped any whole layer, or
  the K or the V half of one (`canaries.py`: a canary in every per-layer K and V segment of a
  slot besides one in every 4 KiB page): before, a block under 4 KiB had one canary, and a
  writer that wrote layer 0 only published the slot's previous occupant's layer 1 (another
  tenant's bytes) in about a quarter of the commits.
- A tenant that is not a str is an `InvalidArgumentError` naming it, on every method that
  takes one (a `TypeError` before).
- Bools are no token ids: a list of them is refused as a bool array is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import kv_for

from kvtier import KVStore
from kvtier.blocks import KVLayout
from kvtier.canaries import Canaries
from kvtier.errors import (
    InvalidArgumentError,
    InvalidKVError,
    InvalidTokensError,
    LeaseError,
    NotWrittenError,
)
from kvtier.tiers.pool import SlotPool

BT = 4


def _free_slots(store: KVStore) -> dict[str, int]:
    return {name: tier["free_slots"] for name, tier in store.status()["tiers"].items()}


# ---- 1. a failed copy keeps no slot ----------------------------------------------------


class _FailingCopy(torch.Tensor):
    """An engine's tensor whose data cannot be read (as a tensor of an unreachable device or a
    broken allocator would fail): every `copy_` from it raises a RuntimeError."""

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.Tensor.copy_:
            raise RuntimeError("the engine's memory cannot be read")
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_a_store_whose_copy_fails_frees_the_slots_it_took(
    make_store: Callable[..., KVStore], write: str
) -> None:
    store = make_store(write=write, background=False)
    before = _free_slots(store)
    tokens = list(range(100, 100 + 2 * BT))
    kv = kv_for(store, len(tokens)).as_subclass(_FailingCopy)
    with pytest.raises(RuntimeError, match="cannot be read"):
        store.store(tokens, kv)
    store.check()  # before: "gpu: 2 slots in use but 0 blocks resident", for good
    assert _free_slots(store) == before
    assert store.lookup(tokens).num_tokens == 0
    assert store.store(tokens, kv_for(store, len(tokens))).stored_tokens == 2 * BT
    store.check()


@pytest.mark.parametrize(
    "make_kv",
    [
        lambda shape: torch.empty(shape, device="meta"),
        lambda shape: torch.randn(shape).to_sparse(),
    ],
    ids=["meta", "sparse"],
)
@pytest.mark.parametrize("layout", ["layers", "blocks"])
def test_kv_in_memory_no_copy_can_read_is_an_invalid_kv_error_before_a_slot_is_taken(
    make_store: Callable[..., KVStore], make_kv: Callable[..., torch.Tensor], layout: str
) -> None:
    store = make_store(background=False)
    before = _free_slots(store)
    tokens = list(range(200, 200 + 2 * BT))
    shape = (2, 2, 2 * BT, 2, 4) if layout == "layers" else (2, 2, 2, BT, 2, 4)
    kv = make_kv(shape)
    with pytest.raises(InvalidKVError, match=f"{kv.device.type}.*expected a strided") as err:
        store.store(tokens, kv, layout=layout)
    assert "'cpu' or 'cuda'" in str(err.value)
    store.check()
    assert _free_slots(store) == before
    # and as a load's destination: refused before anything is leased or read
    store.store(tokens, kv_for(store, len(tokens)))
    with pytest.raises(InvalidKVError, match="out: got a tensor on device"):
        store.load(tokens, out=make_kv(shape), layout=layout)
    store.check()
    assert store.leases() == []


# ---- 2. a writer that skipped a layer is refused, always ----------------------------------


def _reserve_over_old_bytes(store: KVStore, base: int) -> Any:
    """A reservation of tenant a whose slot held tenant b's block (of -999s) before."""
    old = torch.full((2, 2, 2 * BT, 2, 4), -999.0)  # every gpu slot
    assert store.store(list(range(base, base + 2 * BT)), old, tenant="b").stored_tokens == 2 * BT
    store.evict("gpu", 100)
    store.evict("host", 100)
    reservation = store.reserve(list(range(base + 50, base + 50 + BT)), tenant="a")
    assert reservation.tier == "gpu" and len(reservation.slots) == 1
    assert bool((store.gpu_pool.buffer[reservation.slots[0]] == -999.0).any())  # b's bytes
    return reservation


def test_a_writer_that_wrote_layer_0_only_never_publishes_the_old_occupants_layer_1(
    make_store: Callable[..., KVStore],
) -> None:
    # scratch/partial.py: before, ~25% of such commits passed and loaded tenant b's values
    store = make_store(gpu_blocks=2, host_blocks=2, tenants=("a", "b"), background=False)
    for trial in range(60):
        reservation = _reserve_over_old_bytes(store, 1000 + 100 * trial)
        (slot,) = reservation.slots
        store.gpu_pool.buffer[slot, 0] = 1.0  # layer 0, K and V: the engine stopped there
        with pytest.raises(NotWrittenError):
            store.commit(reservation)
        store.abort(reservation)
    store.check()


SMOLLM2 = KVLayout("smol", num_layers=30, num_kv_heads=3, head_dim=64, dtype_name="bfloat16",
                   block_tokens=16)  # fmt: skip


@pytest.mark.parametrize(
    "layout",
    [
        SMOLLM2,  # 6 KiB segments across 4 KiB pages
        KVLayout("tiny", 2, 2, 4, "float32", 4),  # a 256-byte block: 4 segments of 64 bytes
        KVLayout("odd", 3, 1, 3, "float16", 1),  # 6-byte segments, narrower than a word
        KVLayout("one", 2, 1, 1, "float8_e4m3fn", 1),  # 1-byte segments
        KVLayout("wide", 2, 8, 128, "float16", 16),  # 32 KiB segments of whole pages
    ],
    ids=lambda layout: layout.model_name,
)
def test_every_layer_and_k_or_v_half_left_unwritten_is_found(layout: KVLayout) -> None:
    pool = SlotPool("gpu", layout, 4, torch.device("cpu"))
    slots = pool.allocate(3)
    segment = layout.block_bytes // (2 * layout.num_layers)
    rows = pool.buffer.view(pool.num_slots, -1).view(torch.uint8)

    def write(slot: int, begin: int, end: int) -> None:
        """Every byte changed (so every canary there, whatever its width, is overwritten)."""
        rows[slot, begin:end] = torch.bitwise_not(rows[slot, begin:end])

    for layer in range(layout.num_layers):
        for half in range(2):
            canaries = Canaries(pool, slots)
            skipped = (2 * layer + half) * segment
            for slot in slots:  # the writer writes every byte but one segment of slot 1
                if slot == slots[1]:
                    write(slot, 0, skipped)
                    write(slot, skipped + segment, layout.block_bytes)
                else:
                    write(slot, 0, layout.block_bytes)
            assert canaries.unwritten() == [slots[1]], (layer, half)
    canaries = Canaries(pool, slots)
    for slot in slots:
        write(slot, 0, layout.block_bytes)
    assert canaries.unwritten() == []
    pool.free(slots)


def test_a_writer_that_wrote_every_layer_commits_and_loads_its_own_bytes(
    make_store: Callable[..., KVStore],
) -> None:
    store = make_store(gpu_blocks=2, host_blocks=2, tenants=("a", "b"), background=False)
    reservation = _reserve_over_old_bytes(store, 5000)
    (slot,) = reservation.slots
    store.gpu_pool.buffer[slot] = 1.0
    assert store.commit(reservation).stored_tokens == BT
    loaded = store.load(list(range(5050, 5050 + BT)), tenant="a").kv
    assert bool((loaded == 1.0).all())
    store.check()


# ---- 3. typed errors for the tenant and for bool token ids -------------------------------


TENANT_CALLS: dict[str, Callable[[KVStore, Any], object]] = {
    "lookup": lambda s, t: s.lookup([1, 2, 3, 4], tenant=t),
    "store": lambda s, t: s.store([1, 2, 3, 4], kv_for(s, 4), tenant=t),
    "load": lambda s, t: s.load([1, 2, 3, 4], tenant=t),
    "prefetch": lambda s, t: s.prefetch([1, 2, 3, 4], tenant=t),
    "reserve": lambda s, t: s.reserve([1, 2, 3, 4], tenant=t),
    "lease": lambda s, t: s.lease(1, tenant=t),
    "reservation": lambda s, t: s.reservation(1, tenant=t),
    "clear": lambda s, t: s.clear(t),
    "reset": lambda s, t: s.reset(t),
    "status": lambda s, t: s.status(t),
}


@pytest.mark.parametrize("call", sorted(TENANT_CALLS))
@pytest.mark.parametrize("tenant", [5, ["a"], b"default", 1.5])
def test_a_tenant_that_is_not_a_str_is_an_invalid_argument_naming_it(
    make_store: Callable[..., KVStore], call: str, tenant: object
) -> None:
    store = make_store(background=False)
    store.store(list(range(10, 10 + BT)), kv_for(store, BT))
    with pytest.raises(InvalidArgumentError, match=f"tenant: got {tenant!r}".replace("[", r"\[")):
        TENANT_CALLS[call](store, tenant)
    store.check()
    assert store.lookup(list(range(10, 10 + BT))).num_tokens == BT


@pytest.mark.parametrize("call", ["lookup", "store", "load", "prefetch", "reserve", "reset"])
def test_tenant_none_is_an_invalid_argument_where_a_tenant_is_required(
    make_store: Callable[..., KVStore], call: str
) -> None:
    store = make_store(background=False)
    with pytest.raises(InvalidArgumentError, match="tenant: got None"):
        TENANT_CALLS[call](store, None)
    store.check()


def test_release_of_an_id_past_64_bits_is_a_lease_error(
    make_store: Callable[..., KVStore],
) -> None:
    store = make_store(background=False)
    with pytest.raises(LeaseError):
        store.release(2**64)


@pytest.mark.parametrize(
    "tokens", [[True, False, True, True], [1, 2, True, 4], (7, 8, 9, False)], ids=str
)
def test_bool_token_ids_are_refused_as_a_bool_array_is(
    make_store: Callable[..., KVStore], tokens: Any
) -> None:
    store = make_store(background=False)
    with pytest.raises(InvalidTokensError, match="bool"):
        store.lookup(np.array([True, False, True, True]))
    for call in (
        lambda: store.lookup(tokens),
        lambda: store.store(tokens, kv_for(store, 4)),
        lambda: store.load(tokens),
        lambda: store.prefetch(tokens),
        lambda: store.reserve(tokens),
    ):
        with pytest.raises(InvalidTokensError, match=r"tokens\[\d\]: got (True|False) \(bool\)"):
            call()
    assert store.lookup([1, 0, 1, 1]).num_tokens == 0  # the ints 0 and 1 are ids
    store.check()
