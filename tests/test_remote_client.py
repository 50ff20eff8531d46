"""`RemoteCluster` on a real Redis Cluster (3 primaries of Debian's redis-server on loopback,
started by this module): values round trip bit-exact, a damaged one is a counted miss and is
deleted, a present block is not written again, a dead cluster or a killed primary gives misses
and never an exception or a wrong byte.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_cluster import LocalCluster, require_redis, start_cluster

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.errors import InvalidArgumentError
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster, parse_node
from kvtier.tiers.remote.entry import ValueMeta, encode_value, path_keys

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
