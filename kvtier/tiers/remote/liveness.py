"""Keeps `RemoteCluster.connected` true to the cluster on a node that makes no calls.

`connected` says what the node's last call reached (`cluster.py`), so a node that makes none
(an idle sidecar) kept saying it: `connected`, `/readyz` and `kvtier_remote_connected 1` (the
shipped `KvtierRemoteDisconnected` alert silent) with its cluster dead for hours, or `not
connected` with it back. So when that state is read and no call was made for `every_s`, a
probe is due (`Liveness.due`, one at a time): `probe` sends one EXISTS of `PROBE_KEY` (a key
no block has: `entry.py`), in one `rounds.round_trip`, and says whether a node that serves
answered (`served`); the cluster runs it on a thread of its own, uncounted (it is no call of
the store's), and the next read shows what it reached. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, ResponseError

from kvtier.tiers.remote.rounds import Down, round_trip

PROBE_KEY = b"kvtier:liveness-probe"
"""Never a block's key (`<prefix>:v1:{<tag>}:<id>`, `entry.py`): an EXISTS of it reads nothing."""


def served(reply: Any) -> bool:
    """Whether `reply` came from a node that serves: an answer, or an error reply (-OOM,
    -NOPERM, -MOVED), but not -CLUSTERDOWN (nor -MASTERDOWN, its kind): a cluster in
    `cluster_state:fail` answers every command so, and serves nothing."""
    if isinstance(reply, ClusterDownError):
        return False
    return isinstance(reply, ResponseError) or not isinstance(reply, Exception)


def probe(client: RedisCluster, timeout_s: float, down: Down) -> tuple[bool, str]:
    """(whether a node that serves answered one EXISTS of `PROBE_KEY`, why not if it did not);
    one round trip, within `timeout_s` (`rounds.py`)."""
    try:
        reply = round_trip(client, [("EXISTS", PROBE_KEY)], timeout_s, down)[0]
    except Exception as e:  # whatever the cluster client raises: not reached (`cluster.py`)
        reply = e
    return served(reply), "" if served(reply) else f"{type(reply).__name__}: {reply}"


class Liveness:
    """When a probe of an idle node's cluster is due: no call for `every_s`, none under way."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._called_at = time.monotonic()
        self._probing = False
        self._calls = self._since = 0  # calls ended; and when the probe under way began

    def called(self) -> None:
        """A call of the node's ended, before it says what it reached: a probe under way then
        leaves that alone (`done`)."""
        with self._lock:
            self._called_at = time.monotonic()
            self._calls += 1

    def due(self) -> bool:
        """True (and a probe under way until `done`) when one should start now."""
        with self._lock:
            if self._probing or time.monotonic() - self._called_at < self.every_s:
                return False
            self._probing, self._since = True, self._calls
            return True

    def done(self, say: Callable[[], None]) -> None:
        """The probe ended: `say` what it reached (under the lock), unless a call ended since it
        began, whose answer is newer (a probe that began earlier never writes over it)."""
        with self._lock:
            if self._calls == self._since:
                say()
            self._probing = False
            self._called_at = time.monotonic()
