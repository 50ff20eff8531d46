"""Where a cluster may send us (`tiers.remote.allowed_nodes`, `tiers/remote/cluster.py`).

A cluster node tells its clients where to go: its slot table (CLUSTER SLOTS) and its
redirects (`-MOVED slot host:port`, `-ASK slot host:port`) name hosts, and a client that
follows them connects to whatever they name, AUTH and all, then sends the block. A hostile or
compromised node (or whoever can answer in its place on a network without TLS) can so make
every kvtier node connect to a host of its choosing, hand it the cluster's password and the
tenants' KV, or speak RESP to a service inside the network. kvtier follows no redirect (a
counted miss; the slot table is read again: `rounds.py`), and with `allowed_nodes` (IP
networks and host names) a slot table names only hosts in it; anything else is refused before
a connection is made: a counted miss, its reason in `last_error`. `FakeNode`
(`test_remote_audit.py`) is the hostile node; `Listener`, on another loopback address, is where
it sends us.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from redis.crc import key_slot
from test_remote_audit import LAYOUT, FakeNode, array, bulk, meta_of, path, serve_each

from kvtier.config import parse_config
from kvtier.config.network import NodeFilter
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import encode_value, path_keys

PASSWORD = "a-cluster-password-0123"
OUTSIDE = "127.0.0.2"  # on loopback too, but not in 127.0.0.1/32


class Listener:
    """A TCP server on `OUTSIDE` that keeps every byte any client sends it."""

    def __init__(self) -> None:
        self.server = socket.create_server((OUTSIDE, 0))
        self.port = self.server.getsockname()[1]
        self.connections = 0
        self.received = bytearray()
        serve_each(self.server, self._keep)

    def _keep(self, conn: socket.socket) -> None:
        self.connections += 1
        with conn:
            conn.settimeout(1.0)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:  # timed out: the client waits for a reply that never comes
                pass

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lis = Listener()
    yield lis
    lis.close()


def _cluster(port: int, allowed: tuple[str, ...] | None) -> RemoteCluster:
    return RemoteCluster(
        ClusterSettings((f"127.0.0.1:{port}",), timeout_s=0.5, password=PASSWORD, allowed=allowed)
    )


def _block() -> tuple[list[bytes], object, bytes]:
    seed, ids = path("alice", 3000, 1)
    meta = meta_of(seed, ids, 0)
    return (
        path_keys("redirect", ids, 0, 1, 4),
        meta,
        encode_value(meta, "none", os.urandom(LAYOUT.block_bytes)),
    )


@pytest.mark.parametrize("kind", ["MOVED", "ASK"])
@pytest.mark.parametrize("allowed", [("127.0.0.1/32",), None], ids=["allowed_nodes", "any node"])
def test_a_redirect_is_never_followed(
    kind: str, allowed: tuple[str, ...] | None, listener: Listener
) -> None:
    """kvtier sends each command once to the node its slot table names (`rounds.py`): a
    redirect is a counted miss that names where it pointed, and the host it names never sees a
    connection, with `allowed_nodes` or without (redis-py's own pipeline followed a MOVED,
    password and all)."""

    def answer(args: list[bytes], conn: socket.socket) -> bytes:
        if args[0].upper() == b"AUTH":
            return b"+OK\r\n"
        slot = key_slot(args[1])  # the key's own slot: redis-py then sent the key there
        return b"-%s %d %s:%d\r\n" % (kind.encode(), slot, OUTSIDE.encode(), listener.port)

    node = FakeNode(answer)
    keys, meta, value = _block()
    remote = _cluster(node.port, allowed)
    try:
        assert remote.get(keys, [meta]) == [None]  # type: ignore[list-item]
        assert remote.put([(keys[0], value)]) == [False]
        assert remote.present(keys) == 0
        assert remote.stats()["errors"] >= 3 and remote.stats()["hits"] == 0
        assert f"{OUTSIDE}:{listener.port}" in remote.last_error
        assert listener.connections == 0 and not listener.received
    finally:
        remote.close()
        node.close()


class SlotsElsewhere(FakeNode):
    """A node whose slot table gives half the slots to a host outside: `outside`."""

    outside = (OUTSIDE, 0)

    def _reply(self, args: list[bytes], conn: socket.socket) -> bytes | None:
        if args[0].upper() == b"CLUSTER" and args[1].upper() == b"SLOTS":
            host, port = self.outside
            me = array([bulk(b"127.0.0.1"), b":%d\r\n" % self.port, bulk(b"me")])
            them = array([bulk(host.encode()), b":%d\r\n" % port, bulk(b"them")])
            return array(
                [array([b":0\r\n", b":8000\r\n", me]), array([b":8001\r\n", b":16383\r\n", them])]
            )
        return super()._reply(args, conn)


def test_a_slot_table_naming_a_host_outside_is_refused_whole(listener: Listener) -> None:
    """Half a table is not trusted either: the cluster is refused (every call a miss, the
    reason said), and the host outside never sees a connection."""
    node = SlotsElsewhere(lambda args, conn: b"+OK\r\n")
    node.outside = (OUTSIDE, listener.port)
    keys, meta, value = _block()
    guarded = _cluster(node.port, ("127.0.0.1/32", "localhost"))
    try:
        assert guarded.put([(keys[0], value)]) == [False]
        assert guarded.get(keys, [meta]) == [None]  # type: ignore[list-item]
        assert guarded.stats()["errors"] >= 1
        assert "allowed_nodes" in guarded.last_error and OUTSIDE in guarded.last_error
        assert listener.connections == 0
    finally:
        guarded.close()
        node.close()


def test_allowed_nodes_are_networks_or_host_names() -> None:
    allowed = NodeFilter.parse(("10.0.0.0/8", "192.168.1.7", "Redis-0.redis.svc.", "::1/128"))
    assert allowed.allows("10.200.3.4") and allowed.allows("192.168.1.7")
    assert not allowed.allows("192.168.1.8") and not allowed.allows("11.0.0.1")
    assert allowed.allows("redis-0.redis.svc") and allowed.allows("REDIS-0.REDIS.SVC.")
    assert not allowed.allows("redis-1.redis.svc") and not allowed.allows("redis-0.redis.svc.evil")
    assert allowed.allows("::1") and not allowed.allows("")
    for bad in ("10.0.0.0/33", "a b", "", "x" * 254, "10.0.0.1/8/1", "-host"):
        with pytest.raises(InvalidArgumentError, match="allowed_nodes"):
            NodeFilter.parse((bad,))


def _remote(**fields: object) -> dict[str, object]:
    return {"tiers": {"remote": {"nodes": ["10.1.2.3:6379"], **fields}}}


def test_the_config_checks_allowed_nodes_and_that_the_startup_nodes_are_in_it() -> None:
    config = parse_config(_remote(allowed_nodes=["10.0.0.0/8"]))
    assert config.tiers.remote is not None and config.tiers.remote.allowed_nodes == ("10.0.0.0/8",)
    with pytest.raises(ConfigError, match=r"tiers\.remote\.allowed_nodes.*'10\.0\.0\.0/33'"):
        parse_config(_remote(allowed_nodes=["10.0.0.0/33"]))
    with pytest.raises(ConfigError, match=r"tiers\.remote\.allowed_nodes.*10\.1\.2\.3:6379"):
        parse_config(_remote(allowed_nodes=["192.168.0.0/16"]))  # the startup node is not in it
    with pytest.raises(ConfigError, match=r"tiers\.remote\.allowed_nodes"):
        parse_config(_remote(allowed_nodes=[]))  # allows nothing: null for anything


def test_a_real_cluster_inside_the_allowed_nodes_serves_as_ever(redis_nodes: list[str]) -> None:
    """Three primaries on loopback, each naming the others in its slot table and redirecting
    keys of their slots: all inside 127.0.0.0/8, so every block goes and comes back."""
    remote = RemoteCluster(ClusterSettings(tuple(redis_nodes[:1]), allowed=("127.0.0.0/8",)))
    try:
        blocks = []
        for start in range(0, 4000, 400):  # keys of many slots: every primary's
            seed, ids = path("alice", 10_000 + start, 1)
            meta = meta_of(seed, ids, 0)
            keys = path_keys(f"allowed-{start}", ids, 0, 1, 4)
            value = encode_value(meta, "none", os.urandom(LAYOUT.block_bytes))
            blocks.append((keys, meta, value))
        assert remote.put([(keys[0], value) for keys, _, value in blocks]) == [True] * 10
        for keys, meta, value in blocks:
            got = remote.get(keys, [meta])[0]
            assert got is not None and bytes(got[1]) == value[-LAYOUT.block_bytes :]
        assert remote.stats()["errors"] == 0, remote.last_error
    finally:
        remote.close()
