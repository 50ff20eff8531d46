"""One node of a real Redis Cluster failing, stalling or moving a slot under `RemoteCluster`
(`tiers/remote/rounds.py`): a call waits at most about one `timeout_s` for a stalled node and
then not at all while it is down; a dead or stalled node costs the misses of its own keys only
(the other nodes' reads and writes stand); a write that meets a redirect is a counted miss, not
a `DataError`, and lands once the slot table is read again; a key some writer turned into
another type is deleted and written again.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis_cluster import LocalCluster, start_cluster
from test_remote_client import blocks, payload_of

from kvtier.tiers.remote.cluster import REFRESH_S, ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import ValueMeta, encode_value_parts

TIMEOUT_S = 0.3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = start_cluster(tmp_path)
    yield local
    for process in local.processes.values():
        process.send_signal(signal.SIGCONT)  # a test that failed while one was stopped
    local.stop()


def port_of(cluster: LocalCluster, key: bytes) -> int:
    """The port of the primary that serves `key`, as the cluster says."""
    node: Any = ClusterNode  # redis-py's calls are untyped
    with RedisCluster(startup_nodes=[node("127.0.0.1", cluster.ports[0])]) as direct:
        return int(direct.get_node_from_key(key).port)


def spread(start: int) -> tuple[list[bytes], list[ValueMeta], list[bytes]]:
    """Keys, metas and values of 12 prompts of 8 blocks: 24 groups, on every primary."""
    keys: list[bytes] = []
    metas: list[ValueMeta] = []
    values: list[bytes] = []
    for i in range(12):
        k, m, v = blocks(start + 1000 * i, 8)
        keys, metas, values = keys + k, metas + m, values + v
    return keys, metas, values


def _payload(reply: tuple[str, memoryview] | None) -> bytes | None:
    return None if reply is None else bytes(reply[1])


def test_a_stalled_node_costs_one_timeout_then_nothing_and_the_others_serve(
    cluster: LocalCluster,
) -> None:
    """redis-py's cluster pipeline sent a timed-out node's commands again one at a time, each
    on a new connection waiting a whole timeout: a second or more for every key there."""
    remote = RemoteCluster(ClusterSettings(tuple(cluster.nodes), timeout_s=TIMEOUT_S))
    keys, metas, values = spread(50_000)
    assert all(remote.put(list(zip(keys, values, strict=True))))
    stalled = cluster.ports[0]
    on_stalled = [port_of(cluster, key) == stalled for key in keys]
    assert 0 < sum(on_stalled) < len(keys)
    cluster.processes[stalled].send_signal(signal.SIGSTOP)
    try:
        for attempt in range(2):
            started = time.monotonic()
            got = remote.get(keys, metas)
            took = time.monotonic() - started
            # the first call waits one timeout for the stalled node; the next not at all
            assert took < (TIMEOUT_S + 0.5 if attempt == 0 else 0.1), (attempt, took)
            for there, reply, value in zip(on_stalled, got, values, strict=True):
                assert (reply is None) if there else _payload(reply) == payload_of(value)
        assert "down for" in remote.last_error and "Timeout" in remote.last_error
    finally:
        cluster.processes[stalled].send_signal(signal.SIGCONT)
    remote.check()
    remote.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_dead_node_costs_only_its_own_reads_and_writes(cluster: LocalCluster) -> None:
    """redis-py voided every node's replies when one node's connection failed: each call that
    touched the dead primary was a miss whole, and writes bound for live primaries dropped."""
    remote = RemoteCluster(ClusterSettings(tuple(cluster.nodes), timeout_s=TIMEOUT_S))
    assert all(remote.put(list(zip(*spread(100_000)[::2], strict=True))))  # connects to all
    dead = cluster.ports[1]
    for port in cluster.ports:  # the others go on serving their own slots (README)
        Redis(port=port).config_set("cluster-require-full-coverage", "no")
    cluster.kill(dead)
    keys, metas, values = spread(200_000)  # written after the kill
    on_dead = [port_of(cluster, key) == dead for key in keys]
    done = remote.put(list(zip(keys, values, strict=True)))
    assert done == [not there for there in on_dead]
    got = remote.get(keys, metas)
    for there, reply, value in zip(on_dead, got, values, strict=True):
        assert (reply is None) if there else _payload(reply) == payload_of(value)
    stats = remote.stats()
    assert stats["hits"] == on_dead.count(False) and stats["verify_failures"] == 0
    remote.check()
    remote.close()


def test_a_write_that_meets_a_redirect_is_a_miss_then_lands_once_the_table_is_read(
    cluster: LocalCluster,
) -> None:
    """An empty slot moved to another primary after the client read the table: redis-py's
    one-command re-send packed the block with its own packer (`DataError`, every time)."""
    remote = RemoteCluster(ClusterSettings(tuple(cluster.nodes), timeout_s=TIMEOUT_S))
    keys, metas, values = blocks(80_000, 1)
    assert remote.put([(keys[0], values[0])]) == [True]  # connected, table read
    owner = port_of(cluster, keys[0])
    slot = key_slot(keys[0])
    assert Redis(port=owner).delete(keys[0]) == 1
    target = next(port for port in cluster.ports if port != owner)
    direct: Any = Redis  # redis-py's calls are untyped
    target_id = direct(port=target).execute_command("CLUSTER MYID")
    target_id = target_id.decode() if isinstance(target_id, bytes) else target_id
    for port in cluster.ports:
        direct(port=port).execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
    value = encode_value_parts(metas[0], "none", payload_of(values[0]))  # as the writer sends
    assert remote.put([(keys[0], value)]) == [False]
    assert "MovedError" in remote.last_error and "DataError" not in remote.last_error
    deadline = time.monotonic() + 10 * REFRESH_S
    while remote.put([(keys[0], value)]) != [True]:
        assert time.monotonic() < deadline, remote.last_error
        time.sleep(REFRESH_S / 4)
    got = remote.get(keys, metas)[0]
    assert got is not None and bytes(got[1]) == payload_of(values[0])
    assert Redis(port=target).exists(keys[0]) == 1
    remote.close()


def test_a_key_turned_into_another_type_is_deleted_and_written_again(
    cluster: LocalCluster,
) -> None:
    """A writer with the cluster's password replaced a block with a hash: every read was a
    `WRONGTYPE` error, and `SET NX` never replaced it (the block was lost to the cluster)."""
    remote = RemoteCluster(ClusterSettings(tuple(cluster.nodes), timeout_s=TIMEOUT_S))
    keys, metas, values = blocks(90_000, 4)
    assert all(remote.put(list(zip(keys, values, strict=True))))
    owner = Redis(port=port_of(cluster, keys[1]))
    owner.delete(keys[1])
    owner.hset(keys[1], "field", "value")
    got = remote.get(keys, metas)
    assert got[1] is None and all(got[i] is not None for i in (0, 2, 3))
    assert "WRONGTYPE" in remote.last_error
    assert owner.exists(keys[1]) == 0  # deleted: it can never be a block
    assert remote.put([(keys[1], values[1])]) == [True]
    again = remote.get(keys, metas)[1]
    assert again is not None and bytes(again[1]) == payload_of(values[1])
    remote.check()
    remote.close()
