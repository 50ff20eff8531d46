"""The background mover (`transfer/mover.py`) through the store. Where a test needs copies in
flight, the store's executor is a `SteppedExecutor`: a copy runs only when the test steps it, so
the test submits, observes the in-flight state, steps, and observes the result (the mover's
thread publishes what a step completed: wait for the lease, or `drain_stepping`).

Ordering: a lease is never READY before its copies completed, `layers_ready` never runs ahead of
the bytes in the slots, and the index learns of a copy only when it is complete. Joins, cancel,
expiry, `await`, corruption, backpressure, background demotion to a real disk, and writes below
a disk-only prefix.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import (
    DISK_BLOCK_BYTES,
    DISK_BLOCK_TOKENS,
    DISK_HEADER_BYTES,
    DISK_SLOT_BYTES,
    build_store,
    disk_config,
    hit,
    kv_for,
    leased_kv,
    same,
    slab_headers,
    tier,
)

from kvtier.blocks import to_blocks
from kvtier.config import KVTierConfig
from kvtier.errors import CapacityError, LeaseError
from kvtier.results import LeaseState
from kvtier.store import KVStore
from kvtier.transfer.copy import RECENT_TRANSFERS, Ledger
from kvtier.transfer.stepped import SteppedExecutor

BLOCK = 512  # bytes of a tiny float32 block (conftest.build_store)


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


Stepped = list[tuple[KVStore, SteppedExecutor]]
"""Stores whose background copies wait for the test to step them, closed after the test."""


def stepped_store(made: Stepped, **kwargs: object) -> tuple[KVStore, SteppedExecutor]:
    """A tiny store (closed after the test) whose background copies run only when stepped."""
    store = build_store(**kwargs)  # type: ignore[arg-type]
    config = store.config
    store.close()
    executor = SteppedExecutor()
    store = KVStore(config, executor=executor)
    made.append((store, executor))
    return store, executor


def hosted(
    made: Stepped, n_tokens: int, **kwargs: object
) -> tuple[KVStore, SteppedExecutor, list[int], torch.Tensor]:
    """A `stepped_store` holding tokens 0..n_tokens-1 on host only."""
    store, executor = stepped_store(made, **kwargs)
    tokens, kv = seq(0, n_tokens), kv_for(store, n_tokens)
    on_host(store, tokens, kv)
    return store, executor, tokens, kv


def drain_stepping(store: KVStore, executor: SteppedExecutor) -> None:
    """Step every queued copy and publish it (`store.drain`), in turn until the store is idle:
    a drain may plan more copies (demotions over a watermark)."""
    for _ in range(100):
        executor.run_all()
        if store.drain(0):
            return
    pytest.fail("the store was not idle after 100 rounds of stepping and draining")


@contextmanager
def stepping(executor: SteppedExecutor) -> Iterator[None]:
    """Step `executor` on another thread while the block runs: for a call that waits on copies
    (a prefetch that waits), when the test has nothing to observe in flight."""
    stop = threading.Event()

    def step_until_stopped() -> None:
        while not stop.wait(0.001):
            executor.run_all()

    stepper = threading.Thread(target=step_until_stopped)
    stepper.start()
    try:
        yield
    finally:
        stop.set()
        stepper.join()


def close_stepping(store: KVStore, executor: SteppedExecutor) -> None:
    """Close `store` on another thread while stepping its copies: close waits for them."""
    closer = threading.Thread(target=store.close)
    closer.start()
    while closer.is_alive():
        executor.run_all()
        closer.join(0.001)


def on_host(store: KVStore, tokens: list[int], kv: torch.Tensor) -> None:
    """Store `tokens`, then push their blocks off the gpu (write_through keeps host copies)."""
    store.store(tokens, kv)
    assert store.evict("gpu", len(tokens) // 4) == len(tokens) // 4
    assert store.lookup(tokens) == hit(host=len(tokens))


def on_disk_only(store: KVStore, tokens: list[int], kv: torch.Tensor) -> None:
    """Store `tokens` durably, then push them off both memory tiers with two other prompts of
    the same length (their disk copies stay)."""
    store.store(tokens, kv)
    store.persist()
    for s in range(1, 3):
        store.store(seq(1000 * s, len(tokens)), kv_for(store, len(tokens), seed=10 + s))
    assert store.lookup(tokens) == hit(disk=len(tokens))


@pytest.fixture
def stores() -> Iterator[list[KVStore]]:
    made: list[KVStore] = []
    yield made
    for store in made:
        store.close()


@pytest.fixture
def stepped() -> Iterator[Stepped]:
    made: Stepped = []
    yield made
    for store, executor in made:
        close_stepping(store, executor)


def test_a_pending_lease_is_ready_only_after_its_copies_and_layers_never_run_ahead(
    stepped: Stepped,
) -> None:
    store, executor = stepped_store(stepped, gpu_blocks=8, host_blocks=16, layer_groups=2)
    tokens, kv = seq(0, 32), kv_for(store, 32)  # 8 blocks, two layer groups: two copies
    on_host(store, tokens, kv)
    lease = store.prefetch(tokens, wait=False)
    assert lease.state is LeaseState.PENDING and not lease.ready()
    assert len(lease.block_table) == 8 and lease.layers_ready == 0
    assert store.lookup(tokens) == hit(host=32)  # the index knows nothing of the copies yet
    store.check()
    want = kv.reshape(2, 2, 8, 4, 2, 4).permute(2, 0, 1, 3, 4, 5)  # [block, layer, kv, ...]
    seen = []
    assert executor.queued() == 2
    while executor.queued():
        layers = lease.layers_ready  # read first: the slots must already hold these layers
        slots = store.gpu_pool.buffer[list(lease.block_table)]
        assert same(slots[:, :layers], want[:, :layers]), f"layer < {layers} read before copied"
        seen.append(layers)
        assert not lease.ready(), f"ready with {executor.queued()} of its copies not run"
        assert executor.step() == 1
        assert lease.wait_layer(len(seen) - 1, timeout=10)
    assert seen == [0, 1], f"layer 0 was never ready alone: {seen}"
    assert lease.wait(10) and lease.layers_ready == 2
    assert same(leased_kv(store, lease), kv)
    assert store.lookup(tokens) == hit(gpu=32)
    store.check()
    assert store.status()["mover"]["prefetch_to_ready_s"]["count"] == 1
    store.release(lease)
    store.check()


def test_wait_layer_returns_as_soon_as_that_layer_is_in(stepped: Stepped) -> None:
    store, executor, tokens, kv = hosted(stepped, 32, gpu_blocks=8, host_blocks=16, layer_groups=2)
    lease = store.prefetch(tokens, wait=False)
    assert not lease.wait_layer(0, timeout=0.01)  # nothing copied yet
    assert executor.step() == 1  # layer group 0
    assert lease.wait_layer(0, timeout=10)
    assert not lease.ready(), "layer 0 came with the whole lease: no layer-by-layer progress"
    first = store.gpu_pool.buffer[list(lease.block_table), 0]
    assert same(first, kv[0].reshape(2, 8, 4, 2, 4).permute(1, 0, 2, 3, 4))
    assert executor.step() == 1
    assert lease.wait(10) and lease.wait_layer(1, timeout=0)
    with pytest.raises(Exception, match="layer"):
        lease.wait_layer(2)
    store.release(lease)


def test_a_second_prefetch_joins_the_copies_in_flight(stepped: Stepped) -> None:
    store, executor, tokens, kv = hosted(stepped, 32, gpu_blocks=8, host_blocks=16)
    short = store.prefetch(tokens[:16], wait=False)
    full = store.prefetch(tokens, wait=False)  # joins blocks 0-3, copies 4-7 itself
    again = store.prefetch(tokens, wait=False)  # joins everything
    assert full.block_table[:4] == short.block_table and again.block_table == full.block_table
    store.check()
    executor.run_all()
    for lease in (short, full, again):
        assert lease.wait(10)
    assert same(leased_kv(store, full), kv)
    assert store.status()["paths"]["host->gpu"]["bytes"] == 8 * BLOCK, "a block moved twice"
    assert store.status()["mover"]["joined_prefetches"] == 2
    for lease in (short, full, again):
        store.release(lease)
    store.check()


def test_cancel_ends_the_lease_and_the_copies_still_land(stepped: Stepped) -> None:
    store, executor, tokens, _ = hosted(stepped, 16, gpu_blocks=8, host_blocks=16)
    lease = store.prefetch(tokens, wait=False)
    assert executor.queued() > 0  # the copies are still to run
    lease.cancel()
    assert lease.state is LeaseState.CANCELLED
    with pytest.raises(LeaseError, match="cancelled"):
        lease.wait(1)
    with pytest.raises(LeaseError):
        store.release(lease)
    assert store.leases() == []
    drain_stepping(store, executor)
    assert store.lookup(tokens) == hit(gpu=16)  # promoted, unleased: ordinary gpu copies
    assert tier(store, "gpu")["leased_blocks"] == 0
    store.check()


def test_a_pending_lease_expires_and_its_waiters_wake(stepped: Stepped) -> None:
    store, _, tokens, _ = hosted(stepped, 32, gpu_blocks=8, host_blocks=16)
    lease = store.prefetch(tokens, wait=False, ttl_s=0.2)  # its copies are never stepped
    started = time.monotonic()
    with pytest.raises(LeaseError, match="expired"):
        lease.wait(10)  # nobody calls the store: the mover thread expires it
    assert time.monotonic() - started < 2.0
    assert lease.state is LeaseState.EXPIRED and store.leases() == []
    store.check()


def test_await_a_lease_from_asyncio(stepped: Stepped) -> None:
    store, executor, tokens, kv = hosted(stepped, 16, gpu_blocks=8, host_blocks=16)

    async def main() -> tuple[bool, bool]:
        lease = store.prefetch(tokens, wait=False)
        stepper = threading.Timer(0.1, executor.run_all)  # the copies land 0.1 s from now
        stepper.start()
        ticks = 0

        async def ticker() -> None:  # the loop keeps running while the lease is awaited
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        assert (await lease) is lease
        task.cancel()
        stepper.join()
        # a cancelled awaiter leaves nothing behind
        other = store.prefetch(seq(100, 4), wait=False)
        waiter = asyncio.create_task(asyncio.wait_for(other.wait_async(), 0))
        with pytest.raises(asyncio.TimeoutError):
            await waiter
        store.release(other)
        return lease.ready() and same(leased_kv(store, lease), kv), ticks > 5

    ready, ticked = asyncio.run(main())
    assert ready and ticked
    store.check()


def test_prefetch_refuses_at_once_when_gpu_cannot_hold_the_prefix(stepped: Stepped) -> None:
    store, executor = stepped_store(stepped, gpu_blocks=4, host_blocks=16)
    tokens, kv = seq(0, 32), kv_for(store, 32)
    store.store(tokens, kv)  # 8 blocks: 4 on gpu at most, the rest on host
    with stepping(executor):
        held = store.prefetch(seq(0, 16))
    with pytest.raises(CapacityError, match="prefetch"):  # nothing steps: no wait on copies
        store.prefetch(tokens, wait=False)
    store.check()
    assert [lease.lease_id for lease in store.leases()] == [held.lease_id]
    store.release(held)


def store_wait(config: KVTierConfig, seconds: float) -> KVTierConfig:
    """`config` with `mover.store_wait_s` set."""
    mover = config.mover.model_copy(update={"store_wait_s": seconds})
    return config.model_copy(update={"mover": mover})


def slow_disk_config(path: Path) -> KVTierConfig:
    """gpu 4 and host 8 blocks, host's watermarks (0.5, 0.25), a background mover."""
    return disk_config(
        path, gpu_blocks=4, host_blocks=8, background=True, host_watermarks=(0.5, 0.25)
    )


def test_store_never_waits_on_a_slow_disk(tmp_path: Path, stepped: Stepped) -> None:
    """Host over its watermark with a disk path that copies nothing until stepped, and
    `store_wait_s: 0`: store() returns at memory speed; what the tiers cannot take is dropped
    and counted, and everything that stays is intact."""
    config = store_wait(slow_disk_config(tmp_path / "disk"), 0.0)
    executor = SteppedExecutor()
    store = KVStore(config, executor=executor)
    stepped.append((store, executor))
    kvs = {}
    started = time.monotonic()
    for s in range(12):  # 24 blocks into 12 memory slots; the disk takes none until stepped
        tokens = seq(1000 * s, 8)
        kvs[s] = kv_for(store, 8, seed=s)
        store.store(tokens, kvs[s])
        store.check()
    elapsed = time.monotonic() - started
    assert elapsed < 1.0, f"12 stores took {elapsed:.2f} s: store() waited on the disk"
    status = store.status()
    assert status["mover"]["backpressure_drops"] + status["tiers"]["host"]["evictions"] > 0
    drain_stepping(store, executor)
    store.check()
    on_disk = 0
    for s, kv in kvs.items():
        loaded = store.load(seq(1000 * s, 8))
        assert same(loaded.kv, kv[:, :, : loaded.num_tokens])
        on_disk += store.lookup(seq(1000 * s, 8)).disk_tokens
    assert on_disk > 0, "the background mover wrote nothing to disk"


def test_a_store_waits_for_a_disk_that_is_behind_at_most_store_wait_s(
    tmp_path: Path, stepped: Stepped
) -> None:
    """The disk copies nothing until stepped: once host holds more unwritten blocks than its
    high watermark while flights write them, a store waits `store_wait_s` (no longer), then
    goes ahead as before."""
    executor = SteppedExecutor()
    store = KVStore(store_wait(slow_disk_config(tmp_path / "disk"), 0.3), executor=executor)
    stepped.append((store, executor))
    waited = []
    for s in range(6):
        started = time.monotonic()
        store.store(seq(1000 * s, 8), kv_for(store, 8, seed=s))
        waited.append(time.monotonic() - started)
        store.check()
    throttled = store.status()["mover"]["throttled_stores"]
    assert throttled >= 1
    assert sorted(waited)[-throttled] >= 0.3, f"stores took {waited}: none waited"
    assert max(waited) < 0.3 + 2.0, f"stores took {waited}: a wait was not bounded"
    drain_stepping(store, executor)
    store.check()


def test_a_store_that_waits_for_the_disk_drops_nothing(tmp_path: Path, stepped: Stepped) -> None:
    """The same 24 blocks into 12 memory slots as above, the disk stepped on another thread
    and stores allowed to wait: nothing is dropped, and every prompt comes back intact."""
    executor = SteppedExecutor()
    store = KVStore(store_wait(slow_disk_config(tmp_path / "disk"), 10.0), executor=executor)
    stepped.append((store, executor))
    kvs = {s: kv_for(store, 8, seed=s) for s in range(12)}
    with stepping(executor):
        for s, kv in kvs.items():
            assert store.store(seq(1000 * s, 8), kv).dropped_tokens == 0
            store.check()
        assert store.drain(10)
    status = store.status()
    assert status["mover"]["backpressure_drops"] == 0
    assert status["ops"]["dropped_tokens"] == 0
    for s, kv in kvs.items():
        loaded = store.load(seq(1000 * s, 8))
        assert loaded.num_tokens == 8 and same(loaded.kv, kv)


def test_recent_bandwidth_counts_overlapping_copies_time_once() -> None:
    ledger = Ledger()
    now = time.monotonic()
    path = ("host", "disk")
    ledger.record(path, 100, now - 4.0)  # [now-4, now] and, on another worker, [now-3, now]
    ledger.record(path, 300, now - 3.0)
    assert ledger.recent_bandwidth(path) == pytest.approx(400 / 4.0, rel=0.01)
    assert ledger.recent_bandwidth(("gpu", "host")) == 0.0


def test_recent_bandwidth_of_several_paths_counts_their_common_time_once() -> None:
    """A disk's reads and writes together: the union of their copies' time, over the span
    every path still remembers."""
    ledger = Ledger()
    now = time.monotonic()
    write, read = ("host", "disk"), ("disk", "host")
    ledger.record(write, 100, now - 4.0)  # [now-4, now]
    ledger.record(read, 300, now - 2.0)  # [now-2, now]: inside it
    assert ledger.recent_bandwidth(write, read) == pytest.approx(400 / 4.0, rel=0.01)
    assert ledger.recent_bandwidth(read) == pytest.approx(300 / 2.0, rel=0.01)
    assert ledger.recent_bandwidth(write, ("gpu", "host")) == ledger.recent_bandwidth(write)
    # the read path's memory fills with recent copies: the write path's old copy, from before
    # the oldest read remembered, no longer counts (each path seen over the same span)
    for _ in range(RECENT_TRANSFERS):
        ledger.record(read, 10, time.monotonic() - 0.001)
    both = ledger.recent_bandwidth(write, read)
    assert both == pytest.approx(ledger.recent_bandwidth(read), rel=0.01)
    assert both > 1000  # 10 bytes a ms, not diluted by the 4 s write


def test_background_demotion_keeps_host_under_its_watermark_through_a_real_disk(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    config = disk_config(
        tmp_path / "disk", gpu_blocks=4, host_blocks=8, background=True, host_watermarks=(0.5, 0.25)
    )
    store = KVStore(config)
    stores.append(store)
    kvs = [kv_for(store, 8, seed=s) for s in range(5)]
    for s, kv in enumerate(kvs):
        store.store(seq(1000 * s, 8), kv)
        assert store.drain(10)
        store.check()
        assert tier(store, "host")["used_bytes"] <= 4 * DISK_BLOCK_BYTES  # high watermark
    assert tier(store, "disk")["blocks"] > 0
    headers = slab_headers(tmp_path / "disk")
    assert len(headers) == tier(store, "disk")["blocks"], "index and slabs disagree"
    for s, kv in enumerate(kvs):
        lease = store.prefetch(seq(1000 * s, 8))
        assert lease.num_tokens == 8 and same(leased_kv(store, lease), kv)
        store.release(lease)
        store.check()


def test_new_blocks_below_a_disk_only_prefix_are_written_in_the_background(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    store = KVStore(disk_config(tmp_path / "disk", gpu_blocks=2, host_blocks=2, background=True))
    stores.append(store)
    head, head_kv = seq(0, 8), kv_for(store, 8, seed=1)
    on_disk_only(store, head, head_kv)
    full, full_kv = [*head, *seq(500, 8)], kv_for(store, 16, seed=2)
    full_kv[:, :, :8] = head_kv
    result = store.store(full, full_kv)
    assert (result.stored_tokens, result.pending_tokens, result.dropped_tokens) == (0, 8, 0)
    store.check()
    assert store.drain(10)
    assert store.lookup(full) == hit(disk=16)
    assert same(store.load(full).kv, full_kv)
    store.check()


def test_a_corrupt_disk_copy_fails_the_pending_lease_and_a_waiting_prefetch_recovers(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    store = KVStore(disk_config(tmp_path / "disk", gpu_blocks=4, host_blocks=4, background=True))
    stores.append(store)
    tokens, kv = seq(0, 16), kv_for(store, 16)
    on_disk_only(store, tokens, kv)
    slot = slab_headers(tmp_path / "disk")[(8, 9, 10, 11)][0]  # the third block
    with open(tmp_path / "disk" / "slab-00000.kvt", "r+b") as slab:  # flip a payload byte
        slab.seek(slot * DISK_SLOT_BYTES + DISK_HEADER_BYTES + 100)
        byte = slab.read(1)[0]
        slab.seek(slot * DISK_SLOT_BYTES + DISK_HEADER_BYTES + 100)
        slab.write(bytes([byte ^ 0xFF]))
    lease = store.prefetch(tokens, wait=False)
    with pytest.raises(LeaseError, match="failed"):
        lease.wait(10)
    assert lease.state is LeaseState.FAILED
    store.check()
    good = store.prefetch(tokens)  # the corrupt block is gone: the lease stops before it
    assert good.num_tokens == 8 and same(leased_kv(store, good), kv[:, :, :8])
    assert store.status()["ops"]["corrupt_dropped"] == 1
    store.release(good)
    store.check()


def test_lift_on_lookup_brings_a_host_prefix_up_while_gpu_has_room(stores: list[KVStore]) -> None:
    store = build_store(gpu_blocks=8, host_blocks=16, gpu_watermarks=(0.9, 0.75))
    config = store.config.model_copy(
        update={"mover": store.config.mover.model_copy(update={"lift_on_lookup": True})}
    )
    store.close()
    store = KVStore(config)
    stores.append(store)
    tokens, kv = seq(0, 16), kv_for(store, 16)
    on_host(store, tokens, kv)
    store.lookup(tokens)
    deadline = time.monotonic() + 10
    while store.lookup(seq(0, 4)).gpu_tokens == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.drain(10)
    assert store.lookup(tokens) == hit(gpu=16) and store.leases() == []
    assert same(store.load(tokens).kv, kv)
    assert store.status()["mover"]["lifted_blocks"] == 4
    store.check()


def test_close_ends_pending_leases_and_wakes_their_waiters() -> None:
    store, executor, tokens, _ = hosted([], 16, gpu_blocks=8, host_blocks=16)
    lease = store.prefetch(tokens, wait=False)  # its copies are stepped only after close began
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            lease.wait(30)
        except LeaseError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    closer = threading.Thread(target=store.close)
    closer.start()
    thread.join(30)
    assert not thread.is_alive() and outcome, "a waiter outlived the store"
    assert lease.state is LeaseState.CANCELLED and "closed" in str(outcome[0])
    while closer.is_alive():  # close waits for the copies in flight: let them run
        executor.run_all()
        closer.join(0.001)


def test_a_background_demotion_is_invisible_until_its_disk_write_is_durable(
    tmp_path: Path, stepped: Stepped
) -> None:
    config = disk_config(
        tmp_path / "disk", gpu_blocks=4, host_blocks=8, background=True, host_watermarks=(0.5, 0.25)
    )
    executor = SteppedExecutor()
    store = KVStore(config, executor=executor)
    stepped.append((store, executor))
    kvs = [kv_for(store, 8, seed=s) for s in range(5)]
    for s, kv in enumerate(kvs):  # 10 blocks, gpu holds 4: host passes its high watermark (4)
        store.store(seq(1000 * s, 8), kv)
    deadline = time.monotonic() + 10
    while store.status()["mover"]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    status = store.status()
    assert status["mover"]["in_flight"] > 0, "no demotion started"
    assert status["tiers"]["disk"]["blocks"] == 0, "a disk copy is visible before it is durable"
    assert status["tiers"]["disk"]["used_bytes"] > 0  # its slots are reserved, not indexed
    store.check()
    for s, kv in enumerate(kvs):  # readers meanwhile get the host copies, whole
        assert same(store.load(seq(1000 * s, 8)).kv, kv)
    assert executor.queued() > 0  # the disk writes have not run
    drain_stepping(store, executor)
    status = store.status()
    assert status["tiers"]["disk"]["blocks"] > 0 and status["mover"]["in_flight"] == 0
    assert status["tiers"]["host"]["used_bytes"] <= 4 * DISK_BLOCK_BYTES
    headers = slab_headers(tmp_path / "disk")
    assert len(headers) == status["tiers"]["disk"]["blocks"]
    store.check()


def test_under_backpressure_a_clean_leaf_is_freed_before_a_dirty_one_is_dropped(
    tmp_path: Path, stores: list[KVStore]
) -> None:
    config = disk_config(
        tmp_path / "disk", gpu_blocks=4, host_blocks=2, write="write_through", background=True
    )
    store = KVStore(config)
    stores.append(store)
    a, b, c = seq(0, 4), seq(100, 4), seq(200, 4)
    store.store(a, kv_for(store, 4, seed=1))
    store.persist()  # a: gpu, host, disk (clean)
    store.store(b, kv_for(store, 4, seed=2))  # b: gpu, host (dirty)
    assert store.evict("gpu", 2) == 2  # both host-only now (a keeps its disk copy)
    store.lookup(a)  # b is the least recently used
    store.store(c, kv_for(store, 4, seed=3))  # write_through: c needs a host slot now
    assert store.lookup(b) == hit(host=4), "the dirty leaf was dropped while a clean one was there"
    assert store.lookup(a) == hit(disk=4)
    assert store.status()["mover"]["backpressure_drops"] == 0
    store.check()


@pytest.mark.parametrize("wait_s", [10.0, 0.0], ids=["waits", "never-waits"])
@pytest.mark.parametrize("call", ["store", "reserve"])
def test_a_burst_under_the_watermark_is_written_down_not_dropped(
    tmp_path: Path, stepped: Stepped, wait_s: float, call: str
) -> None:
    """Host of 16 blocks, watermarks (0.95, 0.85): a prompt of 12 blocks (75 %, under both)
    leaves no work to the background mover, and the next 12 need 8 of its unwritten blocks'
    slots. Allowed to wait (the disk stepped on another thread), the call has them written
    down first and drops nothing; with `store_wait_s: 0` they are dropped by backpressure, as
    before (measured: two prompts of 100 blocks into a host of 128 lost 72 blocks, the disk
    idle). Through `store` and through a zero-copy writer's `reserve` + `commit`."""
    config = disk_config(tmp_path / "disk", gpu_blocks=4, host_blocks=16, background=True,
                         write="write_through", host_watermarks=(0.95, 0.85))  # fmt: skip
    executor = SteppedExecutor()
    store = KVStore(store_wait(config, wait_s), executor=executor)
    stepped.append((store, executor))
    kvs = {s: kv_for(store, 12 * DISK_BLOCK_TOKENS, seed=s) for s in range(2)}
    with stepping(executor):
        for s, kv in kvs.items():
            tokens = seq(1000 * s, 12 * DISK_BLOCK_TOKENS)
            if call == "store":
                assert store.store(tokens, kv).dropped_tokens == 0
            else:
                reservation = store.reserve(tokens)  # written whole, as a zero-copy writer
                pool = store.gpu_pool if reservation.tier == "gpu" else store.host_pool
                pool.buffer[list(reservation.slots)] = to_blocks(kv, DISK_BLOCK_TOKENS)
                assert store.commit(reservation).stored_tokens == 12 * DISK_BLOCK_TOKENS
            store.check()
        assert store.drain(10)
    drops = store.status()["mover"]["backpressure_drops"]
    kept = [store.lookup(seq(1000 * s, 12 * DISK_BLOCK_TOKENS)).num_tokens for s in kvs]
    if wait_s:
        assert drops == 0 and kept == [12 * DISK_BLOCK_TOKENS] * 2, (drops, kept)
        for s, kv in kvs.items():
            assert same(store.load(seq(1000 * s, 12 * DISK_BLOCK_TOKENS)).kv, kv)
    else:
        assert drops > 0 and kept[0] < 12 * DISK_BLOCK_TOKENS, (drops, kept)
    store.check()
