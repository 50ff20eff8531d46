"""Two `kvtier serve` processes ("node A", "node B": separate state and disk directories) with
one real Redis Cluster and one cluster secret (`env:`): a prefix stored through A is found by
B's lookup and loaded through B bit-exact; B's status shows the tier; a sidecar whose cluster
is down from the start is ready and serves its local tiers.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from redis import Redis
from redis.cluster import ClusterNode, RedisCluster
from redis_cluster import start_cluster
from service_server import (
    ADMIN_KEY,
    BT,
    DIM,
    HEADS,
    LAYERS,
    MODEL,
    free_port,
    kv_of,
    running,
    tokens_of,
    write_config,
)

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.cli import main
from kvtier.client import Client
from kvtier.tiers.remote.entry import block_key

HASHER = BlockHasher()
SECRET_ENV = {"KVTIER_TEST_CLUSTER_SECRET": "a-cluster-wide-secret-0123456789"}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    cluster = start_cluster(tmp_path_factory.mktemp("redis"))
    yield cluster.nodes
    cluster.stop()


ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdefgh"
TENANTS = {"alice": {"api_keys": [ALICE]}, "bob": {"api_keys": [BOB]}}


def node_config(directory: Path, nodes: list[str], model: str = "tiny", **remote: Any) -> Path:
    path = write_config(directory, disk="1MiB", tenants=TENANTS)
    config = yaml.safe_load(path.read_text())
    config["model"]["name"] = model
    config["tiers"]["remote"] = {
        "nodes": nodes,
        "secret": "env:KVTIER_TEST_CLUSTER_SECRET",
        "group_blocks": 4,
        **remote,
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_prefix_stored_on_one_sidecar_is_found_and_loaded_on_another(
    nodes: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tokens_of(1000, 48)
    kv = kv_of(48, seed=7)
    with (
        running(node_config(tmp_path / "a", nodes), SECRET_ENV) as a,
        running(node_config(tmp_path / "b", nodes), SECRET_ENV) as b,
        Client(a.url, api_key=ALICE) as client_a,
        Client(b.url, api_key=ALICE) as client_b,
    ):
        assert client_a.store(tokens, kv).stored_tokens == 48
        deadline = time.monotonic() + 10  # A's writer sends behind the store call
        while (hit := client_b.lookup(tokens)).remote_tokens < 48 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (hit.num_tokens, hit.gpu_tokens, hit.remote_tokens) == (48, 0, 48)
        loaded = client_b.load(tokens)
        assert loaded.num_tokens == 48
        assert torch.equal(loaded.kv.view(torch.int16), kv.view(torch.int16))
        assert client_b.lookup(tokens).gpu_tokens == 48  # local on B now
        remote = b.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
        assert remote["remote"]["filled_blocks"] == 48 // BT
        assert remote["remote"]["connected"] is True
        assert b.get("/readyz").json() == {"ok": True, "remote": "connected"}
        metrics = b.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
        assert "kvtier_remote_connected 1.0" in metrics
        assert f"kvtier_remote_filled_blocks_total {48 // BT}.0" in metrics
        assert main(["status", "--url", b.url, "--key", ADMIN_KEY]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith("remote: connected; 12 hits, 0 misses, 0 failed verification")


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_sidecar_whose_cluster_is_down_is_ready_and_serves_locally(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    tokens = tokens_of(2000, 16)
    kv = kv_of(16, seed=9)
    with (
        running(node_config(tmp_path, [dead], timeout_s=0.2), SECRET_ENV) as server,
        Client(server.url, api_key=ALICE) as client,
    ):
        assert client.store(tokens, kv).stored_tokens == 16
        assert client.lookup(tokens).num_tokens == 16
        assert torch.equal(client.load(tokens).kv.view(torch.int16), kv.view(torch.int16))
        status = server.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert status.json()["remote"]["connected"] is False
        ready = server.get("/readyz")
        # the probe answers anyone: "not connected", not the cluster's error naming its nodes
        assert ready.status_code == 200 and ready.json()["remote"] == "not connected"
        assert dead not in ready.text and dead in status.json()["remote"]["last_error"]


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_across_sidecars_tenants_and_models_never_meet_and_damage_is_a_counted_miss(
    nodes: list[str], tmp_path: Path
) -> None:
    tokens = tokens_of(3000, 32)  # 8 blocks
    kv = kv_of(32, seed=11)
    cut_tokens, cut_kv = tokens_of(4000, 32), kv_of(32, seed=12)
    with (
        running(node_config(tmp_path / "a", nodes), SECRET_ENV) as a,
        running(node_config(tmp_path / "b", nodes), SECRET_ENV) as b,
        running(node_config(tmp_path / "c", nodes, model="another"), SECRET_ENV) as c,
        Client(a.url, api_key=ALICE) as alice_a,
        Client(b.url, api_key=BOB) as bob_b,
        Client(c.url, api_key=ALICE) as alice_c,
        Client(b.url, api_key=ALICE) as alice_b,
    ):
        alice_a.store(tokens, kv)
        alice_a.store(cut_tokens, cut_kv)
        deadline = time.monotonic() + 10
        while alice_b.lookup(cut_tokens).remote_tokens < 32 and time.monotonic() < deadline:
            time.sleep(0.05)  # A's writer is behind the call
        assert bob_b.lookup(tokens).num_tokens == 0 and bob_b.load(tokens).num_tokens == 0
        assert alice_c.lookup(tokens).num_tokens == 0 and alice_c.load(tokens).num_tokens == 0
        damage(nodes, "alice", tokens, 5)
        loaded = alice_b.load(tokens)
        assert loaded.num_tokens == 5 * BT  # blocks 0-4; the damaged one ends the run
        assert torch.equal(loaded.kv.view(torch.int16), kv[:, :, : 5 * BT].view(torch.int16))
        damage(nodes, "alice", cut_tokens, 2, truncate=True)
        loaded = alice_b.load(cut_tokens)
        assert loaded.num_tokens == 2 * BT  # blocks 0-1; the value cut short ends the run
        assert torch.equal(loaded.kv.view(torch.int16), cut_kv[:, :, : 2 * BT].view(torch.int16))
        status = b.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
        assert status["remote"]["verify_failures"] == 2


def damage(
    nodes: list[str], tenant: str, tokens: list[int], position: int, truncate: bool = False
) -> None:
    """Overwrite two header bytes of block `position` of `tokens` (of `tenant`, under the
    cluster secret) in the cluster, or cut its last 10 bytes off, as a failover or a foreign
    writer might."""
    layout = KVLayout(str(MODEL["name"]), LAYERS, HEADS, DIM, str(MODEL["dtype"]), BT)
    secret = SECRET_ENV["KVTIER_TEST_CLUSTER_SECRET"].encode()
    seed = HASHER.seed(layout.fingerprint, tenant_salt(tenant, secret))
    ids = HASHER.split(HASHER.chain(seed, encode_tokens(tokens), BT * 4))
    key = block_key("kvtier", ids[position - position % 4], ids[position])
    host, port = nodes[0].split(":")
    cluster = RedisCluster(startup_nodes=[ClusterNode(host, int(port))])
    if truncate:
        value = cluster.get(key)
        assert isinstance(value, bytes) and cluster.set(key, value[:-10])
    else:
        assert cluster.setrange(key, 60, b"\x00\x01")
    cluster.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_primary_killed_mid_run_gives_misses_and_no_errors(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "redis")
    try:
        prompts = [tokens_of(10_000 * (p + 1), 32) for p in range(6)]
        with (
            running(node_config(tmp_path / "a", cluster.nodes), SECRET_ENV) as a,
            running(node_config(tmp_path / "b", cluster.nodes, timeout_s=0.3), SECRET_ENV) as b,
            Client(a.url, api_key=ALICE) as client_a,
            Client(b.url, api_key=ALICE) as client_b,
        ):
            for p, tokens in enumerate(prompts):
                client_a.store(tokens, kv_of(32, seed=p))
            deadline = time.monotonic() + 10
            while client_b.lookup(prompts[-1]).remote_tokens < 32 and time.monotonic() < deadline:
                time.sleep(0.05)
            cluster.kill(cluster.ports[0])
            for p, tokens in enumerate(prompts):  # every call answers; what is served is right
                loaded = client_b.load(tokens)
                want = kv_of(32, seed=p)[:, :, : loaded.num_tokens]
                assert torch.equal(loaded.kv.view(torch.int16), want.view(torch.int16))
            status = b.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
            assert status["remote"]["verify_failures"] == 0
    finally:
        cluster.stop()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_blocks_the_cluster_evicts_under_maxmemory_leave_b_s_lookups(tmp_path: Path) -> None:
    """`maxmemory` with `allkeys-lru`: a prefix B's lookup found in the cluster is pushed out by
    other writers; B's next lookups stop reporting what left (the remote run is probed, never
    remembered), and B's load serves only what is still there, bit-exact."""
    cluster = start_cluster(tmp_path / "redis")
    try:
        for port in cluster.ports:  # about 1 MiB per primary for data; least recent go first
            raw = Redis(host="127.0.0.1", port=port)
            raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 2**20)
            raw.config_set("maxmemory-policy", "allkeys-lru")
            raw.close()
        tokens = tokens_of(50_000, 48)
        kv = kv_of(48, seed=11)
        with (
            running(node_config(tmp_path / "a", cluster.nodes), SECRET_ENV) as a,
            running(node_config(tmp_path / "b", cluster.nodes), SECRET_ENV) as b,
            Client(a.url, api_key=ALICE) as client_a,
            Client(b.url, api_key=ALICE) as client_b,
        ):
            client_a.store(tokens, kv)
            deadline = time.monotonic() + 10
            while client_b.lookup(tokens).remote_tokens < 48 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client_b.lookup(tokens).remote_tokens == 48
            filler = RedisCluster(startup_nodes=[ClusterNode(*cluster.nodes[0].split(":"))])
            for i in range(96):  # 12 MiB from another writer into about 3 MiB
                filler.set(f"other-fleet:{i}", bytes(2**17))
            evicted = sum(
                int(node.redis_connection.info("stats")["evicted_keys"])
                for node in filler.get_primaries()
            )
            filler.close()
            assert evicted > 0
            after = client_b.lookup(tokens)
            assert after.remote_tokens < 48  # what the cluster dropped is no longer reported
            loaded = client_b.load(tokens)
            assert loaded.num_tokens <= after.remote_tokens
            want = kv[:, :, : loaded.num_tokens]
            assert torch.equal(loaded.kv.view(torch.int16), want.view(torch.int16))
            status = b.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
            assert status["remote"]["verify_failures"] == 0
    finally:
        cluster.stop()
