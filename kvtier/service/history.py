"""The store's figures over the last minutes: a ring of samples, for the status page's charts.

    history = History()                 # SAMPLE_S apart, KEEP of them (10 minutes)
    history.start(store)                # a daemon thread samples store.status() until stop()
    history.samples()                   # a copy, oldest first
    history.rates()                     # per interval: hit rate by tier, bytes/s by path
    history.stop()

Contract:
- A sample holds the global counters the charts need (lookup and hit tokens, hits per tier,
  bytes per path, used bytes per tier), never a tenant's view: the charts are for viewers of
  the global figures only (the page's admin key, or no auth).
- `rates()` is computed from consecutive samples: the hit rate of an interval is the tokens its
  lookups found over the tokens they asked (None in an interval without lookups, so a quiet
  minute is a gap, not a 0 %), split by tier as the hit blocks' tokens; a path's bandwidth is
  the bytes it moved over the interval's length. Counters only grow; an interval across a
  restart of the counters (none today) would read as a gap.
- Time is the monotonic clock's (`t`): the intervals' lengths, the samples' order and the
  charts' time axis (`render.py`) are right across a jump of the wall clock (a correction, a
  resume from suspend), which the history does not read.
- Sampling is one `store.status()` every `interval_s` on its own thread; a status that fails
  because the store closed ends the thread quietly (the page then shows what the ring holds);
  any other failure is logged (once) and skipped: the next sample's interval is that much
  longer (its rates the average over it), and the charts go on.

Invariants (`check()`): at most `keep` samples, times strictly increasing.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.errors import ClosedError, InvariantError

SAMPLE_S = 2.0
KEEP = 300
log = logging.getLogger(__name__)


class _Status(Protocol):
    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Sample:
    """The global figures at `t` (monotonic seconds)."""

    t: float
    lookup_tokens: int
    hit_tokens: int
    hits: dict[str, int]  # tier -> blocks found there by lookups, since start
    used_bytes: dict[str, int]  # tier -> bytes held now
    path_bytes: dict[str, int]  # path -> bytes moved, since start
    block_tokens: int

    @classmethod
    def of(cls, status: dict[str, Any], t: float) -> Sample:
        tiers = status["tiers"]
        return cls(
            t=t,
            lookup_tokens=status["ops"]["lookup_tokens"],
            hit_tokens=status["ops"]["hit_tokens"],
            hits={tier: figures["hits"] for tier, figures in tiers.items()},
            used_bytes={tier: figures["used_bytes"] for tier, figures in tiers.items()},
            path_bytes={path: moved["bytes"] for path, moved in status["paths"].items()},
            block_tokens=status["layout"]["block_tokens"],
        )


@dataclass(frozen=True)
class Rates:
    """One interval's figures, ending at `t` (monotonic seconds) and lasting `seconds`."""

    t: float
    seconds: float
    hit_rate: float | None  # None: no lookups in the interval
    tier_hit_rate: dict[str, float | None]
    bytes_per_s: dict[str, float]  # path -> bandwidth


def rates_between(a: Sample, b: Sample) -> Rates:
    """The figures of the interval from `a` to `b` (module doc)."""
    seconds = b.t - a.t
    asked = b.lookup_tokens - a.lookup_tokens
    found = b.hit_tokens - a.hit_tokens
    per_tier: dict[str, float | None] = {}
    for tier, hits in b.hits.items():
        blocks = hits - a.hits.get(tier, 0)
        per_tier[tier] = min(1.0, blocks * b.block_tokens / asked) if asked > 0 else None
    bandwidth = {
        path: (moved - a.path_bytes.get(path, 0)) / seconds for path, moved in b.path_bytes.items()
    }
    return Rates(
        t=b.t,
        seconds=seconds,
        hit_rate=found / asked if asked > 0 else None,
        tier_hit_rate=per_tier,
        bytes_per_s=bandwidth,
    )


class History:
    """A ring of `Sample`s, filled by a sampling thread (module doc)."""

    def __init__(self, interval_s: float = SAMPLE_S, keep: int = KEEP) -> None:
        assert interval_s > 0 and keep >= 2
        self.interval_s, self.keep = interval_s, keep
        self._ring: deque[Sample] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed = 0  # samples whose status failed otherwise than by the store closing

    def start(self, store: _Status) -> None:
        """Sample `store` now and then every `interval_s`, on a daemon thread."""
        assert self._thread is None, "started twice"
        self.take(store)
        self._thread = threading.Thread(
            target=self._run, args=(store,), name="kvtier-history", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (the samples stay); returns once the thread is gone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def take(self, store: _Status) -> None:
        """Add one sample of `store` now."""
        sample = Sample.of(store.status(), time.monotonic())
        with self._lock:
            if not self._ring or sample.t > self._ring[-1].t:
                self._ring.append(sample)

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._ring)

    def rates(self) -> list[Rates]:
        """Each interval between consecutive samples, oldest first."""
        ring = self.samples()
        return [rates_between(a, b) for a, b in itertools.pairwise(ring)]

    def check(self) -> None:
        ring = self.samples()
        if len(ring) > self.keep:
            raise InvariantError(f"history: {len(ring)} samples, more than keep={self.keep}")
        for a, b in itertools.pairwise(ring):
            if not b.t > a.t:
                raise InvariantError(f"history: sample times {a.t} then {b.t}, not increasing")

    def _run(self, store: _Status) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.take(store)
            except ClosedError:  # the store closing under us: keep what the ring holds
                return
            except Exception as e:  # one sample lost (a longer interval), not every later one
                if not self.failed:
                    log.warning("status history: a sample failed (%s); sampling on", e)
                self.failed += 1
