"""The vLLM scheduler's questions to the sidecar: which tenant a request asks as, and how long
an answer may take.

vLLM asks a connector about every new request inside its scheduling loop
(`get_num_new_matched_tokens`), so a lookup that waits waits for every request the engine
serves. A sidecar that is down answers at once (connection refused: a miss); one that hangs
(stopped, swapping, a full disk under its lock) would hold the scheduler for a client's
timeout (120 s) at every new request. So:

- a lookup's client waits `LOOKUP_TIMEOUT_S` (5 s; a lookup is a hash walk over the prompt's
  blocks, milliseconds on a sidecar that works), and
- after a lookup fails, none is asked for `QUIET_S` (10 s): those requests are misses, each
  counted in `skipped_lookups`; the next one after it asks again.

A sidecar that hangs then costs the scheduler one `LOOKUP_TIMEOUT_S` every `QUIET_S`, not one
per request. The workers' loads and saves (larger, on threads of their own but for a
synchronous load) and the scheduler's reset after a weight update (whose failure vLLM must
hear) keep the client's own timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvtier.client import Client
from kvtier.integrations.settings import REFUSALS, ConnectorSettings

log = logging.getLogger("kvtier.vllm")

LOOKUP_TIMEOUT_S = 5.0
QUIET_S = 10.0


class Lookups:
    """Clients for the scheduler's lookups, by API key, on `url` (module doc)."""

    def __init__(self, url: str, timeout_s: float = LOOKUP_TIMEOUT_S, quiet_s: float = QUIET_S):
        self.url, self.timeout_s, self.quiet_s = url, timeout_s, quiet_s
        self._clients: dict[str, Client] = {}
        self._lock = threading.Lock()
        self._quiet_until = 0.0  # monotonic: no lookup before it

    def open(self) -> bool:
        """Whether a lookup may be asked now (none for `quiet_s` after one failed)."""
        return time.monotonic() >= self._quiet_until

    def failed(self) -> None:
        """A lookup failed: ask none for `quiet_s`."""
        self._quiet_until = time.monotonic() + self.quiet_s

    def client(self, key: str) -> Client:
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = Client(
                    self.url, api_key=key or None, shared_memory=False, timeout_s=self.timeout_s
                )
                self._clients[key] = client
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def counted_key(
    settings: ConnectorSettings, request: Any, stats: dict[str, int], count: bool
) -> str | None:
    """The API key of `request`'s tenant (`settings.key_for`; None: kvtier is not used for it),
    its refusal counted in `stats` (and logged the first time) when `count`."""
    key, refused = settings.key_for(request)
    if refused is not None and count:
        if not stats[refused]:
            log.warning(REFUSALS[refused])
        stats[refused] += 1
    return key
