"""Which hosts a cluster may send kvtier to (`tiers.remote.allowed_nodes`).

A Redis Cluster's nodes name hosts to their clients: the slot table (CLUSTER SLOTS) and every
`-MOVED` / `-ASK` redirect. A client that connects wherever it is sent can be sent anywhere by a
hostile node, with the cluster's AUTH and the tenants' KV (`tests/test_remote_redirects.py`).
`NodeFilter` is the operator's list of where the cluster may live: IP networks ("10.0.0.0/8";
an address alone is its own /32 or /128) and host names ("redis-0.redis.svc", compared without
case and without a final dot, exactly: no wildcard, no suffix). A host the cluster names is
allowed when it is an address inside one of the networks, or one of the names; a name is never
resolved here (an address the operator did not list does not become allowed by a DNS answer).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import InvalidArgumentError, shown

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
EXPECTED = "an IP network (10.0.0.0/8, or one address: 10.1.2.3) or a host name (redis-0.redis.svc)"


def host_name(text: str) -> str | None:
    """`text` as a host name compared (lower case, no final dot); None when it is none."""
    name = text.lower().removesuffix(".")
    if not 0 < len(name) <= 253:
        return None
    return name if all(_LABEL.fullmatch(label) for label in name.split(".")) else None


def parse_entry(entry: object) -> Network | str:
    """One entry (module doc): its network, or its host name as compared;
    `InvalidArgumentError` naming it when it is neither."""
    if isinstance(entry, str):
        try:
            return ipaddress.ip_network(entry, strict=False)
        except ValueError:
            pass
        name = host_name(entry)
        if name is not None:
            return name
    raise InvalidArgumentError(f"allowed_nodes: got {shown(entry)}, expected {EXPECTED}")


@dataclass(frozen=True)
class NodeFilter:
    networks: tuple[Network, ...]
    names: frozenset[str]

    @classmethod
    def parse(cls, entries: Sequence[str]) -> NodeFilter:
        """`entries` (module doc); `InvalidArgumentError` naming the first that is neither a
        network nor a host name, or an empty list (which would allow nothing)."""
        if not entries:
            raise InvalidArgumentError(
                f"allowed_nodes: got an empty list, expected {EXPECTED}s; null allows any node"
            )
        parsed = [parse_entry(entry) for entry in entries]
        names = frozenset(entry for entry in parsed if isinstance(entry, str))
        return cls(tuple(entry for entry in parsed if not isinstance(entry, str)), names)

    def allows(self, host: str) -> bool:
        """Whether the cluster may send us to `host` (module doc)."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host_name(host) in self.names
        return any(address in network for network in self.networks)
