"""The redis-py connection the remote tier's cluster client uses (`cluster.py`): it sends a
value's header and payload one after the other as one Redis value, the payload from where it
lies (`entry.SplitValue`), and reads replies through a `paced.PacedSocket`; and the check
that keeps it off nodes outside `tiers.remote.allowed_nodes` (`only_allowed`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.connection import Connection, SSLConnection

from kvtier.config.network import NodeFilter
from kvtier.tiers.remote.entry import SplitValue
from kvtier.tiers.remote.paced import Budget, Pace, PacedSocket

Value = bytes | memoryview | SplitValue
JOIN_BELOW = 6000  # chunks up to this size are joined into one send (redis-py's cutoff)


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

    def _connect(self) -> Any:
        sock = super()._connect()
        return sock if self.socket_timeout is None else PacedSocket(sock, self.socket_timeout)

    def fileno(self) -> int:
        """The connected socket's descriptor (`rounds.py` polls it)."""
        sock: Any = self._sock
        return int(sock.fileno())

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        sock: object = self._sock
        if isinstance(sock, PacedSocket):
            sock.start_reply(self.pace, self.budget)
        try:
            return super().read_response(*args, **kwargs)
        finally:
            if isinstance(sock, PacedSocket):
                sock.end_reply()

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
