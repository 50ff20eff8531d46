"""What the remote tier's cluster client is made from (`ClusterSettings`, `TlsSettings`), and
`open_client`, which makes one through one startup node: `cluster.RemoteCluster` tries its
startup nodes one at a time with it, on its connecting thread, so that `close` stops a connect
after the node it is trying rather than after every node of the list.

`open_client` raises whatever redis-py raises when that node gives no slot table it can use (no
answer within the timeouts, a refused connection or AUTH, a table naming a node outside
`allowed`, a table that fails `slots.check_slot_table` or a reply past
`connection.CONTROL_REPLY_BYTES`): the caller counts it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from kvtier.config.network import NodeFilter
from kvtier.errors import InvalidArgumentError
from kvtier.tiers.remote.connection import (
    SplitValueConnection,
    SplitValueSSLConnection,
    only_allowed,
)


@dataclass(frozen=True)
class TlsSettings:
    """TLS to every node: verified against `ca_file`; a client certificate when given."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    check_hostname: bool = True


@dataclass(frozen=True)
class ClusterSettings:
    nodes: tuple[str, ...]  # "host:port" of startup nodes
    timeout_s: float = 0.5  # connect and socket timeout of one round trip
    max_value_bytes: int = 512 * 2**20
    reconnect_s: float = 5.0
    username: str | None = None  # Redis ACL user (None: "default")
    password: str | None = field(default=None, repr=False)  # AUTH; never shown
    tls: TlsSettings | None = None
    allowed: tuple[str, ...] | None = None  # `NodeFilter` entries; None: any node


def parse_node(node: str) -> tuple[str, int]:
    """`host:port` as (host, port); `InvalidArgumentError` naming it otherwise."""
    host, _, port = node.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"remote node: got {node!r}, expected host:port")
    return host, int(port)


def open_client(
    node: ClusterNode, settings: ClusterSettings, allowed: NodeFilter | None
) -> RedisCluster:
    """A client of the cluster whose slot table `node` gave, each connect and read under
    `settings.timeout_s` (module doc: what it raises)."""
    timeout = settings.timeout_s
    tls = settings.tls
    secure: dict[str, Any] = {"connection_class": SplitValueConnection}
    if tls is not None:
        secure = {
            "connection_class": SplitValueSSLConnection,
            "ssl_cert_reqs": "required",
            "ssl_ca_certs": tls.ca_file,
            "ssl_certfile": tls.cert_file,
            "ssl_keyfile": tls.key_file,
            "ssl_check_hostname": tls.check_hostname,
        }
    if allowed is not None:
        secure["address_remap"] = only_allowed(allowed)
    host = f"[{node.host}]" if ":" in node.host else node.host
    # given a url, redis-py builds every node's pool from these arguments, so
    # `connection_class` reaches the nodes it learns of later too (failover, reshard); the
    # slot table names every node, and refreshes of it ask them all
    return RedisCluster(
        url=f"redis://{host}:{node.port}",
        startup_nodes=[node],
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        username=settings.username,
        password=settings.password,
        # one retry of a connect; `rounds.py` sends each command once
        retry=Retry(NoBackoff(), 1),
        # a node's pushed "maintenance" notices would move connections and stretch
        # timeouts on its word alone: a node is as untrusted as its replies
        maint_notifications_config=MaintNotificationsConfig(enabled=False),
        **secure,
    )
