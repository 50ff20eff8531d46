"""Who is at the other end of an HTTP connection: the Unix user of a peer on this host.

A CUDA gpu pool's IPC handle (`cuda_ipc.py`) is a capability: CUDA checks no Unix user when a
process opens it, so whoever gets the handle reads and writes every tenant's gpu pages. The
/dev/shm pools have the file mode to keep other users out; the handle has only this: it is
offered to a peer the kernel says runs as the server's own user (`same_user`), the boundary
the README's security model draws for shared memory.

    tcp_peer_uid(peer, local) -> int | None

finds the peer's socket in the kernel's table of TCP sockets of this network namespace
(/proc/net/tcp and tcp6: the socket whose local address is the peer's and whose remote address
is ours) and returns the uid that owns it. None when there is no such socket here (a peer on
another host or in another network namespace, a connection already gone, a table that cannot
be read): the caller then offers nothing. An address that is not an IP literal is None too.
A peer that passes its socket to another process keeps the uid of the socket's creator: the
check is of who made the connection, which is what a process of another user cannot fake.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))

Endpoint = tuple[str, int]  # (IP literal, port), as ASGI gives `client` and `server`


def same_user(peer: Endpoint | None, local: Endpoint | None) -> bool:
    """Whether the peer of the connection `peer` -> `local` runs as this process's user."""
    if peer is None or local is None:
        return False
    return tcp_peer_uid(peer, local) == os.geteuid()


def tcp_peer_uid(peer: Endpoint, local: Endpoint) -> int | None:
    """The uid owning the peer's end of the TCP connection `peer` -> `local` (module doc)."""
    want_local, want_remote = _key(peer), _key(local)
    if want_local is None or want_remote is None:
        return None
    for table in TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8:
                continue
            if (_parse(fields[1]), _parse(fields[2])) == (want_local, want_remote):
                return int(fields[7]) if fields[7].isdigit() else None
    return None


def _key(endpoint: Endpoint) -> tuple[bytes, int] | None:
    """(the address as 16 bytes, IPv4 mapped into IPv6, port), or None if not an IP literal."""
    host, port = endpoint
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv4Address):
        address = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + address.packed)
    return address.packed, int(port)


def _parse(field: str) -> tuple[bytes, int] | None:
    """A /proc/net/tcp{,6} address `HEX:PORT` as `_key` gives it: the address is 32-bit words
    in the host's byte order, the port big-endian hex."""
    address, _, port = field.partition(":")
    try:
        raw = bytes.fromhex(address)
        number = int(port, 16)
    except ValueError:
        return None
    if len(raw) not in (4, 16):
        return None
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 4:
        raw = b"\0" * 10 + b"\xff\xff" + raw
    return raw, number
