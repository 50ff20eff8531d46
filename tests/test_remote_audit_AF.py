"""A sick Redis Cluster and what a node's status says of it (`tiers/remote/cluster.py`,
`tiers/remote/liveness.py`): `connected` (the status' `remote.connected`, `/readyz`,
`kvtier_remote_connected` and the shipped `KvtierRemoteDisconnected` alert) must say the
remote is down when it is.

- A cluster in `cluster_state:fail` (a primary lost with no replica, under the default
  `cluster-require-full-coverage yes`; here every primary gave up a slot) answers every command
  `-CLUSTERDOWN`: before, that error reply counted as "a node reached", so a store whose every
  read and write failed said `connected: true`.
- A node that makes no calls (an idle sidecar) said what its last call found, forever: before,
  `connected: true` with every node of its cluster stopped. Now a status read after
  `reconnect_s` without calls starts a probe (one EXISTS, uncounted), which the next read shows,
  both ways.

Each test has a cluster of its own (3 primaries): they stop its nodes or take its slots.
Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import wait_until
from redis_cluster import LocalCluster, start_cluster

from kvtier import KVStore, parse_config
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    running = start_cluster(tmp_path_factory.mktemp("redis"))
    yield running
    for process in running.processes.values():
        process.send_signal(signal.SIGCONT)  # a test that failed while they were stopped
    running.stop()


def cli(port: int, *args: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return done.stdout


def first_slots(cluster: LocalCluster) -> dict[int, str]:
    """Each primary's first slot, as it says (`CLUSTER NODES`, its `myself` line)."""
    slots = {}
    for port in cluster.ports:
        me = next(line for line in cli(port, "cluster", "nodes").splitlines() if "myself" in line)
        slots[port] = me.split()[8].split("-")[0]
    return slots


def states(cluster: LocalCluster) -> set[str]:
    return {cli(port, "cluster", "info").splitlines()[0].strip() for port in cluster.ports}


def store_config(nodes: list[str]) -> dict[str, Any]:
    return {
        "model": {
            "name": "m",
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_dim": 8,
            "dtype": "float32",
        },
        "block_tokens": 4,
        "tiers": {
            "gpu": {"capacity": 16 * 128, "device": "cpu"},
            "remote": {"nodes": nodes, "secret": "cluster-secret-0123456789", "timeout_s": 2.0},
        },
        "mover": {"background": False},
    }


def test_a_cluster_that_answers_clusterdown_is_not_connected(cluster: LocalCluster) -> None:
    tokens = list(range(16))
    slots = first_slots(cluster)
    with KVStore(parse_config(store_config(cluster.nodes))) as store:
        store.store(tokens, torch.ones(1, 2, 16, 1, 8))
        assert store.drain()
        assert store.status()["remote"]["connected"]
        for port, slot in slots.items():  # every node then misses a slot: cluster_state:fail
            assert cli(port, "cluster", "delslots", slot).strip() == "OK"
        try:
            assert wait_until(lambda: states(cluster) == {"cluster_state:fail"}, 5)
            assert store.lookup([*tokens, 1, 2, 3, 4]).remote_tokens == 0  # answers: a miss
            remote = store.status()["remote"]
            assert not remote["connected"], remote  # before: True, every call refused
            assert "ClusterDownError" in remote["last_error"]
        finally:
            for port, slot in slots.items():
                cli(port, "cluster", "addslots", slot)
        assert wait_until(lambda: states(cluster) == {"cluster_state:ok"}, 5)
        assert store.lookup(tokens).remote_tokens == 0  # the local prefix covers it
        assert store.load([*tokens, 9, 9, 9, 9]).num_tokens == 16  # a call that reaches it
        assert store.status()["remote"]["connected"]


def test_an_idle_node_says_its_cluster_went_down_and_came_back(cluster: LocalCluster) -> None:
    settings = ClusterSettings(tuple(cluster.nodes), timeout_s=0.2, reconnect_s=0.3)
    remote = RemoteCluster(settings)
    try:
        # a call that reaches it (a first connect can outlast 0.2 s on a loaded host)
        def reached() -> bool:
            return remote.present([b"kvtier:audit-AF"]) == 0 and bool(remote.stats()["connected"])

        assert wait_until(reached, 5.0)
        trips = remote.stats()["round_trips"]
        for process in cluster.processes.values():
            process.send_signal(signal.SIGSTOP)
        try:
            # no call is made: status reads alone find it down (before: connected forever)
            assert wait_until(lambda: not remote.stats()["connected"], 2.0)
            assert "liveness probe" in remote.stats()["last_error"]
        finally:
            for process in cluster.processes.values():
                process.send_signal(signal.SIGCONT)
        assert wait_until(lambda: remote.stats()["connected"], 3.0)  # and back, still idle
        assert remote.stats()["round_trips"] == trips  # the probes are no calls of the store's
    finally:
        remote.close()
