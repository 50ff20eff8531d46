"""The mover's thread and an executor whose completions are seen only when polled (CUDA events).

A CUDA executor completes a handle only when someone queries its event (`Executor.polled`):
nothing calls back when the copy ends. The mover's thread polls every `POLL_S` while flights
are in the air, and otherwise sleeps up to `IDLE_WAKE_S`. A flight launched while the thread
slept its long tick must wake it, or the prefetch is published on the tick (on the H200, a
prefetch up from host took 246 ms at p50 where its copies took a few: `RESULTS.md`).

`PolledExecutor` below has that property on the CPU: a `SteppedExecutor` whose copies take
`COPY_S` on the "device" and complete only inside a `poll()` that comes after that, as a CUDA
executor's complete when its events are queried. The store, the mover and its thread are the
real ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import pytest
from conftest import build_store, hit, kv_for

from kvtier.store import KVStore
from kvtier.transfer.copy import Transfer
from kvtier.transfer.mover import IDLE_WAKE_S
from kvtier.transfer.shared import TransferHandle
from kvtier.transfer.stepped import SteppedExecutor

COPY_S = 0.002
"""How long a copy is in the air before a poll sees it complete."""


class PolledExecutor(SteppedExecutor):
    """Copies complete only when polled, `COPY_S` after their submission (module doc)."""

    polled = True

    def __init__(self) -> None:
        super().__init__()
        self.submitted: list[float] = []  # when each queued transfer was submitted, oldest first

    def submit(self, transfer: Transfer) -> TransferHandle:
        handle = super().submit(transfer)
        self.submitted.append(time.monotonic())
        return handle

    def poll(self) -> list[TransferHandle]:
        while self.submitted and time.monotonic() - self.submitted[0] >= COPY_S:
            self.submitted.pop(0)
            self.step()
        return super().poll()


@pytest.fixture
def store() -> Iterator[KVStore]:
    config = build_store(gpu_blocks=16, host_blocks=32).config
    made = KVStore(config, executor=PolledExecutor())
    yield made
    made.close()


def test_a_prefetch_on_a_polled_executor_is_ready_long_before_the_idle_tick(
    store: KVStore,
) -> None:
    tokens = list(range(32))  # 8 blocks
    store.store(tokens, kv_for(store, len(tokens)))
    store.check()
    waits = []
    for _ in range(7):
        assert store.evict("gpu", 8) == 8
        store.drain(1.0)
        assert store.lookup(tokens) == hit(host=len(tokens))
        time.sleep(IDLE_WAKE_S / 5)  # the thread is asleep on its long tick by now
        started = time.monotonic()
        lease = store.prefetch(tokens)  # waits for READY
        waits.append(time.monotonic() - started)
        assert lease.num_tokens == len(tokens)
        store.release(lease)
        store.check()
    # without the wake on launch, each prefetch waited for the rest of the tick (~0.2 s)
    assert statistics.median(waits) < IDLE_WAKE_S / 5, waits
