"""Audit E of the remote tier (a Redis Cluster shared by kvtier nodes):

- the remote writer's backlog holds what `writer_pending_bytes` says: a job keeps the few ids of
  its path that its blocks' keys need, not the whole path's (before: each job of one block kept
  every id of its prompt, ~57 bytes a block, none of it counted: 20 one-block jobs of a
  4096-block path held 4.7 MB behind 10 KiB of `pending_bytes`); and the keys it writes from
  that part are the same, so another node reads the blocks bit-exact;
- a clear or a reset on one node stays there (README "Remote tier"): the cluster keeps the
  tenant's values, the other node serves them, and the node that cleared takes them back
  (documentation: true before this audit too, said now);
- a cluster whose every node stalls (SIGSTOP) is asked for its slot table by one thread at a
  time (before: one more each second, each held a timeout per node: threads and sockets piled
  up, some 60 a minute under `timeout_s` 60);
- `LocalCluster` (`tests/redis_cluster.py start --replicas 1`, `kvtier replay --remote`) returns
  once every replica has finished its first sync (before: 5 s later, Redis' diskless sync
  delay, and a primary SIGKILLed in that time was never failed over: its slots stayed misses).

Real parts: real sockets (a node that accepts and never answers), a real Redis Cluster, real
stores. Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redis import Redis
from redis_cluster import require_redis
from test_remote_audit3 import config, kv_for, node, twin

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import path_keys
from kvtier.tiers.remote.local import LocalCluster
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.remote.writer import RemoteWriter

LAYOUT = KVLayout("audit-e", 1, 1, 8, "float16", 4)  # 128-byte blocks
HASHER = BlockHasher()


@pytest.fixture
def silent_node() -> Iterator[socket.socket]:
    """A node that takes connections and never answers: a writer's call waits on it (until
    the test closes it: the connections it queued are reset)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener


def test_a_writer_job_keeps_the_ids_its_keys_need_not_the_whole_path(
    silent_node: socket.socket,
) -> None:
    address = f"127.0.0.1:{silent_node.getsockname()[1]}"
    cluster = RemoteCluster(ClusterSettings((address,), timeout_s=30.0))  # (1 s: on a loaded
    # machine the 20 submits took longer, the call ended and jobs were written off: flaky)
    writer = RemoteWriter(RemoteTier(cluster, LAYOUT, "audite", 4), 256 * 2**20)
    path, jobs = 4096, 20
    block = torch.zeros(1, *LAYOUT.block_shape, dtype=LAYOUT.dtype)
    try:
        writer.submit(b"s" * 16, [bytes(16)] * path, 0, block)  # the writer waits on it
        tracemalloc.start()
        for job in range(jobs):  # as a decode's stores: one new block at the end of a long path
            ids = [(job * path + i).to_bytes(16, "little") for i in range(path)]
            writer.submit(b"s" * 16, ids, path - 1, block)
            del ids
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert writer.pending_bytes == (jobs + 1) * LAYOUT.block_bytes
        assert held < 512 * 1024, f"{held} bytes held by {jobs} one-block jobs"  # before: 4.7 MB
    finally:
        silent_node.close()  # the call waiting on it ends now
        writer.close()
        cluster.close()


def test_a_job_from_mid_path_writes_the_keys_another_node_reads(redis_nodes: list[str]) -> None:
    seed = HASHER.seed(LAYOUT.fingerprint, tenant_salt("audit-e"))
    tokens = encode_tokens(list(range(90_000, 90_000 + 4 * 23)))  # 23 blocks: 6 groups of 4
    ids = [bytes(i) for i in HASHER.split(HASHER.chain(seed, tokens, LAYOUT.block_tokens * 4))]
    blocks = torch.randn(23, *LAYOUT.block_shape).to(LAYOUT.dtype)
    settings = ClusterSettings(tuple(redis_nodes), timeout_s=5.0)
    writing, reading = RemoteCluster(settings), RemoteCluster(settings)
    writer = RemoteWriter(RemoteTier(writing, LAYOUT, "audite", 4), 256 * 2**20)
    reader = RemoteTier(reading, LAYOUT, "audite", 4)
    try:
        for start, stop in ((0, 3), (3, 4), (4, 5), (5, 13), (13, 23)):  # group edges, inside
            writer.submit(seed, ids, start, blocks[start:stop])
        assert writer.drain(10) and writer.stats["written_blocks"] == 23
        out = torch.empty_like(blocks)
        assert reader.read(seed, ids, 0, list(out.unbind(0))) == [True] * 23
        assert torch.equal(out.view(torch.int16), blocks.view(torch.int16))
        assert reader.stats()["verify_failures"] == 0
    finally:
        writer.close()
        reading.delete(path_keys("audite", ids, 0, 23, 4))
        writing.close()
        reading.close()


def test_a_clear_or_a_reset_drops_one_nodes_copies_and_the_cluster_serves_them_again(
    redis_nodes: list[str],
) -> None:
    cfg = config(redis_nodes)
    cfg["tenants"] = {"default": {}, "alice": {}}
    tokens = list(range(91_000, 91_032))  # 8 blocks
    kv = kv_for(tokens, seed=11)
    with node(cfg) as a, node(twin(cfg)) as b:
        assert a.store(tokens, kv, tenant="alice").stored_tokens == 32 and a.drain()
        assert a.clear("alice") == 8
        hit = a.lookup(tokens, tenant="alice")
        assert (hit.gpu_tokens, hit.host_tokens, hit.remote_tokens) == (0, 0, 32)
        assert a.reset("alice") == {"dropped_blocks": 0, "left_blocks": 0, "remote": True}
        for store in (b, a):  # the other node, and the one that cleared: the same bytes
            got = store.load(tokens, tenant="alice")
            assert got.num_tokens == 32 and torch.equal(
                got.kv.view(torch.int16), kv.view(torch.int16)
            )
        assert b.lookup(tokens).num_tokens == 0  # another tenant: nothing
        a.check()
        b.check()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_local_cluster_with_replicas_starts_with_every_replica_synced(tmp_path: Path) -> None:
    require_redis()
    with LocalCluster(tmp_path / "redis", primaries=3, replicas=1) as cluster:
        links = []
        for port in cluster.ports:
            with Redis(host="127.0.0.1", port=port) as raw:
                replication = raw.info("replication")
            if replication["role"] == "slave":
                links.append(replication["master_link_status"])
        assert links == ["up"] * 3  # before: "down" for 5 s, and no failover in that time


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_stalled_cluster_is_asked_for_its_slot_table_by_one_thread_at_a_time(
    tmp_path: Path,
) -> None:
    require_redis()
    with LocalCluster(tmp_path / "redis", primaries=3) as cluster:
        remote = RemoteCluster(ClusterSettings(tuple(cluster.nodes), timeout_s=0.5))
        keys = [f"audite:v1:{{{i:016x}}}:{i:032x}".encode() for i in range(12)]  # 3 nodes
        assert remote.present(keys) == 0 and remote.connected
        pids = [process.pid for process in cluster.processes.values()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            most = 0
            deadline = time.monotonic() + 4.0  # a table read: a timeout or two a node, 3 nodes
            while time.monotonic() < deadline:
                assert remote.present(keys) == 0  # misses, the nodes down
                names = [thread.name for thread in threading.enumerate()]
                most = max(most, names.count("kvtier-remote-slots"))
                time.sleep(0.05)
            assert most == 1, f"{most} slot table reads at once"  # before: one more a second
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            remote.close()
