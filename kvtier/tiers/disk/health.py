"""What went wrong on a disk tier so far, and whether it takes background writes now.

Contract:
- `counts` holds one counter per kind of fault (`FAULT_KINDS`): slabs cut short for lack of
  space (`enospc`), refused copy writes, slab syncs and retires, failed reads and copies found
  corrupt when read. `count` adds to them from any thread (copies run on mover threads beside
  the store's calls); a counter never goes down.
- `note_writes(results)` turns the outcome of one batch of writes into the backoff
  (`backoff.py`): a refused write starts or lengthens it, a batch written whole ends it, an empty
  batch says nothing. `accepting_writes()` is False while the backoff lasts.
- `write_status()` reports the refused writes, the current backoff and the last refusal.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.tiers.disk.backoff import WriteBackoff

FAULT_KINDS = (
    "enospc",
    "write_errors",
    "sync_errors",
    "retire_errors",
    "read_errors",
    "corrupt_reads",
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
