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
  `TransportError`, `OSError`), none is asked for `QUIET_S` (10 s), or until the sidecar
  answers again, whichever comes first: a probe on a thread of its own asks every `PROBE_S`
  (0.5 s; a lookup of one token, by a client already made), and its first answer ends the
  quiet. Those requests are misses, each counted in `skipped_lookups`. A refusal the sidecar
  answered (one tenant's key refused, a 503 while it recovers) came at once, and silences
  nothing: it may be that tenant's alone.

A sidecar that hangs then costs the scheduler one `LOOKUP_TIMEOUT_S` every `QUIET_S`, not one
per request, and one restarted (systemd brings it back in a second or two) or resumed costs
about `PROBE_S` of misses after it answers again, not the rest of `QUIET_S` (before the probe:
every request for 10 s after the one unanswered call). The workers' loads and saves (larger,
on threads of their own but for a synchronous load) and the scheduler's reset after a weight
update (whose failure vLLM must hear) wait `kvtier.timeout_s` (`settings.WORKER_TIMEOUT_S`,
120 s, by default) a call; after a load or save goes unanswered, a worker tries none for
`QUIET_S` or until its probe is answered (`Clients`): a load then fails at once (vLLM
recomputes), a save is skipped (`skipped_saves`), so the saves queued behind a hung one, and
the finished requests whose blocks vLLM holds for them, wait one
`kvtier.timeout_s`, not one each.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from kvtier.client import Client, TransportError
from kvtier.client.connections import TransportTimeout
from kvtier.errors import ConfigError, KVTierError
from kvtier.integrations.settings import REFUSALS, ConnectorSettings, masked

T = TypeVar("T")

log = logging.getLogger("kvtier.vllm")

LOOKUP_TIMEOUT_S = 5.0
QUIET_S = 10.0
PROBE_S = 0.5
START_WAIT_S = 30.0
"""How long a vLLM worker waits at start for its sidecar to answer (`served_layout`)."""
PROBE_TOKENS = [0]
"""A probe's lookup: one token, less than a block, so it matches nothing and moves nothing,
but it takes the store's lock as every call does (a sidecar hung under it stays quiet)."""


def timed_out(error: BaseException) -> bool:
    """Whether `error` is a call that ran out of time (the sidecar may be alive but slow), not
    one that could not reach it (refused, reset, closed)."""
    return isinstance(error, TransportTimeout | TimeoutError)


def unanswered(error: BaseException) -> bool:
    """Whether `error` says the sidecar did not answer (`TransportError`, an `OSError` of the
    socket), not a refusal it answered (a 503 `StorageError` is an `OSError` too)."""
    answered = isinstance(error, KVTierError) and not isinstance(error, TransportError)
    return not answered and isinstance(error, TransportError | OSError)


class Quiet:
    """A sidecar that did not answer is not asked again for `quiet_s`, or until `probe` (one
    call to it; None: no probe) is answered, tried every `PROBE_S` on a thread of its own
    (module doc): shared by the vLLM scheduler's lookups and SGLang's storage threads
    (`sglang.py`). A probe's answer ends the quiet only once the sidecar was seen out of reach:
    a failure that was no timeout (refused, reset), or a probe that went unanswered too. A call
    that timed out on a sidecar that answers probes at once (alive, but slower than the timeout:
    a save larger than it allows, a slow disk) keeps the whole quiet, so the calls queued
    behind it wait one timeout, not one each (review 3). `probes_answered` counts the quiet
    periods a probe ended early."""

    def __init__(self, quiet_s: float = QUIET_S, probe: Callable[[], object] | None = None):
        self.quiet_s = quiet_s
        self.probe = probe
        self.probes_answered = 0
        self._quiet_until = 0.0  # monotonic: no call before it
        self._probing = False  # a probe's thread runs (one at most)
        self._out_of_reach = False  # this quiet period's: what lets a probe's answer end it
        self._window = threading.Lock()

    def open(self) -> bool:
        """Whether a call may be made now (none for `quiet_s` after one went unanswered)."""
        return time.monotonic() >= self._quiet_until

    def failed(self, error: BaseException) -> None:
        """A call failed with `error`: make none for `quiet_s` if the sidecar did not answer
        (`unanswered`), and probe it meanwhile."""
        if not unanswered(error):
            return
        with self._window:
            if self.open():  # a new quiet period
                self._out_of_reach = False
            self._out_of_reach |= not timed_out(error)
            self._quiet_until = time.monotonic() + self.quiet_s
            if self.probe is None or self._probing:
                return
            self._probing = True
        threading.Thread(target=self._probe, name="kvtier-quiet-probe", daemon=True).start()

    def _probe(self) -> None:
        """Every `PROBE_S` while quiet: one `probe`; its answer (a reply, or a refusal the
        sidecar made) opens the way again where the sidecar was seen out of reach (class doc),
        else ends the probing. Ends with the quiet period (checked under the lock `failed`
        starts a probe under, so a new period always has one)."""
        assert self.probe is not None
        while True:
            time.sleep(PROBE_S)
            with self._window:
                if self.open():
                    self._probing = False
                    return
            try:
                self.probe()
            except Exception as error:  # any answer but "none" ends the quiet (docstring)
                if unanswered(error):
                    with self._window:
                        self._out_of_reach = True
                    continue
            with self._window:
                self._probing = False
                if not self._out_of_reach:  # alive all along, only slow: the quiet stays
                    return
                self._quiet_until = 0.0
                self.probes_answered += 1
                return


class Clients(Quiet):
    """Clients on `url` by API key, made at first use: a call waits `timeout_s` at most (each
    of its tries, the same-host lane then HTTP, half of it). A `Quiet` of its own: a vLLM
    worker tries no load or save for `quiet_s` after one went unanswered, so that a hung
    sidecar costs the loads and saves queued behind it one wait, not one each (a finished
    request's blocks are held until its save is done)."""

    def __init__(self, url: str, timeout_s: float, quiet_s: float = QUIET_S):
        Quiet.__init__(self, quiet_s, self._probe_lookup)
        self.url, self.timeout_s = url, timeout_s
        self._clients: dict[str, Client] = {}
        self._lock = threading.Lock()

    def _probe_lookup(self) -> None:
        """`Quiet`'s probe: a lookup of `PROBE_TOKENS` by the last client made (a client
        comes before any failure)."""
        with self._lock:
            client = next(reversed(self._clients.values()), None)
        if client is not None:
            client.lookup(PROBE_TOKENS)

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


def served_layout(clients: Clients, key: str, field: str, wait_s: float | None = None) -> Any:
    """The model layout of the sidecar of `clients` (asked as `key`), which a vLLM worker checks
    its KV against at start, asked as `at_start` asks (`field`: `kvtier.url`)."""
    return at_start(lambda: clients.client(key).layout(), field, clients.url, "vLLM", wait_s)


def at_start(
    call: Callable[[], T], field: str, url: str, engine: str, wait_s: float | None = None
) -> T:
    """`call()`, an engine's first call to its sidecar at `url`. A sidecar that does not answer
    yet (started beside the engine, as a pod's containers are, or restarting) is asked again
    every `PROBE_S` for `wait_s` (`START_WAIT_S`); then a `ConfigError` naming `field` and the
    URL, never the bare connection error (before: at once, which failed the engine's start); so
    is one that answers 503 (recovering). Another refusal (a key it does not know) is raised at
    once. A sidecar that takes the connection and never answers holds each try for the client's
    call timeout, so the start may wait `wait_s` plus one such timeout."""
    wait_s = START_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call()
        except Exception as error:
            if not (unanswered(error) or getattr(error, "status", None) == 503):
                raise  # (503: recovering, as a sidecar with a disk tier does when it restarts)
            if time.monotonic() >= deadline:
                raise ConfigError(
                    field,
                    masked(url),
                    f"a kvtier sidecar answering within {wait_s:g} s of {engine}'s start "
                    f"(start `kvtier serve` first): {error}",
                ) from error
        time.sleep(PROBE_S)


class Counts(dict[str, int]):
    """The vLLM connector's counters by name (`vllm_stats.COUNTERS`), read as a dict, added to
    by the scheduler, a worker's step, its two load threads and its saves' thread: `add` holds
    a lock, so that no count is lost where `+=` on a dict is not atomic (a thread switch
    between its read and its store, or a free-threaded Python)."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__(dict.fromkeys(names, 0))
        self._lock = threading.Lock()

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            self[name] += count


def counted_key(
    settings: ConnectorSettings, request: Any, stats: Counts, count: bool
) -> str | None:
    """The API key of `request`'s tenant (`settings.key_for`; None: kvtier is not used for it),
    its refusal counted in `stats` (and logged the first time) when `count`."""
    key, refused = settings.key_for(request)
    if refused is not None and count:
        if not stats[refused]:
            log.warning(REFUSALS[refused])
        stats.add(refused)
    return key


def count_error(stats: Counts, what: str, error: BaseException) -> None:
    """A call to the sidecar (`what`) failed with `error`: counted in `stats`, logged (with its
    traceback when it is no `KVTierError` or `OSError`: a bug, to be found)."""
    stats.add("errors")
    unexpected = not isinstance(error, KVTierError | OSError)
    log.warning("kvtier %s failed: %s", what, error, exc_info=error if unexpected else None)
