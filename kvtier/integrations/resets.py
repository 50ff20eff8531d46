"""Forgetting an engine's cached KV in kvtier when what computed it changed: vLLM's
`reset_prefix_cache(reset_connector=True)` (a weight update's cache-clearing cascade, as RL
trainers run it) calls the connector's `reset_cache`; SGLang's "clear HiCache storage" calls its
backend's `clear`. Without it kvtier kept serving the old weights' KV for the same tokens.

`reset_tenants(clients)` resets each client's tenant at its sidecar (`POST /v1/reset`,
`KVStore.reset`: every block of the tenant's in every local tier dropped, disk copies retired
durably), again while blocks are left (held by a lease: a load in flight) until `wait_s`.
It answers None when each is clear, else why not, for the engine to report the reset failed:
- a sidecar that failed or refused (or could not be reached to make a client of `clients`,
  which may make them as they are asked for: never an exception out of the engine's step);
- blocks still held after `wait_s`;
- a remote tier: other nodes' sidecars share it and this cannot clear it, so their copies of
  the old KV stay reachable (a model whose weights change at run time runs without one, or
  each version under its own `model.name`).
The caller orders the rest: no engine of the tenant may store KV of the old weights after the
reset (vLLM's connector drops its queued saves and resets again from its workers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kvtier.client import Client
from kvtier.errors import KVTierError

WAIT_S = 5.0
log = logging.getLogger("kvtier.reset")


def reset_tenants(clients: Iterable[Client], wait_s: float = WAIT_S) -> str | None:
    deadline = time.monotonic() + wait_s
    them = iter(clients)
    while True:
        try:  # a client made as it is asked for (`map`) first reaches its sidecar then
            client = next(them, None)
        except (KVTierError, OSError) as e:
            return f"the sidecar's reset failed: {e}"
        if client is None:
            return None
        while True:
            try:
                reply = client.reset()
            except (KVTierError, OSError) as e:
                return f"the sidecar's reset failed: {e}"
            if reply["remote"]:
                return (
                    "the sidecar has a remote tier, which other nodes share and a reset cannot "
                    "clear: their copies of the old KV stay reachable"
                )
            if not reply["left_blocks"]:
                break
            if time.monotonic() > deadline:
                return f"{reply['left_blocks']} blocks still held by leases after {wait_s} s"
            time.sleep(0.05)


def reset_or_log(clients: Iterable[Client], where: str) -> bool:
    """`reset_tenants`, its failure logged as `where`'s; done?"""
    why = reset_tenants(clients)
    if why is not None:
        log.warning("kvtier reset (%s): %s; the reset failed", where, why)
    return why is None
