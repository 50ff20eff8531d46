"""Whether a load's copy out of the mapped gpu pool is its prompt's KV: its lease held the slots
until the copy ended.

A shared-memory load leases the prefix (a prefetch marked `as_load`) and copies its blocks out
of the mapped gpu pool (`pools.read_blocks`). The server pins the slots only while the lease
lives: one that expires first (its ttl, `policy.lease_ttl_s` by default, of the server's clock)
lets another client's store reuse them, and the copy may then hold another prompt's bytes.
Nothing in the pool tells, so the client proves the lease held, one of two ways
(`Owing.settle`):

- by time, with no request: the server's prefetch reply says the lease's `ttl_s`, counted from
  its grant, which came after the client sent the prefetch (`asked_at`). A copy that ended
  before `asked_at + ttl_s * HELD_SHARE` of this host's monotonic clock ended while the lease
  lived; its release is owed as usual (`releases.py`).
- else by releasing it at once: a lease stays in the server's table, pinning its slots, until it
  is released or reaped past its time (lazily, by the next operation); `/v1/release` reaps
  first and answers `LeaseError` for a lease no longer there. Answered, the lease pinned its
  slots from its grant until after the copy; a `LeaseError`, and the copy is thrown away: the
  load goes through the body (the server's own load), never returning bytes that may be
  another prompt's.

A server that does not say `ttl_s` (before this protocol) gets the release at once, every load.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ReplyError, shown
from kvtier.results import Lease

HELD_SHARE = 0.5
"""The share of a lease's ttl a copy may take and be taken as held by time alone: half, a wide
margin for a server's clock that ticks apart from this host's (a load's copy takes
milliseconds, a default ttl a minute)."""


@dataclass(frozen=True)
class LeaseFrom:
    """A lease; the server instance of the reply that granted it (`pools.read_blocks`); and
    until when, on this host's `time.monotonic()`, it surely holds its slots (None: unknown)."""

    lease: Lease
    instance: str | None
    held_until: float | None = None

    def held_now(self) -> bool:
        """Whether the lease surely still holds its slots (by time alone: module doc)."""
        return self.held_until is not None and time.monotonic() < self.held_until


def held_until(asked_at: float, body: dict[str, Any]) -> float | None:
    """Until when the lease of prefetch reply `body`, asked at `asked_at` (`time.monotonic()`
    before the request was sent), surely holds its slots; None where the reply does not say
    its `ttl_s`. `ReplyError` for a `ttl_s` that is not a number of seconds > 0."""
    ttl = body.get("ttl_s")
    if ttl is None:
        return None
    if type(ttl) not in (int, float) or not 0 < ttl < math.inf:
        raise ReplyError(f"lease.ttl_s: got {shown(ttl)}, expected a number of seconds > 0")
    return asked_at + float(ttl) * HELD_SHARE
