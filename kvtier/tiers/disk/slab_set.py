"""The slab files of one disk tier seen as one array of fixed slots, and the tier's health.

The slab files of one disk tier seen as a single array of fixed slots, and the I/O run on them.

    slot s  ->  slab s // S, byte offset (s % S) * slot_bytes        (S = slots_per_slab)

    slab-00000.kvt  [ slot 0 | slot 1 | ... | slot S-1 ]
    slab-00001.kvt  [ slot S | slot S+1 | ...           ]      (the last slab may be shorter)

Contract:
- `where(slot)` is arithmetic over a geometry fixed when the tier opened: the slab file that
  holds a slot and the slot's byte offset in it.
- `runs(slots, joinable)` groups a batch for its I/O: the joinable slots that follow each other
  in one slab go together, at most `RUN_BYTES` of slots, so that one system call moves them
  (the writes' and the reads' runs, `copies.py` and `reads.py`); every other slot goes alone.
- `run(jobs, urgent)` runs I/O jobs on the tier's `IOPool`: results in job order, an `OSError`
  in place of a failed job's result; `urgent` ones (the reads) ahead of the others waiting
  (`IOPool.run`).
- `sync_slabs_of(slots, always)` makes a batch durable as `fsync` says: under `batch` (or
  `always`: a clear's retirement) every slab that holds one of `slots` is synced once; under
  `none` nothing is synced and nothing fails. It names the slabs whose sync failed, so that a
  caller fails exactly the copies in them.
- The set neither opens nor closes anything: the tier opens the slabs and the pool and closes
  them (`DiskTier.close`).

What went wrong on a disk tier so far, and whether it takes background writes now.

Contract:
- `counts` holds one counter per kind of fault (`FAULT_KINDS`): slabs cut short for lack of
  space (`enospc`), refused copy writes, slab syncs and retires, failed reads, copies found
  corrupt when read, and blocks a quantized codec could not keep (`unquantizable`). `count`
  adds to them from any thread (copies run on mover threads beside the store's calls); a
  counter never goes down.
- `note_writes(results)` turns the outcome of one batch of writes into the backoff
  (`WriteBackoff`): a refused write starts or lengthens it, a batch written whole ends it, an empty
  batch says nothing. `accepting_writes()` is False while the backoff lasts.
- `write_status()` reports the refused writes, the current backoff and the last refusal.

Backing off a disk that refuses writes (full, read-only, failing).

A refused write leaves its block where it was (in host memory), so the mover's watermark loop
would plan the same write again at once: an idle server spun a core at ~7k refused writes a
second. `WriteBackoff` turns refusals into waits: after a batch with a refused write (or sync,
or retire) no background write is planned for `delay_s`, which starts at `FIRST_S` and doubles
with every further refused batch up to `MAX_S`; the first batch that is written whole resets
it. Only a refusal after a wait has ended doubles it: the batches of one burst (the mover's
flights in the air together, a copy and the retire of its slots) that fail within the wait the
first of them started count once, so that a disk that is full for a moment is not left alone
for `MAX_S` after one burst.
Callers that need a write now (a persist, a store below a disk-only prefix) still try; the disk
tier reports the figures in its status (`backoff_s`, `last_write_error`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvtier.text import ERROR_CHARS, printable
from kvtier.tiers.disk.io import SlabFile
from kvtier.tiers.disk.io_pool import IOPool

T = TypeVar("T")

RUN_BYTES = 2 << 20
"""The most bytes of slots one run moves: the raw benchmark's chunk size; a batch of tens of
blocks still spreads over several I/O threads."""


@dataclass(frozen=True, slots=True)
class SlabSync:
    """The outcome of syncing the slabs of a batch."""

    results: list[OSError | None]
    """One per synced slab, in slab order: None, or the `OSError` its sync raised."""
    failed: frozenset[int]
    """The indexes of the slabs whose sync failed."""
    slots_per_slab: int

    def lost(self, slots: Sequence[int]) -> int:
        """How many of `slots` lie in a slab whose sync failed."""
        return sum(slot // self.slots_per_slab in self.failed for slot in slots)


class SlabSet:
    """Slots over the slab files of one tier; every I/O of the tier goes through `run`."""

    def __init__(
        self,
        files: list[SlabFile],
        slot_bytes: int,
        slots_per_slab: int,
        fsync: str,
        io: IOPool,
    ) -> None:
        """`files` in slab order, all but the last holding `slots_per_slab` slots of
        `slot_bytes` bytes; `fsync` is `batch` or `none`; `io` runs the jobs."""
        self.files = files
        self.slot_bytes = slot_bytes
        self.slots_per_slab = slots_per_slab
        self.fsync = fsync
        self.io = io
        self.num_slots = sum(slab.size // slot_bytes for slab in files)

    def where(self, slot: int) -> tuple[SlabFile, int]:
        """The slab file that holds `slot`, and the slot's byte offset in it."""
        slab, index = divmod(slot, self.slots_per_slab)
        return self.files[slab], index * self.slot_bytes

    def runs(self, slots: Sequence[int], joinable: Sequence[bool]) -> list[list[int]]:
        """The positions of `slots` grouped into runs, in slot order: joinable slots that follow
        each other in one slab, `RUN_BYTES` of slots at most; every other slot alone.

            slots [9, 6, 5, 10, 7]  (4 a slab)  ->  [[2, 1, 4], [0, 3]]  (5 6 7 | 9 10)
        """
        per_slab = self.slots_per_slab
        longest = max(1, RUN_BYTES // self.slot_bytes)
        runs: list[list[int]] = []
        run: list[int] = []
        for k in sorted(range(len(slots)), key=slots.__getitem__):
            slot = slots[k]
            if not joinable[k]:
                runs.append([k])
            elif run and slot == slots[run[-1]] + 1 and slot % per_slab and len(run) < longest:
                run.append(k)
            else:
                if run:
                    runs.append(run)
                run = [k]
        if run:
            runs.append(run)
        return runs

    def run(self, jobs: Sequence[Callable[[], T]], urgent: bool = False) -> list[T | OSError]:
        """Run `jobs` on the I/O threads and wait for all; `urgent`: ahead of the plain calls
        waiting (`IOPool.run`)."""
        return self.io.run(jobs, urgent)

    def sync_slabs_of(self, slots: Sequence[int], always: bool = False) -> SlabSync:
        """Sync each slab that holds one of `slots` once (`fsync: batch`, or `always`; nothing
        under `none`), in parallel; which syncs failed."""
        if self.fsync != "batch" and not always:
            return SlabSync([], frozenset(), self.slots_per_slab)
        touched = sorted({slot // self.slots_per_slab for slot in slots})
        synced = self.io.run([self.files[i].sync for i in touched])
        failed = frozenset(i for i, r in zip(touched, synced, strict=True) if r is not None)
        return SlabSync(synced, failed, self.slots_per_slab)


FIRST_S = 0.05
MAX_S = 5.0


class WriteBackoff:
    """How long background writes wait after refused ones; safe to use from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.delay_s = 0.0  # 0 while the disk takes writes
        self.last_error: str | None = None
        self._until = 0.0

    def refused(self, error: OSError) -> None:
        """A batch had a refused write: wait `delay_s` before the next, doubled (capped) when
        the refusal came after the last wait ended; one during a wait (a batch started before
        it, or a caller that writes anyway) starts the same wait again."""
        with self._lock:
            now = self._clock()
            if not self.delay_s:
                self.delay_s = FIRST_S
            elif now >= self._until:
                self.delay_s = min(MAX_S, self.delay_s * 2)
            self._until = now + self.delay_s
            self.last_error = printable(f"{type(error).__name__}: {error}", ERROR_CHARS)

    def written(self) -> None:
        """A batch was written whole: writes go ahead at once again."""
        with self._lock:
            self.delay_s = 0.0
            self._until = 0.0

    def waiting(self) -> bool:
        """Whether background writes should wait now."""
        with self._lock:
            return self._clock() < self._until


FAULT_KINDS = (
    "enospc",
    "write_errors",
    "sync_errors",
    "retire_errors",
    "read_errors",
    "corrupt_reads",
    "unquantizable",
)
REFUSED_WRITES = ("write_errors", "sync_errors", "retire_errors")


class DiskHealth:
    """The fault counters and the write backoff of one disk tier; safe from any thread."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self.backoff = WriteBackoff()
        self._lock = threading.Lock()

    def count(self, kind: str, n: int) -> None:
        """Add `n` faults of `kind` (one of `FAULT_KINDS`)."""
        with self._lock:
            self.counts[kind] += n

    def note_writes(self, results: Sequence[object]) -> None:
        """Start (or lengthen) the backoff after a batch with a refused write (an `OSError`
        among the I/O `results`); end it after a batch done whole; no batch, no news."""
        error = next((r for r in results if isinstance(r, OSError)), None)
        if error is not None:
            self.backoff.refused(error)
        elif results:
            self.backoff.written()

    def accepting_writes(self) -> bool:
        """False while the tier backs off after refused writes: plan no background write."""
        return not self.backoff.waiting()

    def write_status(self) -> dict[str, object]:
        """Refused writes (copies, syncs, retires) so far, the current backoff in seconds (0
        while the disk takes writes) and the last refusal, for the tier's status."""
        with self._lock:
            refused = sum(self.counts[k] for k in REFUSED_WRITES)
        return {
            "refused_writes": refused,
            "backoff_s": self.backoff.delay_s,
            "last_write_error": self.backoff.last_error,
        }
