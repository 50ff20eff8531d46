"""One round trip to the cluster's nodes, sent and read by kvtier (`cluster.RemoteCluster`'s
calls), not by redis-py's cluster pipeline.

Why not redis-py's: when a node timed out, its cluster pipeline sent that node's commands again
one at a time, each on a new connection whose handshake waited a whole timeout, with a retry (a
lookup of a 128-token prefix on a stalled node took 13 s under `timeout_s` 0.5, and the time
grew with the keys); one node's failure voided the replies of every node (a dead primary made
each prefix that touched it a miss from its first block, and dropped the writes bound for live
primaries); and its one-command re-send packed a `SplitValue` with redis-py's own packer, a
`DataError` for every write that met a redirect.

    round_trip(client, commands, timeout_s, down) -> replies, one per command, in order

Contract:
- A command is (name, key, *args); its node is the primary that serves its key's slot in
  `client`'s slot table. Every node's commands go out in one write before any reply is read,
  so the nodes work at once; a node's replies are read, in order, once its first bytes are in
  (`poll`), so a node that is slow holds up no other.
- No command is sent twice. A reply is what the node answered: for an error reply
  (`-WRONGTYPE`, `-MOVED`, `-ASK`, `-CLUSTERDOWN`, ...) the exception redis-py's parser makes of
  it (a redirect is not followed: the caller counts a miss and reads the slot table again). A
  node's failure (no connection, a timeout, a closed or broken stream, a reply the parser
  cannot make sense of) is a `NodeFailed` for each of its commands not answered yet, and for
  those only: the other nodes' replies stand.
- Bounded: the call's reads share one `paced.Pace` begun with the call, so every reply of it
  is in within `timeout_s` + its bytes so far / `paced.MIN_REPLY_RATE`; a node not connected
  yet is connected to only while that holds, at the cost of at most its connect (tried twice)
  and handshake, each under `timeout_s`.
- Bounded in bytes: a node's replies may take what its commands asked for (`reply_bound`: a
  GETRANGE's range, plus `REPLY_SLACK` a command for the framing, a status, an error line),
  read under one `paced.Budget`; a node that sends more (a GETRANGE answered with a bulk of
  gigabytes) fails once its bytes pass that bound (`paced.ReplyTooLong`, its connection
  closed), before the parser buffers the rest: a call holds no more than it asked for.
- A node that could not be reached or did not answer in time (`UNREACHED`) is down (`Down`)
  for `down_s`: its commands fail at once, with no connection tried, so a stalled node costs
  one timeout per `down_s`, not one per call.
- Thread-safe: each call takes its own connection of each node from that node's pool and gives
  it back (closed where it failed).
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.tiers.remote.paced import Budget, Pace

REPLY_SLACK = 1024
"""Bytes a reply to any command may take beyond the value it asked for (module doc): RESP
framing, an integer or a status, an error line (a `-NOPERM` names its key)."""

UNREACHED = (RedisConnectionError, RedisTimeoutError, OSError)
"""A node's failures that put it down: it could not be reached or did not answer in time. A
reply it answered that cannot be parsed closes the connection only (the next call tries it)."""


def reply_bound(command: Sequence[Any]) -> int:
    """The most bytes a node's reply to `command` ((name, key, *args)) may take: a
    GETRANGE's range (`start`..`end`, both >= 0) and `REPLY_SLACK`; any other's, the slack."""
    name = command[0]
    if (name.decode() if isinstance(name, bytes) else str(name)).upper() == "GETRANGE":
        return max(0, int(command[3]) - int(command[2]) + 1) + REPLY_SLACK
    return REPLY_SLACK


class NodeFailed(Exception):
    """The node that serves a command's key failed before answering it (module doc)."""

    def __init__(self, node: str, why: str) -> None:
        super().__init__(f"{node}: {why}")


class Down:
    """The nodes that failed lately, each until `down_s` after its failure (module doc)."""

    def __init__(self, down_s: float) -> None:
        self.down_s = down_s
        self._until: dict[str, tuple[float, str]] = {}  # node: (until, why)
        self._lock = threading.Lock()

    def failed(self, node: str, why: str) -> None:
        with self._lock:
            self._until[node] = (time.monotonic() + self.down_s, why)

    def why(self, node: str) -> str | None:
        """Why `node` is down now, or None where it may be tried."""
        with self._lock:
            until, why = self._until.get(node, (0.0, ""))
            if until <= time.monotonic():
                self._until.pop(node, None)
                return None
            return f"down for {until - time.monotonic():.1f} s more after {why}"


def round_trip(
    client: RedisCluster, commands: Sequence[tuple[Any, ...]], timeout_s: float, down: Down
) -> list[Any]:
    """The replies of `commands`, one round trip to each node that serves one (module doc)."""
    pace = Pace(timeout_s)
    cluster: Any = client  # redis-py's calls are untyped
    replies: list[Any] = [None] * len(commands)
    by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
    for i, command in enumerate(commands):
        try:
            node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(command[1]))
        except Exception as e:  # a slot no node serves, a key it cannot hash: this one fails
            replies[i] = e
            continue
        by_node.setdefault(node.name, (node, []))[1].append(i)

    sent: list[tuple[str, Any, Any, list[int]]] = []  # node, pool, connection, commands
    for name, (node, indices) in by_node.items():
        if (why := down.why(name)) is not None:
            _fail(replies, indices, NodeFailed(name, why))
            continue
        if pace.left() <= 0:
            _fail(replies, indices, NodeFailed(name, "the call's time ran out before it"))
            continue
        pool: Any = None
        conn: Any = None
        try:
            pool = cluster.get_redis_connection(node).connection_pool
            conn = pool.get_connection()
            conn.send_packed_command(
                conn.pack_commands([commands[i] for i in indices]), check_health=False
            )
        except Exception as e:
            _failed(replies, indices, name, e, down)
            _close(pool, conn)
            continue
        sent.append((name, pool, conn, indices))
        conn.budget = Budget(sum(reply_bound(commands[i]) for i in indices))

    # each node's replies once its first bytes are in: a node that stalls holds no other up
    waiting = {conn.fileno(): (name, pool, conn, indices) for name, pool, conn, indices in sent}
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        ready = [fd for fd, _ in poller.poll(max(0.0, pace.left()) * 1000)]
        if not ready:
            for name, pool, conn, indices in waiting.values():
                _failed(replies, indices, name, TimeoutError("no reply in the call's time"), down)
                conn.budget = None
                _close(pool, conn)
            break
        for fd in ready:
            poller.unregister(fd)
            _read(replies, waiting.pop(fd), pace, down)
    return replies


def _read(
    replies: list[Any], sent: tuple[str, Any, Any, list[int]], pace: Pace, down: Down
) -> None:
    """Read the replies of one node's commands, in order, into `replies` (module doc)."""
    name, pool, conn, indices = sent
    conn.pace = pace
    answered = 0
    try:
        for i in indices:
            try:
                replies[i] = conn.read_response()
            except ResponseError as e:  # the node's error reply to this command
                replies[i] = e
            answered += 1
    except Exception as e:
        _failed(replies, indices[answered:], name, e, down)
        conn.pace = conn.budget = None
        _close(pool, conn)
        return
    conn.pace = conn.budget = None
    pool.release(conn)


def _failed(
    replies: list[Any], indices: Sequence[int], node: str, error: Exception, down: Down
) -> None:
    """`node` failed (`error`) before answering the commands at `indices`; down if unreached."""
    why = f"{type(error).__name__}: {error}"
    _fail(replies, indices, NodeFailed(node, why))
    if isinstance(error, UNREACHED):
        down.failed(node, why)


def _fail(replies: list[Any], indices: Sequence[int], error: Exception) -> None:
    for i in indices:
        replies[i] = error


def _close(pool: Any, conn: Any) -> None:
    """Give back a connection whose stream is in an unknown state, closed."""
    if conn is None:
        return
    try:
        conn.disconnect()
    finally:
        pool.release(conn)
