"""What every part that moves blocks shares: the cache's state, and the executor interface.

The cache's shared state: what every part that moves blocks reads and writes.

`CacheState` bundles the index, the tiers' pools (gpu, host[, disk], in tier order; a store
without a host tier has one of no slots in its place: `present`, `below`), the event
counters per tier, the operation counters (global, and each tenant's own: `count` adds to
both, as blocks stored in the background land too), whose blocks they are (`Namespaces`) and
the one lock that serialises every change to them. The store's calls and the mover's thread take
`lock`; the copies themselves run without it (`flights.py`). Nothing here does work: the
parts that do (`demotion.py`, `prefetch.py`, `background.py`, `leasing.py`, `mover.py`,
`persist.py`) each take this one object instead of a handful of the store's fields.

Invariant (checked by `KVStore.check`): a pool's used slots are its blocks resident in the
index plus the slots that flights and reservations hold.

Transfer handles and the executor interface: how the mover learns that a copy is complete.

An executor takes a `Transfer` (`copy.py`), starts its copies, and returns a `TransferHandle` at
once; the mover later learns of completion by `poll()`, by `handle.wait()` from a thread, by
`await handle` from asyncio, or by a done callback. Only then does it tell the index (DESIGN
invariant 1: a copy becomes visible only when it is complete).

Contract, for every executor (`InlineExecutor`, `ThreadExecutor`, `CudaExecutor`,
`SteppedExecutor`):
- A handle reports done only after every copy of its transfer completed: on a worker thread,
  after the copy returned (a disk write after its sync); on CUDA, after the event recorded
  behind the last copy has completed. A reader that sees `done()` true then sees every byte.
- The outcome is per block (`result()`, as `InlineExecutor.run`): memory copies are all ok, a
  disk write is ok once durable, a disk read once its checksum verified. An unexpected
  exception of the copy (a bad slot, a closed pool) is kept and raised again by `result()`.
- Each handle completes exactly once, and `poll()` returns it exactly once, after it is done.
- Source and destination slots must stay allocated, and unwritten by anyone else, until the
  handle is done; the executor does not check, as it does not know who owns them.
- Nothing here touches the index, and nothing here decides what to move.

Waiting, three ways, none of which raises for a timeout:

    handle.wait(timeout)     a thread blocks (an Event, or polling when completion must be probed)
    await handle             asyncio polls `done()` with `asyncio.sleep` backoff, 0.1 ms .. 2 ms
    handle.add_done_callback(fn)    fn(handle) once, from the thread that completes it

`await` polls rather than parking a thread in `loop.run_in_executor`: a CUDA handle completes
only when someone queries its event (there is no thread to wake the loop), a parked thread per
awaited handle would exhaust the loop's default pool under many prefetches, and a cancelled
awaiting task leaves nothing behind. The price is at most 2 ms of latency per wait, small next
to the copies it waits for.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.index import RadixIndex
from kvtier.tenancy import Namespaces
from kvtier.tiers.base import DISK, GPU, HOST, Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import SlotPool

if TYPE_CHECKING:
    from kvtier.transfer.copy import Ledger, Transfer

TENANT_OPS = (
    "lookups",
    "lookup_tokens",
    "hit_tokens",
    "stores",
    "stored_tokens",
    "dropped_tokens",
    "loads",
    "loaded_tokens",
    "prefetches",
)
"""The operation counters kept per tenant as well as in the global `ops`."""

OPS = (*TENANT_OPS, "leases_expired", "corrupt_dropped")
"""The global operation counters (`status()["ops"]`)."""


@dataclass
class TierCounters:
    """Events per tier since start. Capacity and residency are read from live objects instead."""

    hits: int = 0  # blocks found by lookups whose fastest copy was here
    promotions: int = 0  # blocks copied up into this tier
    demotions: int = 0  # blocks whose copy here was freed after a copy below existed
    evictions: int = 0  # blocks dropped from the cache while their fastest copy was here


@dataclass(frozen=True, eq=False)
class CacheState:
    index: RadixIndex
    pools: Sequence[Tier]  # gpu, host, then disk when configured
    namespaces: Namespaces
    counters: Sequence[TierCounters] = ()
    ops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    lock: threading.RLock = field(default_factory=threading.RLock)
    # each tenant's TENANT_OPS: the store's `tenant_counters[t].ops`, entered by `Operations`
    tenant_ops: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.counters:
            object.__setattr__(self, "counters", [TierCounters() for _ in self.pools])

    @property
    def gpu(self) -> SlotPool:
        pool = self.pools[GPU]
        assert isinstance(pool, SlotPool)
        return pool

    @property
    def host(self) -> SlotPool:
        pool = self.pools[HOST]
        assert isinstance(pool, SlotPool)
        return pool

    @property
    def disk(self) -> DiskTier | None:
        pool = self.pools[DISK] if len(self.pools) > DISK else None
        assert pool is None or isinstance(pool, DiskTier)
        return pool

    @property
    def all_tiers(self) -> tuple[int, ...]:
        return tuple(range(len(self.pools)))

    @property
    def present(self) -> tuple[int, ...]:
        """The tiers this store has: all but a host tier of no slots (`tiers.host: null`,
        `NoHostPool`), which status, metrics and the sidecar's pools leave out."""
        return tuple(tier for tier, pool in enumerate(self.pools) if pool.num_slots)

    def below(self, tier: int) -> int | None:
        """The tier that `tier`'s victims are copied down to: the next one, if there is one
        and it has slots; else None, and they are dropped (the lowest tier, or gpu in a store
        without a host tier, which the config allows only without a disk tier)."""
        lower = tier + 1
        return lower if lower < len(self.pools) and self.pools[lower].num_slots else None

    def count(self, tenant: str, **events: int) -> None:
        """Add `events` (operation counters, `TENANT_OPS`) to the global and `tenant`'s own."""
        own = self.tenant_ops[tenant]
        for name, n in events.items():
            self.ops[name] += n
            own[name] += n

    def free(self, tier: int, slots: Sequence[int]) -> None:
        """Give `slots` of `tier` back to its pool (the index no longer names them)."""
        if slots:
            self.pools[tier].free(list(slots))


POLL_FIRST_S = 0.0001
POLL_MAX_S = 0.002
"""Backoff of polling waits (`await`, and `wait` on handles whose completion is probed)."""


class TransferHandle:
    """The completion of one submitted `Transfer`; created by an executor, never by callers.

    Two sides. Holders (the mover, the store, tests) read and wait: `done`, `wait`, `result`,
    `add_done_callback`, `await`. The executor that created the handle completes it, and only
    it: `settle(ok, error)` once (under the executor's own lock, so that its `poll()` and
    `done()` agree), then `run_callbacks()` once (outside every lock, as callbacks may submit).

    `probe`, when given, is called by `done()` on a handle not yet done, to look for completion
    (a CUDA executor queries its events there); without it, the executor completes the handle
    from its own thread.
    """

    def __init__(self, transfer: Transfer, probe: Callable[[], None] | None = None) -> None:
        self.transfer = transfer
        self._probe = probe
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._ok: list[bool] | None = None
        self._error: Exception | None = None
        self._callbacks: list[Callable[[TransferHandle], object]] | None = []

    def done(self) -> bool:
        """Whether every copy of the transfer has completed; never blocks."""
        if not self._event.is_set() and self._probe is not None:
            self._probe()
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or `timeout` seconds passed (None: no limit); True if done."""
        if self._probe is None:
            return self._event.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_FIRST_S
        while not self.done():
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                delay = min(delay, left)
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        return True

    def result(self) -> list[bool]:
        """Per block, whether its copy is complete. `RuntimeError` while still in flight; the
        copy's own exception if it raised one."""
        if not self.done():
            path = "->".join(self.transfer.path)
            raise RuntimeError(
                f"transfer {path} of {len(self.transfer.src_slots)} blocks is still in flight; "
                "wait for it (wait, await, poll) before reading its result"
            )
        if self._error is not None:
            raise self._error
        assert self._ok is not None
        return list(self._ok)

    def add_done_callback(self, fn: Callable[[TransferHandle], object]) -> None:
        """Call `fn(self)` once when done: from the completing thread, or now if already done.

        A callback should not raise; if some do, every callback still runs and the first
        exception goes to the completing thread (a `ThreadExecutor` raises it from `poll()`)."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self) -> Generator[Any, None, list[bool]]:
        """`await handle` polls without blocking the loop and returns `result()`."""
        return self._wait_async().__await__()

    async def _wait_async(self) -> list[bool]:
        delay = POLL_FIRST_S
        while not self.done():
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        return self.result()

    # -- executor side: the executor that created the handle, and nobody else ---------------

    def settle(self, ok: list[bool] | None, error: Exception | None) -> None:
        """Record the outcome, per-block `ok` or the copy's `error` (exactly one of them), and
        make the handle done: `done()` is true and `wait()` returns from now on. Once per
        handle, after every copy of its transfer completed (the module doc's contract)."""
        assert (ok is None) != (error is None), "an outcome is a result or an error"
        with self._lock:
            assert not self._event.is_set(), "a transfer completes once"
            self._ok, self._error = ok, error
            self._event.set()

    def run_callbacks(self) -> None:
        """Run the callbacks registered so far, once, after `settle`; later ones run as they
        are added. Every callback runs; the first exception of one is raised afterwards."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        assert callbacks is not None and self._event.is_set(), "settled once, then callbacks"
        first: Exception | None = None
        for fn in callbacks:
            try:
                fn(self)
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "in flight"
        path = "->".join(self.transfer.path)
        return f"TransferHandle({path}, {len(self.transfer.src_slots)} blocks, {state})"


class Runner(Protocol):
    """Runs one transfer to completion in the calling thread (`InlineExecutor.run`, or
    `CudaExecutor.run`, whose streams see the engine's marks)."""

    def run(self, transfer: Transfer) -> list[bool]:
        """Copy every block now; per block, whether its copy is complete."""
        ...


class Executor(Protocol):
    """What the mover and the store need of an executor; see the module doc for the contract.
    Capabilities are declared here, never probed: an executor without CUDA streams still says
    `polled = False`, does nothing in `mark_engine` and hands back the inline runner."""

    polled: bool
    """True when completion is seen only by `poll()` (CUDA events: the mover polls while copies
    run); False when a done callback announces each completion (worker threads, inline)."""

    @property
    def ledger(self) -> Ledger:
        """Where the executor counts what it moved (shared with the store's inline copies)."""
        ...

    @property
    def bytes_moved(self) -> Mapping[tuple[str, str], int]:
        """Bytes of completed, ok block copies per path `(src tier, dst tier)`."""
        ...

    def submit(self, transfer: Transfer) -> TransferHandle:
        """Start `transfer` and return its handle; `ClosedError` after `close()`."""
        ...

    def poll(self) -> list[TransferHandle]:
        """Handles completed since the last poll, in completion order; never blocks."""
        ...

    def queued(self) -> int:
        """Transfers submitted and not complete yet (the status's queue depth)."""
        ...

    def mark_engine(self) -> None:
        """Order every copy submitted from now on after the work the engine has enqueued so far
        (CUDA: an event on the engine's stream). Nothing to do where the engine's writes are
        complete when its call returns (CPU pools)."""
        ...

    def in_call_runner(self, inline: Runner) -> Runner:
        """What runs the copies a store call makes itself (room made now): this executor where
        they must be ordered with the engine's stream like its own copies (CUDA), else
        `inline`."""
        ...

    def close(self) -> None:
        """Wait (bounded) for transfers in flight, then refuse new ones; idempotent."""
        ...
