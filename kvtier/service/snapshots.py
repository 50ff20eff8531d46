"""`GET /v1/blocks`' snapshots (every block a viewer may see, as KV events: a router's resync),
built and held within the requests' budget (`budget.py`).

    snapshots = Snapshots(service.budget, body_timeout_s)
    await snapshots.take(store, tenant)    the snapshot, charged to the call's hold

A snapshot is built whole in memory before it is sent (`events.observer.snapshot`), so its size
is known only once it is built; it is then charged to the call's hold (`budget.HOLD`), at most
the largest a call may hold, waiting for room up to `body_timeout_s` (503 busy past it).

A tenant key's snapshot is refused (403 `forbidden`, `SHARED_TOPIC`) where tenants share one
event topic (`events.per_tenant_topic` false): it would tell of that tenant's blocks only, and a
router replaces a topic's blocks by a snapshot's (`PrefixIndex.reset`), so every other tenant's
would vanish from it. With per-tenant topics a tenant's snapshot is its topic whole.

Invariants:
- snapshots are built one at a time (`building`, a lock held only while one is built);
- each viewer (a tenant, or None: the global view of the admin key or of a server without
  auth) has at most one snapshot built and not yet in the budget (`viewers`, a lock per viewer
  held from before the build until its charge is granted or refused). The snapshots outside the
  budget are so bounded by one per configured tenant and one of all blocks, whatever the number
  of calls, and the viewers are only those (`admission.admit_viewer`'s answers).
- no lock another viewer needs is held while a call waits for its budget: a tenant at its share
  (its bodies held unsent, its own snapshots waiting) delays another tenant's snapshot by at
  most the builds queued before it (one per viewer), never by its wait for room.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from kvtier.events.observer import snapshot as events_snapshot
from kvtier.service import budget, wire
from kvtier.store import KVStore

SHARED_TOPIC = (
    "GET /v1/blocks: tenants share this store's event topic (events.per_tenant_topic is "
    "false), so a tenant key's snapshot would hold only its part of it, and a router resets a "
    "topic to what a snapshot says: use the admin key, or turn on events.per_tenant_topic"
)


class Snapshots:
    """The `/v1/blocks` snapshots of one server (module doc). Used from the event loop only."""

    def __init__(self, limits: budget.Budget, timeout_s: float) -> None:
        self.limits, self.timeout_s = limits, timeout_s
        self.building = asyncio.Lock()
        self.viewers: collections.defaultdict[str | None, asyncio.Lock]
        self.viewers = collections.defaultdict(asyncio.Lock)

    async def take(self, store: KVStore, tenant: str | None) -> dict[str, Any]:
        """`tenant`'s snapshot (None: every block), held in the call's budget; a 403 for a
        tenant where tenants share a topic (module doc)."""
        events = store.parts.events
        if tenant is not None and events is not None and not events.settings.per_tenant:
            raise wire.WireError(403, "forbidden", SHARED_TOPIC)
        async with self.viewers[tenant]:  # this viewer's one snapshot outside the budget
            async with self.building:  # built one at a time, no budget waited for here
                snapshot = await run_in_threadpool(events_snapshot, store, tenant)
            size = sum(len(topic["events"]) for topic in snapshot["topics"])
            hold = budget.HOLD.get()
            if hold is not None:
                deadline = time.monotonic() + self.timeout_s
                await hold.take(min(size, self.limits.largest()), deadline)
            return snapshot
