"""Auditor Y's findings on the store's own paths, pinned.

- A load that meets a corrupt disk copy of a prefix a pending prefetch or a background insert
  pins serves the intact blocks before it and leaves the corrupt block to be dropped once
  nothing there is locked (it raised `AssertionError('dropping a leased block')`, and, when it
  had dropped an unlocked sibling first, leaked that sibling's disk slots: `check()` failed
  ever after).
- `lift_on_lookup` lifts a prefix only into free slots: it never drops or demotes a host block
  to stage the disk blocks it lifts (it dropped acknowledged blocks with no disk copy yet).
- Blocks a background insert lands after the store call returned count in the storing tenant's
  own `stored_tokens` as in the global one (only the global one grew); blocks that landed
  before the call's own reap are counted once, by the call (they were counted twice).

The stores run their background copies on a `SteppedExecutor`, so that the test decides when a
pinned flight lands; `check()` follows every step.
"""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import (
    DISK_HEADER_BYTES,
    DISK_SLOT_BYTES,
    disk_config,
    hit,
    kv_for,
    same,
    slab_headers,
)

from kvtier.config import KVTierConfig
from kvtier.results import LeaseState, StoreResult
from kvtier.store import KVStore
from kvtier.transfer import InlineExecutor
from kvtier.transfer.stepped import SteppedExecutor

S = list(range(100, 108))  # two blocks
SX = [*S, 201, 202, 203, 204]  # S and one block of its own
SY = [*S, 301, 302, 303, 304]


def on_disk_only(
    config: KVTierConfig, seqs: list[list[int]], tenants: tuple[str, ...] = ("default",)
) -> list[torch.Tensor]:
    """Store `seqs` (each with its own KV) for each of `tenants` with an inline mover, persist
    them and close: a store opened on the same disk then holds them on disk only. Returns their
    KVs."""
    store = KVStore(config)
    kvs = [kv_for(store, len(tokens), seed=i) for i, tokens in enumerate(seqs)]
    for tenant in tenants:
        for tokens, kv in zip(seqs, kvs, strict=True):
            store.store(tokens, kv, tenant=tenant)
            assert store.lookup(tokens, tenant=tenant).num_tokens == len(tokens)
    store.persist()
    store.close()
    return kvs


def stepped(path: Path, **kwargs: object) -> tuple[KVStore, SteppedExecutor]:
    """A store on the disk at `path` whose background copies run only when stepped."""
    executor = SteppedExecutor()
    config = disk_config(path, background=True, **kwargs)  # type: ignore[arg-type]
    return KVStore(config, executor=executor), executor


def corrupt(path: Path, block_tokens: list[int]) -> None:
    """Flip one payload byte of the disk copy of the block of `block_tokens`."""
    slot, _ = slab_headers(path)[tuple(block_tokens)]
    with open(path / "slab-00000.kvt", "r+b") as f:
        at = slot * DISK_SLOT_BYTES + DISK_HEADER_BYTES + 100
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x5A]))


def settle(store: KVStore, executor: SteppedExecutor) -> None:
    """Run every queued copy and publish it, until the store is idle."""
    for _ in range(50):
        executor.run_all()
        if store.drain(0):
            return
    raise AssertionError("the store did not become idle")


# ---- finding 1: a load meets a corrupt disk copy that a flight pins ---------------------------


def test_load_under_an_insert_flight_serves_the_head_and_drops_the_corrupt_block_later(
    tmp_path: Path,
) -> None:
    (kv,) = on_disk_only(disk_config(tmp_path), [S])
    corrupt(tmp_path, S[4:8])
    store, executor = stepped(tmp_path)
    try:
        # a store below the disk-only prefix: an insert flight pins S on disk until it lands
        result = store.store([*S, 9, 10, 11, 12], kv_for(store, 12, seed=5))
        assert result == StoreResult(8, 0, 0, 4)
        loaded = store.load(S)
        assert loaded.num_tokens == 4  # block 0 served; the corrupt block 1 never
        assert same(loaded.kv, kv[:, :, :4].to(loaded.kv.device))
        store.check()
        assert store.status()["mover"]["corrupt_pending_drop"] == 1
        assert store.lookup(S) == hit(disk=8)  # locked: still indexed, dropped later
        settle(store, executor)  # the insert lands; then nothing locks block 1
        store.check()
        assert store.lookup([*S, 9, 10, 11, 12]) == hit(disk=4)  # block 1 and below: gone
        assert store.status()["ops"]["corrupt_dropped"] == 1
        assert store.status()["mover"]["corrupt_pending_drop"] == 0
        assert store.load(S).num_tokens == 4
        store.check()
    finally:
        store.close()


def test_load_under_a_pending_prefetch_of_one_branch_leaks_no_slot_of_the_other(
    tmp_path: Path,
) -> None:
    # S's block 1 has two subtrees below it, SX and SY; a pending prefetch locks SY's path.
    # The old drop cut SX first, then asserted on SY: SX's disk slot was never freed.
    on_disk_only(disk_config(tmp_path), [SX, SY])
    corrupt(tmp_path, S[4:8])
    store, executor = stepped(tmp_path)
    try:
        lease = store.prefetch(SY, wait=False)
        state = lease.state
        assert state is LeaseState.PENDING
        assert store.load(S).num_tokens == 4
        store.check()
        assert store.lookup(SX) == hit(disk=12)  # nothing dropped while SY is locked
        used = store.status()["tiers"]["disk"]["used_bytes"]
        settle(store, executor)  # the prefetch reads block 1, fails; then the drop runs
        assert lease.state is LeaseState.FAILED
        store.check()
        assert store.lookup(SX) == hit(disk=4)
        assert store.lookup(SY) == hit(disk=4)
        assert store.status()["ops"]["corrupt_dropped"] == 1
        # block 1 and its two children are gone from disk, their slots free
        assert store.status()["tiers"]["disk"]["used_bytes"] < used
    finally:
        store.close()


# ---- finding 2: a lift drops nothing ----------------------------------------------------------


def lift_store(path: Path) -> tuple[KVStore, SteppedExecutor]:
    """write_through, `lift_on_lookup`, gpu and host of 8 blocks: S on disk only, and four
    prompts of 2 blocks stored since (their host copies not written to disk: nothing steps the
    writes), then gpu emptied."""
    on_disk_only(disk_config(path), [S])
    executor = SteppedExecutor()
    base = disk_config(path, background=True, gpu_blocks=8, host_blocks=8, write="write_through")
    mover = base.mover.model_copy(update={"lift_on_lookup": True})
    config = base.model_copy(update={"mover": mover})
    store = KVStore(config, executor=executor)
    for i in range(4):
        tokens = list(range(1000 + 100 * i, 1008 + 100 * i))
        assert store.store(tokens, kv_for(store, 8, seed=i)).stored_tokens == 8
    assert store.evict("gpu", 8) == 8
    return store, executor


def lift_now(store: KVStore) -> None:
    """One round of the mover's work, as its thread runs it after a lookup."""
    with store.parts.state.lock:
        store.mover.step()


def test_a_lift_never_drops_host_blocks_to_stage_disk_blocks(tmp_path: Path) -> None:
    store, executor = lift_store(tmp_path)
    try:
        store.check()
        assert store.index.num_blocks == 10
        assert store.lookup(S) == hit(disk=8)
        lift_now(store)
        store.check()
        assert store.index.num_blocks == 10  # the four prompts all kept
        assert store.status()["mover"]["backpressure_drops"] == 0
        assert store.status()["mover"]["lifted_blocks"] == 0  # no free host slot: skipped
        # the caller frees two host slots (an eviction it asks for): now S fits, and is lifted
        assert store.evict("host", 2) == 2
        store.check()
        kept = store.index.num_blocks
        assert store.lookup(S) == hit(disk=8)
        lift_now(store)
        settle(store, executor)
        store.check()
        assert store.status()["mover"]["lifted_blocks"] == 2
        assert store.lookup(S) == hit(gpu=8)
        assert store.index.num_blocks == kept
    finally:
        store.close()


# ---- finding 3: blocks that land after the call count for their tenant ------------------------


def test_blocks_landing_after_the_call_count_in_each_tenants_stored_tokens(
    tmp_path: Path,
) -> None:
    tenants = ("a", "b")
    on_disk_only(disk_config(tmp_path, capacity="2MiB", tenants=tenants), [S], tenants)
    store, executor = stepped(tmp_path, capacity="2MiB", tenants=tenants)
    try:
        assert store.lookup(S, tenant="a") == hit(disk=8)
        assert store.lookup(S, tenant="b") == hit(disk=8)
        before = {t: store.status(t)["ops"]["stored_tokens"] for t in tenants}
        total = store.status()["ops"]["stored_tokens"]
        a = store.store([*S, *range(900, 908)], kv_for(store, 16, seed=1), tenant="a")
        b = store.store([*S, *range(950, 954)], kv_for(store, 12, seed=2), tenant="b")
        assert (a.pending_tokens, b.pending_tokens) == (8, 4)
        store.check()
        settle(store, executor)
        store.check()
        assert store.lookup([*S, *range(900, 908)], tenant="a") == hit(disk=16)
        assert store.status()["ops"]["stored_tokens"] == total + 12
        assert store.status("a")["ops"]["stored_tokens"] == before["a"] + 8
        assert store.status("b")["ops"]["stored_tokens"] == before["b"] + 4
    finally:
        store.close()


def test_blocks_landing_before_the_calls_own_reap_are_counted_once(tmp_path: Path) -> None:
    # an executor that completes each copy as it is submitted: the insert flight's disk write
    # is done before the call's reap, which publishes it inside the call (a fast disk); the
    # call counted its stored tokens and `publish_insert` counted them again
    on_disk_only(disk_config(tmp_path), [S])
    store = KVStore(disk_config(tmp_path, background=True), executor=InlineExecutor())
    try:
        before = store.status()["ops"]["stored_tokens"], store.status("default")["ops"]
        result = store.store([*S, 9, 10, 11, 12], kv_for(store, 12, seed=5))
        assert result.stored_tokens + result.pending_tokens == 4
        assert store.drain()
        store.check()
        assert store.status()["ops"]["stored_tokens"] - before[0] == 4
        assert store.status("default")["ops"]["stored_tokens"] - before[1]["stored_tokens"] == 4
        assert store.lookup([*S, 9, 10, 11, 12]).num_tokens == 12
    finally:
        store.close()
