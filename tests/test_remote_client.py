"""`RemoteCluster` on a real Redis Cluster (3 primaries of Debian's redis-server on loopback,
started by this module): values round trip bit-exact, a damaged one is a counted miss and is
deleted, a present block is not written again, a dead cluster or a killed primary gives misses
and never an exception or a wrong byte, a failover to a replica serves again, a cluster that
requires a password serves only with it, one that speaks only TLS serves a client that verifies
it and shows a certificate.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis_cluster import LocalCluster, require_openssl, require_redis, start_cluster

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.errors import InvalidArgumentError
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster, TlsSettings, parse_node
from kvtier.tiers.remote.entry import ValueMeta, encode_value, path_keys
from kvtier.tiers.remote.local import make_certificates

LAYOUT = KVLayout("tiny", 1, 1, 8, "float16", 4)
HASHER = BlockHasher()
SEED = HASHER.seed(LAYOUT.fingerprint, tenant_salt("alice"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start_cluster(Path(tmp_path_factory.mktemp("redis")))
    yield cluster
    cluster.stop()


@pytest.fixture
def remote(shared: LocalCluster) -> Iterator[RemoteCluster]:
    client = RemoteCluster(ClusterSettings(tuple(shared.nodes)))
    yield client
    client.check()
    client.close()


def blocks(start: int, count: int) -> tuple[list[bytes], list[ValueMeta], list[bytes]]:
    """Keys, expected metadata and values of `count` blocks of one fresh prompt."""
    tokens = list(range(start, start + count * LAYOUT.block_tokens))
    ids = HASHER.split(HASHER.chain(SEED, encode_tokens(tokens), LAYOUT.block_tokens * 4))
    keys = path_keys("kvtier-test", [bytes(i) for i in ids], 0, count, 4)
    parents = [SEED, *ids[:-1]]
    metas = [
        ValueMeta(bytes(i), bytes(p), LAYOUT.fingerprint, LAYOUT.block_bytes)
        for i, p in zip(ids, parents, strict=True)
    ]
    payloads = [os.urandom(LAYOUT.block_bytes) for _ in ids]
    values = [encode_value(m, "none", p) for m, p in zip(metas, payloads, strict=True)]
    return keys, metas, values


def payload_of(value: bytes) -> bytes:
    return value[-LAYOUT.block_bytes :]


def test_blocks_round_trip_bit_exact_and_are_not_written_twice(remote: RemoteCluster) -> None:
    keys, metas, values = blocks(1000, 10)
    assert remote.present(keys) == 0
    assert remote.put(list(zip(keys, values, strict=True))) == [True] * 10
    assert remote.present(keys) == 10
    got = remote.get(keys, metas)
    assert [bytes(g[1]) if g else None for g in got] == [payload_of(v) for v in values]
    assert all(g is not None and g[0] == "none" for g in got)
    assert remote.put(list(zip(keys[:3], values[:3], strict=True))) == [True] * 3
    stats = remote.stats()
    assert (stats["puts"], stats["already_present"], stats["hits"]) == (10, 3, 10)
    assert stats["bytes_out"] == sum(map(len, values))
    assert stats["connected"] and stats["errors"] == 0


def test_a_damaged_value_is_a_counted_miss_and_is_deleted(
    remote: RemoteCluster, shared: LocalCluster
) -> None:
    keys, metas, values = blocks(2000, 4)
    damaged = values[1][:-1] + bytes([values[1][-1] ^ 1])
    remote.put([(keys[0], values[0]), (keys[1], damaged), (keys[2], values[2][:50])])
    got = remote.get(keys[:4], metas[:4])
    assert got[0] is not None and bytes(got[0][1]) == payload_of(values[0])
    assert got[1:] == [None, None, None]  # damaged, truncated, never stored
    stats = remote.stats()
    assert (stats["verify_failures"], stats["hits"], stats["misses"]) == (2, 1, 3)
    assert "truncated" in stats["last_error"]  # the last failure read: the cut one
    assert remote.present(keys[1:3]) == 0  # both deleted
    assert remote.present(keys[:1]) == 1


def test_present_counts_the_leading_run_only(remote: RemoteCluster) -> None:
    keys, _, values = blocks(3000, 6)
    remote.put([(k, v) for i, (k, v) in enumerate(zip(keys, values, strict=True)) if i != 3])
    assert remote.present(keys) == 3
    assert remote.present(keys[4:]) == 2


def test_a_value_over_the_size_limit_is_not_sent(shared: LocalCluster) -> None:
    keys, _, values = blocks(4000, 2)
    small = RemoteCluster(ClusterSettings(tuple(shared.nodes), max_value_bytes=len(values[0]) - 1))
    assert small.put([(keys[0], values[0])]) == [False]
    assert small.stats()["too_large"] == 1 and small.present(keys[:1]) == 0
    small.close()


def test_mismatched_arguments_are_the_callers_error(remote: RemoteCluster) -> None:
    keys, metas, _ = blocks(5000, 2)
    with pytest.raises(InvalidArgumentError, match="2 keys for 1 expected"):
        remote.get(keys, metas[:1])
    for bad in ("nohost", ":80", "h:0", "h:65536", "h:x"):
        with pytest.raises(InvalidArgumentError, match="host:port"):
            parse_node(bad)


def test_a_cluster_that_is_down_gives_misses_at_once_not_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    remote = RemoteCluster(ClusterSettings((f"127.0.0.1:{port}",), timeout_s=0.2))
    keys, metas, values = blocks(6000, 3)
    started = time.monotonic()
    assert remote.get(keys, metas) == [None] * 3
    assert remote.put(list(zip(keys, values, strict=True))) == [False] * 3
    assert remote.present(keys) == 0
    assert time.monotonic() - started < 2.0  # one connect try, then misses until reconnect_s
    stats = remote.stats()
    assert not stats["connected"] and stats["errors"] == 1 and stats["misses"] == 3
    assert "connect" in stats["last_error"]
    remote.close()


def test_a_killed_primary_gives_misses_and_never_wrong_bytes(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path)
    try:
        remote = RemoteCluster(ClusterSettings(tuple(cluster.nodes), timeout_s=0.3))
        prompts = [blocks(10_000 + 1000 * i, 8) for i in range(12)]  # 24 groups over 3 nodes
        for keys, _, values in prompts:
            assert all(remote.put(list(zip(keys, values, strict=True))))
        cluster.kill(cluster.ports[0])
        served = 0
        for keys, metas, values in prompts:
            for got, value in zip(remote.get(keys, metas), values, strict=True):
                assert got is None or bytes(got[1]) == payload_of(value)
                served += got is not None
        stats = remote.stats()
        assert served < 96 and stats["misses"] == 96 - served
        assert stats["errors"] >= 1 and stats["verify_failures"] == 0
        remote.check()
        remote.close()
    finally:
        cluster.stop()


def test_a_cluster_that_requires_a_password_serves_only_with_it(tmp_path: Path) -> None:
    """Redis AUTH: without the password, or with a wrong one, every call is a counted miss and
    the error names the refusal, never a password; with it, blocks round trip."""
    require_redis()
    password = "a-cluster-password-0123456789"
    with LocalCluster(tmp_path, primaries=3, password=password) as cluster:
        keys, metas, values = blocks(20_000, 8)
        nodes = tuple(cluster.nodes)
        for given in (None, "a-wrong-password-0123456789"):
            remote = RemoteCluster(ClusterSettings(nodes, timeout_s=1.0, password=given))
            assert remote.put(list(zip(keys, values, strict=True))) == [False] * 8
            assert remote.get(keys, metas) == [None] * 8
            stats = remote.stats()
            assert not stats["connected"] and stats["errors"] >= 1 and stats["puts"] == 0
            error = stats["last_error"].lower()
            assert "auth" in error or "password" in error, error
            assert password not in stats["last_error"] and (given or "-") not in error
            assert password not in repr(remote.settings)
            remote.close()
        remote = RemoteCluster(ClusterSettings(nodes, timeout_s=1.0, password=password))
        assert remote.put(list(zip(keys, values, strict=True))) == [True] * 8
        got = remote.get(keys, metas)
        assert [bytes(g[1]) if g else None for g in got] == [payload_of(v) for v in values]
        remote.check()
        remote.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_over_tls_only_a_client_that_verifies_the_cluster_and_shows_a_certificate_is_served(
    tmp_path: Path,
) -> None:
    """`tls-port` only, `tls-auth-clients yes`: the tier round trips over TLS; a plain client,
    one that trusts another CA, and one without a client certificate each get misses, counted,
    with the reason in `last_error`."""
    require_redis()
    require_openssl()
    tls = make_certificates(tmp_path / "certs")
    other_ca = make_certificates(tmp_path / "other").ca_file
    with LocalCluster(tmp_path / "redis", primaries=3, tls=tls) as cluster:
        keys, metas, values = blocks(50_000, 8)
        nodes = tuple(cluster.nodes)
        refused = (
            None,  # plain TCP to a TLS port
            TlsSettings(other_ca, tls.cert_file, tls.key_file),  # the cluster is not trusted
            TlsSettings(tls.ca_file),  # no client certificate
        )
        for settings in refused:
            remote = RemoteCluster(ClusterSettings(nodes, timeout_s=1.0, tls=settings))
            assert remote.put(list(zip(keys, values, strict=True))) == [False] * 8
            assert remote.get(keys, metas) == [None] * 8
            stats = remote.stats()
            assert stats["errors"] >= 1 and stats["puts"] == 0 and stats["last_error"]
            remote.close()
        remote = RemoteCluster(ClusterSettings(nodes, timeout_s=1.0, tls=tls))
        assert remote.put(list(zip(keys, values, strict=True))) == [True] * 8
        got = remote.get(keys, metas)
        assert [bytes(g[1]) if g else None for g in got] == [payload_of(v) for v in values]
        assert remote.stats()["connected"] and remote.stats()["errors"] == 0
        remote.check()
        remote.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_after_a_failover_the_promoted_replica_serves_and_takes_writes(tmp_path: Path) -> None:
    """3 primaries with a replica each: a primary SIGKILLed is replaced by its replica; calls
    meanwhile are misses or right bytes, and afterwards every block written before the kill is
    served again and new writes (values sent in two parts) land on the promoted node."""
    require_redis()
    with LocalCluster(tmp_path, primaries=3, replicas=1) as cluster:
        remote = RemoteCluster(ClusterSettings(tuple(cluster.nodes), timeout_s=0.5))
        prompts = [blocks(30_000 + 1000 * i, 8) for i in range(6)]  # 12 groups over 3 nodes
        for keys, _, values in prompts:
            assert all(remote.put(list(zip(keys, values, strict=True))))
        wait_for_replicas(cluster)
        primary = next(p for p in cluster.ports if "role:master" in info(p, "replication"))
        cluster.kill(primary)
        # the cluster's own failover first (slow on a loaded machine: not the client's doing),
        # then the client has 15 s to find the promoted replica
        failed_over(cluster, primary)
        deadline = time.monotonic() + 15
        while True:
            served = 0
            for keys, metas, values in prompts:
                for got, value in zip(remote.get(keys, metas), values, strict=True):
                    assert got is None or bytes(got[1]) == payload_of(value)
                    served += got is not None
            if served == 48 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if served < 48:  # say whether the cluster failed over or the client missed it
            with Redis(host="127.0.0.1", port=next(p for p in cluster.ports if p != primary)) as r:
                nodes = r.execute_command("CLUSTER", "NODES")
            pytest.fail(f"{served} of 48 served; {remote.stats()}; cluster nodes: {nodes}")
        keys, metas, values = blocks(40_000, 16)  # 4 groups: some land on the promoted node
        assert remote.put(list(zip(keys, values, strict=True))) == [True] * 16
        assert all(got is not None for got in remote.get(keys, metas))
        assert remote.stats()["verify_failures"] == 0
        remote.check()
        remote.close()


def info(port: int, section: str) -> str:
    with Redis(host="127.0.0.1", port=port) as raw:
        return "\n".join(f"{k}:{v}" for k, v in raw.info(section).items())


def failed_over(cluster: LocalCluster, dead: int, timeout: float = 90.0) -> None:
    """Until a surviving node reports the slots of the killed primary `dead` on a live master."""
    deadline = time.monotonic() + timeout
    alive = next(p for p in cluster.ports if p != dead)
    with Redis(host="127.0.0.1", port=alive) as raw:
        while True:
            nodes = raw.execute_command("CLUSTER", "NODES")
            text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
            owners = [
                line.split()[1].split("@")[0]
                for line in text.splitlines()
                if "master" in line.split()[2] and len(line.split()) > 8
            ]
            if all(not owner.endswith(f":{dead}") for owner in owners) and len(owners) == 3:
                return
            assert time.monotonic() < deadline, f"no failover of {dead} in {timeout} s: {text}"
            time.sleep(0.2)


def wait_for_replicas(cluster: LocalCluster, timeout: float = 10.0) -> None:
    """Until every replica has applied all its primary has written; then it holds the same
    keys."""
    deadline = time.monotonic() + timeout
    for port in cluster.ports:
        with Redis(host="127.0.0.1", port=port) as raw:
            if raw.info("replication")["role"] != "master":
                continue
            replication = raw.info("replication")
            assert replication["connected_slaves"] >= 1
            offset = replication["master_repl_offset"]
            while True:
                replica = raw.info("replication")["slave0"]
                if replica["offset"] >= offset or time.monotonic() > deadline:
                    assert replica["offset"] >= offset, (port, replica, offset)
                    break
                time.sleep(0.05)
            # and holds its primary's keys, not another's (servers sharing one dump.rdb did)
            with Redis(host="127.0.0.1", port=int(replica["port"])) as copy:
                copy.execute_command("READONLY")
                assert sorted(copy.keys("*")) == sorted(raw.keys("*")), (port, replica)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_cluster_start_tries_other_ports_when_one_is_taken_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port free when checked but bound by someone else before redis-server binds it: the
    server exits, and the start begins again on other ports (real processes, a real bind)."""
    require_redis()
    from kvtier.tiers.remote import local

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        handed = iter([taken])
        real = local._free_port
        monkeypatch.setattr(local, "_free_port", lambda: next(handed, 0) or real())
        with LocalCluster(tmp_path, primaries=3) as cluster:
            assert taken not in cluster.ports
            assert RemoteCluster(ClusterSettings(tuple(cluster.nodes))).present([b"k"]) == 0
