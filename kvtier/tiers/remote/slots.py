"""The checks a node's slot table (its CLUSTER SLOTS reply) passes before redis-py reads it.

redis-py builds its slot map from the table as the node sent it: for each range it sets every
slot from the range's start to its end (`for i in range(start, end + 1)`), and it makes a
client with a connection pool for each node the table names. A hostile or broken node (or
whoever answers in its place without TLS) could send a 60-byte table naming slots 0 to 10**12:
a connect, and every refresh after a failure, then filled a dict until the process died of
memory (seen: 3 GB in 15 s for 10**8 slots). So a table is checked first, on the connection
that read it (`connection.SplitValueConnection`), and one that fails is an error of the node
that sent it (`SlotTableError`): the connect or refresh that asked counts it and tries the next
startup node, and no slot map is built from it.

    table = [range, ...]             at most SLOTS ranges
    range = [start, end, node, ...]  0 <= start <= end < SLOTS; SLOTS slots in all, at most
    node  = [host, port, ...]        host: bytes, str or nil, <= HOST_CHARS; port in [0, 65535]

and the table names at most `MAX_NODES` distinct nodes (each one costs a client and a pool).
Extra fields of a node (its id, Redis 7's metadata) are left to redis-py, within the bytes a
reply may take (`connection.CONTROL_REPLY_BYTES`).
"""

from __future__ import annotations

from typing import Any

SLOTS = 16384
"""A Redis Cluster's hash slots."""

MAX_NODES = 4096
"""The most distinct nodes a slot table may name: twice the largest clusters Valkey supports
(2,000 nodes); a hostile table naming 16,384 cost a connect 170 MB and 8.6 s of CPU here."""

HOST_CHARS = 255
"""The longest host a table may name (a DNS name has at most 253 characters)."""


class SlotTableError(Exception):
    """A node's slot table that fails the checks (module doc); the message says which."""


def check_slot_table(table: Any) -> None:
    """`SlotTableError` unless `table` (a CLUSTER SLOTS reply as redis-py parsed it) is a slot
    table as the module doc draws it."""
    if not isinstance(table, list) or len(table) > SLOTS:
        raise SlotTableError(
            f"slot table: got {_kind(table)}, expected a list of <= {SLOTS} ranges"
        )
    covered = 0
    nodes: set[tuple[Any, int]] = set()
    for entry in table:
        if not isinstance(entry, list) or len(entry) < 3:
            raise SlotTableError(
                f"slot table range: got {_kind(entry)}, expected [start, end, node, ...]"
            )
        start, end = entry[0], entry[1]
        if not (_int(start) and _int(end) and 0 <= start <= end < SLOTS):
            raise SlotTableError(
                f"slot table range: got slots {_shown(start)} to {_shown(end)}, "
                f"expected 0 <= start <= end < {SLOTS}"
            )
        covered += end - start + 1
        if covered > SLOTS:
            raise SlotTableError(f"slot table: its ranges hold more than the {SLOTS} slots")
        for node in entry[2:]:
            nodes.add(_node(node))
        if len(nodes) > MAX_NODES:
            raise SlotTableError(f"slot table: names more than {MAX_NODES} nodes")


def _node(node: Any) -> tuple[Any, int]:
    """`(host, port)` of a node entry, checked."""
    if not isinstance(node, list) or len(node) < 2:
        raise SlotTableError(f"slot table node: got {_kind(node)}, expected [host, port, ...]")
    host, port = node[0], node[1]
    if not (host is None or isinstance(host, bytes | str)) or len(host or "") > HOST_CHARS:
        raise SlotTableError(
            f"slot table node: got host {_kind(host)}, expected at most {HOST_CHARS} characters"
        )
    if not (_int(port) and 0 <= port <= 65535):
        raise SlotTableError(f"slot table node: got port {_shown(port)}, expected 0 to 65535")
    return host, port


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """`value` for a message: an integer as it is, anything else by its kind."""
    return str(value) if _int(value) else _kind(value)


def _kind(value: Any) -> str:
    """What `value` is, in a few words: never its whole text (a node sent it)."""
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, bytes | str):
        return f"a string of {len(value)} characters"
    return type(value).__name__
