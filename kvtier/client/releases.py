"""Releases a client owes the server, sent on the next request rather than one of their own.

A shared-memory `load` is a lease, a copy out of the mapped pool and a release. Sending the
release as a request of its own made every load two round trips, which is most of a load's time
for prompts of a few MiB. Instead `load` hands its lease here once the copy is done, and:

- the client's next prefetch or reserve of the same tenant carries the ids in its `release`
  field (the server releases them once the request is known good, before its own work:
  `KVStore.prefetch` / `reserve`);
- whatever is still owed `RELEASE_AFTER_S` after it was handed in is released by the client's
  flusher (a thread of `Client`, a timer of `AsyncClient`) with `/v1/release`, so an idle
  client holds a lease at most that much longer than its load;
- `close()` releases everything owed.

Invariants: an id is owed at most once, and taken by one sender (the `take*` calls remove
what they return). A request that fails after taking ids gives them back (`give_back`): the
server may or may not have released them, and it passes over ids it no longer knows (an
explicit `/v1/release` of one is a `LeaseError`, which the flusher ignores), so sending one
twice is harmless. Thread-safe.
"""

from __future__ import annotations

import threading
import time

from kvtier.results import Lease

RELEASE_AFTER_S = 0.05
"""How long a release waits for a request to ride on before it is sent alone."""

MAX_CARRIED = 256
"""The most ids one request carries (the server's `wire.MAX_RELEASES`)."""


class OwedReleases:
    """What one client owes: lease id -> (tenant, when it was handed in)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owed: dict[int, tuple[str, float]] = {}  # lease id -> (tenant, when handed in)

    def add(self, lease: Lease, tenant: str) -> None:
        """Owe `lease`'s release; `tenant` as the load that took it named it (the client's
        argument, so that the release goes out under the same headers)."""
        with self._lock:
            self._owed[lease.lease_id] = (tenant, time.monotonic())

    def take(self, tenant: str) -> list[int]:
        """The ids owed for `tenant` (at most `MAX_CARRIED`), no longer owed: to carry on a
        request of that tenant."""
        with self._lock:
            ids = [i for i, (t, _) in self._owed.items() if t == tenant][:MAX_CARRIED]
            for i in ids:
                del self._owed[i]
        return ids

    def take_due(self, now: float | None = None) -> list[tuple[int, str]]:
        """(id, tenant) of what has been owed `RELEASE_AFTER_S` or longer; all with
        `now=math.inf`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [(i, t) for i, (t, at) in self._owed.items() if now - at >= RELEASE_AFTER_S]
            for i, _ in due:
                del self._owed[i]
        return due

    def give_back(self, tenant: str, ids: list[int]) -> None:
        """Owe `ids` again (a request that carried them failed), due at once."""
        with self._lock:
            for i in ids:
                self._owed.setdefault(i, (tenant, 0.0))

    def next_due_in(self) -> float | None:
        """Seconds until the oldest owed id is due (0 if one is), or None if nothing is owed."""
        with self._lock:
            if not self._owed:
                return None
            oldest = min(at for _, at in self._owed.values())
        return max(0.0, oldest + RELEASE_AFTER_S - time.monotonic())
