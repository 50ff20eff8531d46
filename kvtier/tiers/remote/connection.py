"""The redis-py connection the remote tier's cluster client uses (`cluster.py`): it sends a
value's header and payload one after the other as one Redis value, the payload from where it
lies (`entry.SplitValue`), and reads replies through a `paced.PacedSocket`, each bounded in
bytes (a round trip's by what its commands asked for, `rounds.py`; any other, a slot table, the
command table, a handshake's, by `CONTROL_REPLY_BYTES`), a slot table checked before redis-py
builds its slot map from it (`slots.py`); and the check that keeps it off nodes outside
`tiers.remote.allowed_nodes` (`only_allowed`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.connection import Connection, SSLConnection

from kvtier.config.network import NodeFilter
from kvtier.tiers.remote.entry import SplitValue
from kvtier.tiers.remote.paced import Budget, Pace, PacedSocket
from kvtier.tiers.remote.slots import check_slot_table

Value = bytes | memoryview | SplitValue
JOIN_BELOW = 6000  # chunks up to this size are joined into one send (redis-py's cutoff)

CONTROL_REPLY_BYTES = 16 * 2**20
"""The most bytes a reply read outside a round trip may take: a slot table (a few KiB; a
cluster of hundreds of nodes whose slots are scattered, a few MiB), the command table (90 KiB
from Redis 7), a handshake's. redis-py buffers a reply whole: before this bound a node's slot
table with a host name of 400 MiB took a connect 1.2 GB (and each refresh after it again)."""


def value_nbytes(value: Value) -> int:
    return value.nbytes if isinstance(value, SplitValue | memoryview) else len(value)


class SplitValueConnection(Connection):
    """A redis-py connection that also sends `SplitValue` arguments, as their parts: the RESP
    bulk string `$<n>CRLF<head><payload>CRLF` as chunks, the payload a memoryview sent as it
    is. Other commands are packed as redis-py packs them; small chunks are joined (as redis-py
    does) so a pipeline of probes is still one send. Its socket is a `paced.PacedSocket`: a
    reply dripped slower than `paced.MIN_REPLY_RATE` is a timeout; with `pace` set, the replies
    share that bound (`rounds.py`), and with `budget` set, their bytes are bounded by it."""

    pace: Pace | None = None  # the round trip's, while `rounds.round_trip` reads its replies
    budget: Budget | None = None  # the bytes its commands asked for, as long (`rounds.py`)
    slot_table_next = False  # the command sent last asked for the slot table (`send_command`)

    def _connect(self) -> Any:
        sock = super()._connect()
        return sock if self.socket_timeout is None else PacedSocket(sock, self.socket_timeout)

    def fileno(self) -> int:
        """The connected socket's descriptor (`rounds.py` polls it)."""
        sock: Any = self._sock
        return int(sock.fileno())

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        """redis-py's, noting whether it asks for the slot table (CLUSTER SLOTS: redis-py's
        own calls, a connect's and a refresh's), whose reply `read_response` checks."""
        self.slot_table_next = _asks_slot_table(args)
        super().send_command(*args, **kwargs)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        """redis-py's, bounded (module doc); a slot table that fails `slots.check_slot_table`
        raises its `SlotTableError` instead of reaching redis-py's slot map."""
        slot_table, self.slot_table_next = self.slot_table_next, False
        sock: object = self._sock
        if isinstance(sock, PacedSocket):
            budget = self.budget
            if budget is None:
                budget = Budget(CONTROL_REPLY_BYTES, "a reply outside a round trip may take")
            sock.start_reply(self.pace, budget)
        try:
            reply = super().read_response(*args, **kwargs)
        finally:
            if isinstance(sock, PacedSocket):
                sock.end_reply()
        if slot_table:
            check_slot_table(reply)
        return reply

    def pack_command(self, *args: Any) -> list[bytes | memoryview]:
        if not any(isinstance(arg, SplitValue) for arg in args):
            return list(super().pack_command(*args))
        out: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, SplitValue):
                out += [b"$%d\r\n" % arg.nbytes + arg.head, arg.payload, b"\r\n"]
            else:
                data = arg if isinstance(arg, bytes) else str(arg).encode()
                out.append(b"$%d\r\n%s\r\n" % (len(data), data))
        return out

    def pack_commands(self, commands: Any) -> list[bytes | memoryview]:
        output: list[bytes | memoryview] = []
        pieces: list[bytes] = []
        for command in commands:
            for chunk in self.pack_command(*command):
                if isinstance(chunk, bytes) and len(chunk) <= JOIN_BELOW:
                    pieces.append(chunk)
                    continue
                if pieces:
                    output.append(b"".join(pieces))
                    pieces = []
                output.append(chunk)
        if pieces:
            output.append(b"".join(pieces))
        return output


def _asks_slot_table(args: tuple[Any, ...]) -> bool:
    """Whether a command's arguments (redis-py passes "CLUSTER SLOTS" as one) are CLUSTER
    SLOTS; only the first two are looked at (a write's value may be large)."""
    words: list[str] = []
    for arg in args[:2]:
        text = arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)
        words += text.upper().split()
    return words == ["CLUSTER", "SLOTS"]


class SplitValueSSLConnection(SplitValueConnection, SSLConnection):
    """`SplitValueConnection` over TLS (`tiers.remote.tls`)."""


class NodeRefused(Exception):
    """The cluster named a node outside `ClusterSettings.allowed` (`cluster.py`): the host is
    as the node named it; `cluster.py` escapes it before it is shown."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            f"the cluster named {host}:{port}, a node outside tiers.remote.allowed_nodes: "
            "not connected to"
        )


def only_allowed(allowed: NodeFilter) -> Callable[[tuple[str, int]], tuple[str, int]]:
    """redis-py's `address_remap`: every address a node names, as it is when `allowed`."""

    def check(address: tuple[str, int]) -> tuple[str, int]:
        if not allowed.allows(address[0]):
            raise NodeRefused(*address)
        return address

    return check
