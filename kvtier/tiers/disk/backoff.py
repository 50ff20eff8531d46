"""Backing off a disk that refuses writes (full, read-only, failing).

A refused write leaves its block where it was (in host memory), so the mover's watermark loop
would plan the same write again at once: an idle server spun a core at ~7k refused writes a
second. `WriteBackoff` turns refusals into waits: after a batch with a refused write (or sync,
or retire) no background write is planned for `delay_s`, which starts at `FIRST_S` and doubles
with every further refused batch up to `MAX_S`; the first batch that is written whole resets
it. Callers that need a write now (a persist, a store below a disk-only prefix) still try; the
disk tier reports the figures in its status (`backoff_s`, `last_write_error`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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
        """A batch had a refused write: wait `delay_s` (doubled, capped) before the next."""
        with self._lock:
            self.delay_s = min(MAX_S, self.delay_s * 2) if self.delay_s else FIRST_S
            self._until = self._clock() + self.delay_s
            self.last_error = f"{type(error).__name__}: {error}"

    def written(self) -> None:
        """A batch was written whole: writes go ahead at once again."""
        with self._lock:
            self.delay_s = 0.0
            self._until = 0.0

    def waiting(self) -> bool:
        """Whether background writes should wait now."""
        with self._lock:
            return self._clock() < self._until
