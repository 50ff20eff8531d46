"""The remote tier's connection to a Redis / Valkey Cluster (issue 14): put, get, probe, delete
of block entries (`entry.py`), where every failure of the cluster is a miss, counted.

Contract:
- Nothing here raises because of the cluster: a node that is down, a cluster that is down at
  start, a timeout, a failover, a refused or unknown command, a value that is not the block
  asked for, all end as misses (`get` gives None, `present` stops the run, `put` stores
  nothing) and are counted in `stats()`. A caller's mistake (keys and expectations of
  different lengths) is an `InvalidArgumentError`.
- `get` serves a payload only when `entry.decode_value` accepted it against the block the
  caller expected; a value that fails (an empty one too: EXISTS, sent with the read, tells it
  from no key) is deleted (it can never become right) and counted in `verify_failures`. It
  asks for at most `entry.max_value_nbytes` of each value (GETRANGE) and reads a reply no
  further (`rounds.reply_bound`): a huge value or reply costs no more memory than a block.
- `put` writes with `SET ... NX`: a block some node stored already is left as it is (same id,
  same bytes: ids are chained from the tokens) and counted in `already_present`. A value
  larger than `max_value_bytes` is not sent (`too_large`; `last_error` says their sizes). A
  value may be an `entry.SplitValue`: its header and payload go out one after the other as one
  Redis value (`SplitValueConnection`), so the payload is never copied into a joined buffer.
- One pipelined round trip per call to each node that serves one of its keys, sent and read
  by `rounds.py`: each command sent once, a redirect not followed, a node's failure a miss of
  its own keys only (the other nodes' replies stand), a node that could not be reached or did
  not answer in time down (misses at once) for `reconnect_s`, and the call's replies all in
  within `timeout_s` + their bytes / `paced.MIN_REPLY_RATE`. `group_blocks` in the keys
  (`entry.py`) keeps a group on one node.
- It connects on a thread of its own (`_connecting`), started when made (an idle node says
  whether it can reach the cluster) and then, while it has no connection, by a call at most once
  per `reconnect_s`; that thread asks the startup nodes for the slot table one at a time, each
  under the timeouts (`client.open_client`), and `close` stops it after the node it is trying.
  A call waits for a connect under way only until `CONNECT_WAIT` timeouts after it began (a
  healthy connect is a few round trips, each under `timeout_s`: a node just started finds what
  the cluster holds once that connect is in), and is a miss at once otherwise: a cluster down
  or stalled at start costs a call at most `CONNECT_WAIT` timeouts, however many startup nodes
  it has, and a store nothing more than a counter in between.
- `connected` is true while the last call reached a node that serves (a node's error reply,
  `-OOM` under `maxmemory` or an ACL's `-NOPERM`, came from one), false after one that reached
  none (no connection, timeouts: a cluster down since; or only `-CLUSTERDOWN` replies: nodes
  that answer but serve nothing, a cluster in `cluster_state:fail`), until a call reaches one
  again. A node with no call for `reconnect_s` probes when `stats()` is read (`liveness.py`).
- After a round trip with a failure in it (a node down, a redirect) the slot table is read again
  from the cluster, at most once per `REFRESH_S` and one read at a time (a read of a stalled
  cluster takes a timeout per node it asks: reads begun each second would pile up threads and
  sockets, one per second of it), on a thread of its own: a table read before
  the cluster promoted a replica or moved a slot keeps naming the old node, and its slots would
  stay misses.
- Thread-safe: the mover's threads and the store's callers may call at once.
- With `allowed` (`tiers.remote.allowed_nodes`, `kvtier.config.network`), a host the cluster
  names in its slot table is refused unless it is allowed (a redirect is never followed): no
  connection is made (redis-py calls `address_remap` on every address a node names before it
  connects), the call is a counted miss and `last_error` says which node was named
  (`NodeRefused`). A table naming one such host is refused whole: the cluster is not connected
  to.
- `last_error` (shown by `stats()`, so by the status API, `/readyz` and `kvtier status`) holds
  what a node said, so it is kept as `text.printable` makes it: control characters escaped, at
  most `ERROR_CHARS` characters.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis.cluster import ClusterNode, RedisCluster

from kvtier.config.network import NodeFilter
from kvtier.errors import InvalidArgumentError
from kvtier.text import ERROR_CHARS, printable
from kvtier.tiers.remote.client import ClusterSettings, TlsSettings, open_client, parse_node
from kvtier.tiers.remote.connection import Value, value_nbytes
from kvtier.tiers.remote.entry import (
    RemoteValueError,
    ValueMeta,
    decode_value,
    max_value_nbytes,
)
from kvtier.tiers.remote.liveness import Liveness, probe, served
from kvtier.tiers.remote.rounds import Down, round_trip

T = TypeVar("T")

__all__ = ["REFRESH_S", "ClusterSettings", "RemoteCluster", "TlsSettings", "parse_node"]

REFRESH_S = 1.0
"""After a failed round trip, the slot table is read again at most this often (module doc)."""

CONNECT_WAIT = 2
"""A call finds no connection: it waits this many `timeout_s` after a connect began for it (a
connect is a TCP connect, a handshake and a slot table read, each under `timeout_s`)."""

CLOSE_WAIT = 4
"""`close` waits this many `timeout_s` (and a second) for a connect under way to end: one
startup node's tries (a connect retried once, its handshake and its slot table read)."""

CLUSTER_FAILURES = (Exception,)
"""What a call into the cluster client may raise because of the cluster: its own errors
(`RedisError`; `RedisClusterException`, e.g. no node reachable at start; `OSError`) and
whatever else its handling of a broken or hostile reply raises. Seen with redis-py 8: an error
`-MOVED abc` or `-ASK x y` is a ValueError, an ASK to a node outside its slot table an
AttributeError, a bulk length past 2**63 an OverflowError. Each is a failure of the cluster."""

COUNTERS = ("puts", "already_present", "too_large", "hits", "misses", "verify_failures", "errors",
            "round_trips", "bytes_in", "bytes_out")  # fmt: skip


class RemoteCluster:
    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self._startup = [ClusterNode(*parse_node(node)) for node in settings.nodes]
        self._allowed = None if settings.allowed is None else NodeFilter.parse(settings.allowed)
        for node in self._startup:
            if self._allowed is not None and not self._allowed.allows(node.host):
                raise InvalidArgumentError(
                    f"remote node: got {node.name!r}, expected a node in allowed_nodes"
                )
        self._lock = threading.Lock()
        self._client: RedisCluster | None = None
        self._next_connect = self._wait_until = 0.0  # `_start_connect`
        self._connector: threading.Thread  # the last connect's (`_start_connect`)
        self._idle = threading.Event()  # clear while it connects
        self._idle.set()
        self._stats = dict.fromkeys(COUNTERS, 0)
        self._seconds = 0.0  # time spent in round trips
        self._refreshed_at = 0.0  # the last slot table read after a failure (`REFRESH_S`)
        self._refreshing = False  # a slot table read is under way (`_refresh`): one at a time
        self._down = Down(settings.reconnect_s)  # nodes that failed lately (`rounds.py`)
        self._liveness = Liveness(settings.reconnect_s)  # an idle node's probes (`stats`)
        self.last_error = ""
        self._reachable = self._closed = False  # `connected`; `close` called
        with self._lock:
            self._start_connect(time.monotonic())

    # ---- the calls ----------------------------------------------------------------------

    def put(self, entries: Sequence[tuple[bytes, Value]]) -> list[bool]:
        """Store each (key, value) unless the key exists; per entry, whether it is there now
        (stored, or present already). False where the cluster failed or the value is too big."""
        limit = self.settings.max_value_bytes
        sendable = [i for i, (_, value) in enumerate(entries) if value_nbytes(value) <= limit]
        if over := [value_nbytes(value) for _, value in entries if value_nbytes(value) > limit]:
            self._count("too_large", len(over))
            self._say(f"{len(over)} values of {min(over)} to {max(over)} bytes not sent: "
                      f"over max_value_bytes ({limit})")  # fmt: skip
        done = [False] * len(entries)
        replies = self._pipelined([("SET", *entries[i], "NX") for i in sendable])
        for i, reply in zip(sendable, replies or [], strict=False):
            if isinstance(reply, Exception):
                self._failed(reply)
                continue
            done[i] = True
            if reply:
                self._count("puts", 1)
                self._count("bytes_out", value_nbytes(entries[i][1]))
            else:
                self._count("already_present", 1)
        return done

    def get(
        self, keys: Sequence[bytes], expect: Sequence[ValueMeta]
    ) -> list[tuple[str, memoryview] | None]:
        """Per key, the (codec, stored payload) of the block `expect` describes, or None (a
        miss: absent, failed, or not that block; the last is deleted)."""
        if len(keys) != len(expect):
            raise InvalidArgumentError(
                f"remote get: {len(keys)} keys for {len(expect)} expected blocks"
            )

        ends = [max_value_nbytes(meta) - 1 for meta in expect]
        commands: list[tuple[Any, ...]] = []
        for key, end in zip(keys, ends, strict=True):
            commands += [("EXISTS", key), ("GETRANGE", key, 0, end)]
        replies = self._pipelined(commands) or []
        out: list[tuple[str, memoryview] | None] = []
        bad: list[bytes] = []
        for i, key in enumerate(keys):
            exists, reply = replies[2 * i : 2 * i + 2] if len(replies) > 2 * i + 1 else (0, None)
            if isinstance(reply, Exception):
                self._failed(reply)
                if str(reply).startswith("WRONGTYPE"):  # not a string: never a block of ours
                    bad.append(key)
                reply = None
            if not isinstance(reply, bytes) or not (reply or exists == 1):  # no key: b"" too
                out.append(None)
                continue
            try:
                if not reply:
                    raise RemoteValueError("an empty value")
                out.append(decode_value(reply, expect[i]))
            except RemoteValueError as e:
                self._say(f"{key.decode(errors='replace')}: {e.reason}")
                self._count("verify_failures", 1)
                bad.append(key)
                out.append(None)
                continue
            self._count("bytes_in", len(reply))
        self._count("hits", sum(1 for got in out if got is not None))
        self._count("misses", sum(1 for got in out if got is None))
        if bad:
            self.delete(bad)
        return out

    def present(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, exist in the cluster (one round trip)."""
        replies = self._pipelined([("EXISTS", key) for key in keys])
        count = 0
        for reply in replies or []:
            if isinstance(reply, Exception):
                self._failed(reply)
                break
            if not reply:
                break
            count += 1
        return count

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove `keys` (one round trip; failures only counted)."""
        self._pipelined([("DEL", key) for key in keys])

    # ---- state --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Connected, and the last call reached a node (module doc)."""
        return self._client is not None and self._reachable

    def stats(self) -> dict[str, Any]:
        """Counters since start, the time spent in round trips, and whether it is connected;
        with no call for `reconnect_s`, a probe starts (`liveness.py`) that the next shows."""
        if self._liveness.due():
            self._start_probe()
        with self._lock:
            figures: dict[str, Any] = dict(self._stats)
            figures["round_trip_seconds"] = round(self._seconds, 6)
        figures["connected"] = self.connected
        figures["last_error"] = self.last_error
        return figures

    def check(self) -> None:
        """No counter is negative."""
        with self._lock:
            assert all(value >= 0 for value in self._stats.values()), self._stats

    def close(self) -> None:
        """Drop the connection; a connect under way stops after the node it is trying, waited
        for here (at most `CLOSE_WAIT` timeouts and a second; a node that outlasts that is left
        to its socket timeout, and its client closed)."""
        with self._lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            client.close()
        self._connector.join(CLOSE_WAIT * self.settings.timeout_s + 1.0)

    # ---- inside -------------------------------------------------------------------------

    def _count(self, name: str, n: int) -> None:
        if n:
            with self._lock:
                self._stats[name] += n

    def _failed(self, error: Exception, where: str = "") -> None:
        """A call into the cluster failed with `error`: counted, and said."""
        self._say(f"{where}{type(error).__name__}: {error}")
        self._count("errors", 1)

    def _say(self, text: str) -> None:
        """Keep `text` (the cluster's words in it) as `last_error`, bounded (module doc)."""
        self.last_error = printable(text, ERROR_CHARS)

    def _connect(self) -> RedisCluster | None:
        """The client; None (a miss) while there is none. A call that finds none starts a
        connect when `reconnect_s` has passed since the last one began, and waits for a connect
        under way only until `CONNECT_WAIT` timeouts after it began (module doc)."""
        with self._lock:
            if self._client is not None or self._closed:
                return self._client
            now = time.monotonic()
            if self._idle.is_set() and now >= self._next_connect:
                self._start_connect(now)
            wait = self._wait_until - now
        if wait > 0:
            self._idle.wait(wait)
        return self._client

    def _start_connect(self, now: float) -> None:
        """Connect on a thread of its own (`_connecting`); the caller holds `_lock`."""
        self._next_connect = now + self.settings.reconnect_s
        self._wait_until = now + CONNECT_WAIT * self.settings.timeout_s
        self._idle.clear()
        self._connector = threading.Thread(
            target=self._connecting, name="kvtier-remote-connect", daemon=True
        )
        self._connector.start()

    def _connecting(self) -> None:
        """The startup nodes tried in turn, each alone under the timeouts, until one gives a
        slot table (installed) or `close` is called; no node's table: counted, once."""
        error: Exception | None = None
        try:
            for node in self._startup:
                if self._closed:
                    return
                try:
                    client = open_client(node, self.settings, self._allowed)
                except CLUSTER_FAILURES as e:
                    error = e
                    continue
                self._install(client)
                return
            if error is not None:
                self._failed(error, f"connect ({len(self._startup)} nodes): ")
        finally:
            self._idle.set()

    def _install(self, client: RedisCluster) -> None:
        """Keep `client`, the connecting thread's; closed instead when `close` came first."""
        with self._lock:
            kept = None if self._closed else client
            self._client, self._reachable = kept, kept is not None
        if kept is None:
            client.close()

    def _pipelined(self, commands: list[tuple[Any, ...]]) -> list[Any] | None:
        """The replies of `commands` (each a command and its arguments, the key first), one
        round trip to each node that serves one (`rounds.py`): a command's error, or its node's
        failure, is its reply; None when there is no cluster to call; [] for no command."""
        if not commands:
            return []
        replies = self._round_trip(
            lambda client: round_trip(client, commands, self.settings.timeout_s, self._down)
        )
        self._liveness.called()  # first: a probe under way no longer writes over what it says
        self._reachable = replies is not None and any(map(served, replies))
        if replies is not None and any(isinstance(r, Exception) for r in replies):
            client = self._client
            if client is not None:  # a redirect or a failed node: the table may have moved
                self._refresh(client)
        return replies

    def _start_probe(self) -> None:
        try:
            threading.Thread(target=self._probe, name="kvtier-remote-probe", daemon=True).start()
        except RuntimeError:  # no thread to be had: a later read asks again
            self._liveness.done(lambda: None)

    def _probe(self) -> None:
        """`liveness.probe` on this thread, its answer in `connected` unless a call ended since
        it began (that call's answer is newer: `Liveness.done`)."""
        reached = False
        try:
            client = self._connect()
            timeout, down = self.settings.timeout_s, self._down
            reached, why = (False, "") if client is None else probe(client, timeout, down)
            if why and client is not None:  # not reached: said, and the table read again
                self._say(f"liveness probe: {why}")
                self._refresh(client)
        finally:
            self._liveness.done(lambda: setattr(self, "_reachable", reached))

    def _refresh(self, client: RedisCluster) -> None:
        """Read the slot table again (module doc), at most once per `REFRESH_S`, on a thread
        of its own: the call that asked does not wait (a node that stalls would hold it for a
        timeout each time)."""
        with self._lock:
            now = time.monotonic()
            if self._refreshing or now - self._refreshed_at < REFRESH_S:
                return  # one read at a time: a stalled cluster holds one a timeout per node
            self._refreshed_at, self._refreshing = now, True

        def read() -> None:
            try:
                with contextlib.suppress(*CLUSTER_FAILURES):  # none answers: a next one retries
                    client.nodes_manager.initialize()
            finally:
                with self._lock:
                    self._refreshing = False

        try:
            threading.Thread(target=read, name="kvtier-remote-slots", daemon=True).start()
        except RuntimeError:  # no thread to be had: a later failure asks again
            with self._lock:
                self._refreshing = False

    def _round_trip(self, run: Callable[[RedisCluster], T]) -> T | None:
        """`run` on the cluster, timed and counted; None when the cluster failed it."""
        client = self._connect()
        if client is None:
            return None
        started = time.monotonic()
        try:
            return run(client)
        except CLUSTER_FAILURES as e:
            self._failed(e)
            self._refresh(client)
            return None
        finally:
            with self._lock:
                self._stats["round_trips"] += 1
                self._seconds += time.monotonic() - started
