"""The vLLM scheduler's questions to the sidecar: which tenant a request asks as, and how long
an answer may take.

vLLM asks a connector about every new request inside its scheduling loop
(`get_num_new_matched_tokens`), so a lookup that waits waits for every request the engine
serves. A sidecar that is down answers at once (connection refused: a miss); one that hangs
(stopped, swapping, a full disk under its lock) would hold the scheduler for a client's
timeout (120 s) at every new request. So:

- a lookup waits `LOOKUP_TIMEOUT_S` (5 s; a lookup is a hash walk over the prompt's blocks,
  0.07 s for 1M tokens on a sidecar that works) at most, plus the resolution of the sidecar's
  host name (give an IP address): its client's timeout is half of it, since a call first
  tries the same-host lane (0.1 ms a lookup against 0.6 over HTTP, in vLLM's scheduling loop)
  and, when that gives up, HTTP; the client's first call, mapping the pools, is bounded so
  too; and
- after a lookup fails for want of an answer (a timeout, a connection refused or cut:
  `TransportError`, `OSError`), none is asked for `QUIET_S` (10 s): those requests are
  misses, each counted in `skipped_lookups`; the next one after it asks again. A refusal the
  sidecar answered (one tenant's key refused, a 503 while it recovers) came at once, and
  silences nothing: it may be that tenant's alone.

A sidecar that hangs then costs the scheduler one `LOOKUP_TIMEOUT_S` every `QUIET_S`, not one
per request. The workers' loads and saves (larger, on threads of their own but for a
synchronous load) and the scheduler's reset after a weight update (whose failure vLLM must
hear) wait `kvtier.timeout_s` (`settings.WORKER_TIMEOUT_S`, 120 s, by default) a call; after
a load or save goes unanswered, a worker tries none for `QUIET_S` (`Clients`): a load then
fails at once (vLLM recomputes), a save is skipped (`skipped_saves`), so the saves queued
behind a hung one, and the finished requests whose blocks vLLM holds for them, wait one
`kvtier.timeout_s`, not one each.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvtier.client import Client, TransportError
from kvtier.errors import KVTierError
from kvtier.integrations.settings import REFUSALS, ConnectorSettings

log = logging.getLogger("kvtier.vllm")

LOOKUP_TIMEOUT_S = 5.0
QUIET_S = 10.0


class Quiet:
    """A sidecar that did not answer is not asked again for `quiet_s` (module doc): shared by
    the vLLM scheduler's lookups and SGLang's storage threads (`sglang.py`)."""

    def __init__(self, quiet_s: float = QUIET_S):
        self.quiet_s = quiet_s
        self._quiet_until = 0.0  # monotonic: no call before it

    def open(self) -> bool:
        """Whether a call may be made now (none for `quiet_s` after one went unanswered)."""
        return time.monotonic() >= self._quiet_until

    def failed(self, error: BaseException) -> None:
        """A call failed with `error`: make none for `quiet_s` if the sidecar did not answer
        (`TransportError`, an `OSError` of the socket; not a refusal it answered, such as a
        503 `StorageError`, which is an `OSError` too)."""
        answered = isinstance(error, KVTierError) and not isinstance(error, TransportError)
        if not answered and isinstance(error, TransportError | OSError):
            self._quiet_until = time.monotonic() + self.quiet_s


class Clients(Quiet):
    """Clients on `url` by API key, made at first use: a call waits `timeout_s` at most (each
    of its tries, the same-host lane then HTTP, half of it). A `Quiet` of its own: a vLLM
    worker tries no load or save for `quiet_s` after one went unanswered, so that a hung
    sidecar costs the loads and saves queued behind it one wait, not one each (a finished
    request's blocks are held until its save is done)."""

    def __init__(self, url: str, timeout_s: float, quiet_s: float = QUIET_S):
        Quiet.__init__(self, quiet_s)
        self.url, self.timeout_s = url, timeout_s
        self._clients: dict[str, Client] = {}
        self._lock = threading.Lock()

    def client(self, key: str) -> Client:
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = Client(self.url, api_key=key or None, timeout_s=self.timeout_s / 2)
                self._clients[key] = client
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


class Lookups(Clients):
    """Clients for the scheduler's lookups, by API key, on `url` (module doc)."""

    def __init__(self, url: str, timeout_s: float = LOOKUP_TIMEOUT_S, quiet_s: float = QUIET_S):
        Clients.__init__(self, url, timeout_s, quiet_s)


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


def count_error(stats: dict[str, int], what: str, error: BaseException) -> None:
    """A call to the sidecar (`what`) failed with `error`: counted in `stats`, logged (with its
    traceback when it is no `KVTierError` or `OSError`: a bug, to be found)."""
    stats["errors"] += 1
    unexpected = not isinstance(error, KVTierError | OSError)
    log.warning("kvtier %s failed: %s", what, error, exc_info=error if unexpected else None)
