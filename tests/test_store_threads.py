"""Several threads on one store with a real disk tier: storing, looking up, loading,
prefetching and releasing, while the tiers overflow (gpu 6, host 8, disk 24 blocks) and blocks
demote to disk. Whatever any thread loads is bit-exact, `check()` holds throughout and at the
end, every lease is released or expires, and no thread hangs (every join is bounded).

The first test runs the mover inline (every copy inside the call that needs it); the second
runs it in the background, five seconds in the default suite and twenty under the `slow`
marker (`KVTIER_SOAK_S` to change the long one).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import DISK_BLOCK_BYTES, disk_config, kv_for, same

from kvtier.errors import CapacityError, LeaseError
from kvtier.results import Lease, LeaseState
from kvtier.store import KVStore

SECONDS = 4.0
SEQS = 12  # 3 blocks each, sharing a first block in threes


def tokens_of(seq: int) -> list[int]:
    return [900 + seq // 3] * 4 + [seq * 100 + j for j in range(8)]


def run_threads(
    store: KVStore, worker: Callable[[int], None], stop: float, errors: list[BaseException]
) -> None:
    """Four `worker(seed)` threads and a checker calling `check()` every 50 ms until `stop`;
    every join is bounded, and the first error of any thread fails the test."""

    def checker() -> None:
        try:
            while time.monotonic() < stop:
                store.check()
                time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=checker))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, stop - time.monotonic()) + 60)
        assert not thread.is_alive(), "a thread is stuck"
    assert not errors, errors[0]


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_threads_store_lookup_prefetch_and_release_with_demotion_to_disk(tmp_path: Path) -> None:
    config = disk_config(
        tmp_path / "disk", capacity=24 * (DISK_BLOCK_BYTES + 4096), gpu_blocks=6, host_blocks=8
    )
    store = KVStore(config)
    reference = {seq: kv_for(store, 12, seed=seq) for seq in range(SEQS)}
    for seq in range(SEQS):  # shared first blocks must carry the same KV in every sequence
        reference[seq][:, :, :4] = reference[seq - seq % 3][:, :, :4]
    stop = time.monotonic() + SECONDS
    errors: list[BaseException] = []
    counts = {"stores": 0, "loads": 0, "leases": 0, "refused": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                seq = rng.randrange(SEQS)
                tokens, kv = tokens_of(seq), reference[seq]
                action = rng.random()
                if action < 0.35:
                    store.store(tokens, kv)
                    key = "stores"
                elif action < 0.7:
                    loaded = store.load(tokens)
                    n = loaded.num_tokens
                    assert store.lookup(tokens).num_tokens >= 0
                    assert same(loaded.kv, kv[:, :, :n]), f"sequence {seq}: wrong bytes served"
                    key = "loads"
                else:
                    try:
                        lease = store.prefetch(tokens, ttl_s=5.0)
                    except CapacityError:
                        key = "refused"
                    else:
                        table = store.gpu_pool.buffer[list(lease.block_table)]
                        n = lease.num_tokens
                        want = (
                            kv[:, :, :n].reshape(2, 2, n // 4, 4, 2, 64).permute(2, 0, 1, 3, 4, 5)
                        )
                        assert same(table, want), f"sequence {seq}: a leased page is wrong"
                        try:
                            store.release(lease)
                        except LeaseError:  # it can only have expired, and ttl is 5 s
                            raise AssertionError("a live lease vanished") from None
                        key = "leases"
                with lock:
                    counts[key] += 1
        except BaseException as exc:
            errors.append(exc)

    run_threads(store, worker, stop, errors)
    store.check()
    assert store.leases() == []
    status = store.status()
    assert status["tiers"]["disk"]["bytes_in"] > 0, "nothing reached disk: the test lost its point"
    assert counts["stores"] > 20 and counts["loads"] > 20 and counts["leases"] > 5, counts
    store.close()


# ---- the same load with the background mover -----------------------------------------------------

SOAK_SECONDS = float(os.environ.get("KVTIER_SOAK_S", "20"))
SHORT_SOAK_SECONDS = 2.5  # the default suite's (10 min); `-m slow` runs SOAK_SECONDS
SOAK_SEQS = 30  # 70 distinct blocks for 40 slots in all: blocks keep moving and leaving


def leased_pages(kv: torch.Tensor, n: int) -> torch.Tensor:
    return kv[:, :, :n].reshape(2, 2, n // 4, 4, 2, 64).permute(2, 0, 1, 3, 4, 5)


@pytest.mark.parametrize(
    "seconds",
    [SHORT_SOAK_SECONDS, pytest.param(SOAK_SECONDS, marks=pytest.mark.slow, id="soak")],
    ids=str,
)
def test_background_mover_under_threads(tmp_path: Path, seconds: float) -> None:
    """Four threads store, load, prefetch (waiting, not waiting, cancelling, abandoning to
    expiry) and release while the mover demotes by watermark to a real disk tier, an asyncio
    loop awaits leases, and a checker runs `check()` every 50 ms. Every lease resolves."""
    config = disk_config(
        tmp_path / "disk",
        capacity=24 * (DISK_BLOCK_BYTES + 4096),
        gpu_blocks=8,
        host_blocks=8,
        background=True,
        gpu_watermarks=(0.85, 0.5),
        host_watermarks=(0.75, 0.5),
    )
    store = KVStore(config)
    reference = {seq: kv_for(store, 12, seed=seq) for seq in range(SOAK_SEQS)}
    for seq in range(SOAK_SEQS):
        reference[seq][:, :, :4] = reference[seq - seq % 3][:, :, :4]
    stop = time.monotonic() + seconds
    errors: list[BaseException] = []
    leases: list[Lease] = []
    counts = dict.fromkeys(
        ("stores", "loads", "ready", "cancelled", "abandoned", "refused", "awaited"), 0
    )
    lock = threading.Lock()
    loop = asyncio.new_event_loop()

    def count(key: str, lease: Lease | None = None) -> None:
        with lock:
            counts[key] += 1
            if lease is not None:
                leases.append(lease)

    def check_pages(seq: int, lease: Lease) -> None:
        pages = store.gpu_pool.buffer[list(lease.block_table)]
        n = lease.num_tokens
        assert same(pages, leased_pages(reference[seq], n)), f"sequence {seq}: wrong page"

    async def await_and_release(seq: int, lease: Lease) -> None:
        try:
            await asyncio.wait_for(lease, 10)
            check_pages(seq, lease)
            store.release(lease)
        except BaseException as exc:
            errors.append(exc)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                seq = rng.randrange(SOAK_SEQS)
                tokens, kv = tokens_of(seq), reference[seq]
                action = rng.random()
                if action < 0.3:
                    store.store(tokens, kv)
                    count("stores")
                    continue
                if action < 0.5:
                    loaded = store.load(tokens)
                    assert same(loaded.kv, kv[:, :, : loaded.num_tokens]), f"{seq}: wrong bytes"
                    count("loads")
                    continue
                abandon = 0.85 <= action < 0.95  # never released: a short lease to expire
                try:
                    lease = store.prefetch(tokens, ttl_s=0.05 if abandon else 5.0, wait=False)
                except CapacityError:
                    count("refused")
                    continue
                if abandon:
                    count("abandoned", lease)
                elif action < 0.75:
                    assert lease.wait(10), "a lease took over 10 s"
                    check_pages(seq, lease)
                    store.release(lease)
                    count("ready", lease)
                elif action < 0.85:
                    store.cancel(lease)
                    count("cancelled", lease)
                else:
                    asyncio.run_coroutine_threadsafe(await_and_release(seq, lease), loop)
                    count("awaited", lease)
        except BaseException as exc:
            errors.append(exc)

    looper = threading.Thread(target=loop.run_forever, daemon=True)
    looper.start()
    run_threads(store, worker, stop, errors)
    assert store.drain(30)
    deadline = time.monotonic() + 10  # abandoned leases live at most 5 s
    while store.leases() and time.monotonic() < deadline:
        time.sleep(0.1)
    loop.call_soon_threadsafe(loop.stop)
    looper.join(10)
    store.check()
    assert store.leases() == [], store.leases()
    unresolved = [lease for lease in leases if lease.state in (LeaseState.PENDING,)]
    assert not unresolved, f"{len(unresolved)} leases never resolved: {unresolved[:3]}"
    status = store.status()
    assert status["tiers"]["disk"]["bytes_in"] > 0, "nothing reached disk: the test lost its point"
    assert status["mover"]["demote_flights"] > 0, "the mover never demoted in the background"
    assert status["mover"]["step_errors"] == 0, status["mover"]["last_error"]
    print(counts, {k: v for k, v in status["mover"].items() if k != "last_error"})
    assert counts["stores"] > 50 and counts["ready"] > 20 and counts["cancelled"] > 5, counts
    store.close()
