"""Two stores ("node A", "node B": separate pools and disk directories, one process) sharing a
real Redis Cluster and a cluster secret: what A stores, B's prefetch and load take from the
cluster, bit-exact; tenants and layouts stay apart; a damaged value or a killed primary gives
less, never wrong bytes or errors; a cluster that is down leaves a store serving its own tiers;
a cluster that requires a password serves the stores configured with it.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from redis import Redis
from redis.cluster import ClusterNode, RedisCluster
from redis_cluster import LocalCluster, require_redis, start_cluster

from kvtier import KVStore, parse_config
from kvtier.blocks import encode_tokens
from kvtier.errors import ConfigError
from kvtier.tiers.remote.entry import block_key

BT = 4
SECRET = "cluster-secret-0123456789"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    running = start_cluster(tmp_path_factory.mktemp("redis"))
    yield running
    running.stop()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster of the test's own, for one that kills a primary."""
    running = start_cluster(tmp_path / "redis")
    yield running
    running.stop()


def config(nodes: list[str], disk: Path | None = None, **remote: Any) -> dict[str, Any]:
    tiers: dict[str, Any] = {
        "gpu": {"capacity": 64 * 2048, "device": "cpu"},
        "host": {"capacity": 64 * 2048, "pinned": False},
        "remote": {"nodes": nodes, "secret": SECRET, "group_blocks": 4, **remote},
    }
    if disk is not None:
        tiers["disk"] = {"capacity": "1MiB", "path": str(disk)}
    return {
        "model": {
            "name": "m",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 8,
            "dtype": "float16",
        },
        "block_tokens": BT,
        "tiers": tiers,
        "tenants": {"default": {}, "bob": {}},
        "mover": {"background": False},
    }


def node(cfg: dict[str, Any]) -> KVStore:
    return KVStore(parse_config(cfg), secret=b"this node's own secret, not shared")


def kv_for(tokens: list[int]) -> torch.Tensor:
    torch.manual_seed(len(tokens))
    return torch.randn(2, 2, len(tokens), 2, 8).to(torch.float16)


def test_what_a_stores_b_prefetches_and_loads_bit_exact(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    tokens = list(range(100, 140))  # 10 blocks
    kv = kv_for(tokens)
    with (
        node(config(cluster.nodes, tmp_path / "a")) as a,
        node(config(cluster.nodes, tmp_path / "b")) as b,
    ):
        assert a.store(tokens, kv).stored_tokens == 40
        assert a.drain()
        assert a.status()["remote"]["writer_written_blocks"] == 10
        hit = b.lookup(tokens)  # nothing local on B; the cluster holds all 10 blocks
        assert (hit.num_tokens, hit.gpu_tokens, hit.remote_tokens) == (40, 0, 40)
        assert b.lookup(tokens[:30]).remote_tokens == 28  # whole blocks only
        # what the cluster served is a hit of B's too (before: hit_tokens 0, a hit rate of 0)
        assert (b.status()["ops"]["hit_tokens"], b.status()["hit_rate"]) == (68, 68 / 70)
        assert b.status(tenant="default")["ops"]["hit_tokens"] == 68
        assert b.status(tenant="bob")["ops"]["hit_tokens"] == 0
        lease = b.prefetch(tokens)
        assert lease.num_tokens == 40
        b.release(lease)
        loaded = b.load(tokens)
        assert loaded.num_tokens == 40 and torch.equal(
            loaded.kv.view(torch.int16), kv.view(torch.int16)
        )
        status = b.status()["remote"]
        assert status["filled_blocks"] == 10 and status["hits"] == 10
        assert status["writer_queued_blocks"] == 0  # blocks from the cluster are not sent back
        b.check()
        # B extends the prompt; A finds the extension too
        longer = [*tokens, *range(500, 516)]
        kv2 = kv_for(longer)
        kv2[:, :, :40] = kv
        b.store(longer, kv2)
        assert b.drain()
        assert a.load(longer).num_tokens == 56
        a.check()


def test_tenants_and_layouts_do_not_meet_across_nodes(cluster: LocalCluster) -> None:
    tokens = list(range(40))
    slack = 5.0  # a read past 0.5 s (the default) on a loaded CI machine is a miss: 16 of 40
    other = config(cluster.nodes, timeout_s=slack)
    other["model"] = {**other["model"], "name": "another-model"}
    with (
        node(config(cluster.nodes, timeout_s=slack)) as a,
        node(config(cluster.nodes, timeout_s=slack)) as b,
        node(other) as c,
    ):
        a.store(tokens, kv_for(tokens))
        assert a.drain()
        assert b.lookup(tokens, tenant="bob").num_tokens == 0
        assert b.load(tokens, tenant="bob").num_tokens == 0
        assert c.load(tokens).num_tokens == 0
        assert b.load(tokens).num_tokens == 40  # the same tenant, the same model: shared


def test_without_the_shared_secret_nodes_share_nothing(cluster: LocalCluster) -> None:
    tokens = list(range(200, 240))
    alone = config(cluster.nodes)
    del alone["tiers"]["remote"]["secret"]  # each node salts tenants with its own secret
    with node(config(cluster.nodes)) as a, KVStore(parse_config(alone), secret=b"b" * 32) as b:
        a.store(tokens, kv_for(tokens))
        assert a.drain()
        assert b.load(tokens).num_tokens == 0


def test_authenticated_nodes_share_blocks_and_a_plain_one_serves_none_of_them(
    cluster: LocalCluster,
) -> None:
    """`authenticate`: values carry MACs keyed by the shared secret. Two such nodes share
    bit-exact; a node with the same secret that does not authenticate serves none of them:
    authenticated values have keys of their own (`entry`), which it never asks for (nor deletes)."""
    tokens = list(range(600, 640))
    kv = kv_for(tokens)
    keyed = config(cluster.nodes, authenticate=True)
    with node(keyed) as a, node(keyed) as b, node(config(cluster.nodes)) as plain:
        a.store(tokens, kv)
        assert a.drain()
        loaded = b.load(tokens)
        assert loaded.num_tokens == 40
        assert torch.equal(loaded.kv.view(torch.int16), kv.view(torch.int16))
        assert plain.load(tokens).num_tokens == 0
        assert plain.status()["remote"]["verify_failures"] == 0
        assert b.load(tokens).num_tokens == 40  # still there
    with pytest.raises(ConfigError) as info:
        parse_config(config(cluster.nodes, authenticate=True, secret=None))
    assert info.value.field == "tiers.remote.authenticate"
    assert "tiers.remote.secret" in str(info.value)


def test_a_damaged_value_ends_the_fill_there(cluster: LocalCluster) -> None:
    tokens = list(range(300, 340))
    kv = kv_for(tokens)
    with node(config(cluster.nodes)) as a, node(config(cluster.nodes)) as b:
        a.store(tokens, kv)
        assert a.drain()
        end = a.index.match(a.namespaces.seed("default"), encode_tokens(tokens)).end
        ids = [bytes(a.index.block_id(ref)) for ref in a.index.blocks(end)]
        key = block_key("kvtier", ids[4], ids[6])
        host, port = cluster.nodes[0].split(":")
        raw = RedisCluster(startup_nodes=[ClusterNode(host, int(port))])
        raw.setrange(key, 60, b"\x00\x01")
        raw.close()
        loaded = b.load(tokens)
        assert loaded.num_tokens == 6 * BT  # blocks 0-5, then the damaged one ends the run
        assert torch.equal(loaded.kv.view(torch.int16), kv[:, :, : 6 * BT].view(torch.int16))
        assert b.status()["remote"]["verify_failures"] == 1


def test_a_killed_primary_and_a_dead_cluster_leave_the_local_tiers_serving(
    own_cluster: LocalCluster,
) -> None:
    cluster = own_cluster
    tokens = list(range(400, 440))
    with node(config(cluster.nodes)) as a, node(config(cluster.nodes, timeout_s=0.3)) as b:
        a.store(tokens, kv_for(tokens))
        assert a.drain()
        cluster.kill(cluster.ports[0])
        loaded = b.load(tokens)  # whatever the live nodes still serve, all of it right
        assert torch.equal(
            loaded.kv.view(torch.int16), kv_for(tokens)[:, :, : loaded.num_tokens].view(torch.int16)
        )
        assert b.store(list(range(40)), kv_for(list(range(40)))).stored_tokens == 40
        assert b.load(list(range(40))).num_tokens == 40
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with node(config([f"127.0.0.1:{port}"], timeout_s=0.2)) as down:
        assert down.store(tokens, kv_for(tokens)).stored_tokens == 40
        assert down.load(tokens).num_tokens == 40
        assert down.drain()
        status = down.status()["remote"]
        assert not status["connected"] and status["errors"] >= 1
        assert status["writer_failed_blocks"] >= 1  # and it says why, the cluster's words
        assert "blocks not written" in status["writer_last_error"], status["writer_last_error"]
        assert (
            f"127.0.0.1:{port}" in status["writer_last_error"]
            or status["last_error"] in (status["writer_last_error"])
        )
        down.check()


def test_a_zero_copy_writers_committed_blocks_are_shared_too(cluster: LocalCluster) -> None:
    tokens = list(range(700, 732))  # 8 blocks; 600..640 are another test's, left on the cluster
    kv = kv_for(tokens)
    with node(config(cluster.nodes)) as a, node(config(cluster.nodes)) as b:
        reservation = a.reserve(tokens)
        pool = a.gpu_pool if reservation.tier == "gpu" else a.host_pool
        for i, slot in enumerate(reservation.slots):
            pool.buffer[slot].copy_(kv[:, :, i * BT : (i + 1) * BT])
        assert a.commit(reservation).stored_tokens == 32
        assert a.drain()
        loaded = b.load(tokens)
        assert loaded.num_tokens == 32
        assert torch.equal(loaded.kv.view(torch.int16), kv.view(torch.int16))


def test_a_cluster_that_evicts_under_maxmemory_gives_shorter_runs_never_wrong_bytes(
    own_cluster: LocalCluster,
) -> None:
    for port in own_cluster.ports:  # 1 MiB per primary for data; least recently used go first
        raw = Redis(host="127.0.0.1", port=port)
        empty = int(raw.info("memory")["used_memory"])  # an empty server uses about 1 MiB
        raw.config_set("maxmemory", empty + 2**20)
        raw.config_set("maxmemory-policy", "allkeys-lru")
        raw.close()
    big = config(own_cluster.nodes)
    big["model"] = {**big["model"], "head_dim": 64}  # 4 KiB blocks
    big["tiers"]["gpu"]["capacity"] = big["tiers"]["host"]["capacity"] = 64 * 4096
    prompts = [list(range(10_000 * p, 10_000 * p + 32)) for p in range(120)]  # 3.75 MiB
    with node(big) as a, node(big) as b:
        for tokens in prompts:
            a.store(tokens, kv_big(tokens))
            assert a.drain()
        assert a.status()["remote"]["writer_failed_blocks"] == 0
        found = [b.lookup(tokens).remote_tokens for tokens in prompts]
        # Redis's LRU samples keys, so which blocks survive is approximate: some are there,
        # some were evicted (3.75 MiB written into about 3 MiB)
        assert 0 < sum(found) < 32 * len(prompts) and min(found) < 32
        for tokens, count in zip(prompts[::8], found[::8], strict=True):
            loaded = b.load(tokens)
            assert loaded.num_tokens <= count
            want = kv_big(tokens)[:, :, : loaded.num_tokens]
            assert torch.equal(loaded.kv.view(torch.int16), want.view(torch.int16))
        b.check()


def kv_big(tokens: list[int]) -> torch.Tensor:
    torch.manual_seed(tokens[0])
    return torch.randn(2, 2, len(tokens), 2, 64).to(torch.float16)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_password_from_the_environment_authenticates_both_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tiers.remote.password: env:NAME`: stores that have it share through a cluster that
    requires it, one of them reading it with a secret file's trailing newline; one whose
    variable is unset fails at start with a typed error naming the field, never the password;
    one with the wrong password serves its own tiers only."""
    require_redis()
    password = "the-cluster-password-0123456789"
    with LocalCluster(tmp_path / "redis", primaries=3, password=password) as running:
        cfg = config(running.nodes, password="env:KVTIER_TEST_REDIS_PASSWORD")
        with pytest.raises(ConfigError) as unset:
            node(cfg)
        assert unset.value.field == "tiers.remote.password"
        monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", password + "\n")  # a secret file's
        tokens = list(range(300, 340))
        kv = kv_for(tokens)
        with node(cfg) as a:  # the trailing newline is not the password's
            monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", password)
            b = node(cfg)
            a.store(tokens, kv)
            assert a.drain()
            assert b.lookup(tokens).remote_tokens == 40
            loaded = b.load(tokens)
            assert torch.equal(loaded.kv.view(torch.int16), kv.view(torch.int16))
            b.close()
        monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", "not-the-password-0123456789")
        with node(cfg) as c:
            assert c.lookup(tokens).remote_tokens == 0
            c.store(tokens, kv)  # its own tiers serve; the cluster refused it, counted
            assert c.lookup(tokens).gpu_tokens == 40
            remote = c.status()["remote"]
            assert not remote["connected"] and remote["errors"] >= 1
            assert password not in str(c.status())


def test_tls_files_are_checked_when_the_store_starts(tmp_path: Path) -> None:
    """A TLS file that is missing or not a file is a `ConfigError` naming its field, before
    any connection is tried."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here: only that it is a readable file")
    for tls, field in (
        ({"ca_file": str(tmp_path / "absent.pem")}, "ca_file"),
        ({"ca_file": str(tmp_path)}, "ca_file"),  # a directory
        ({"ca_file": str(ca), "cert_file": str(ca), "key_file": str(tmp_path / "k")}, "key_file"),
    ):
        with pytest.raises(ConfigError) as info:
            node(config(["127.0.0.1:1"], tls=tls))
        assert info.value.field == f"tiers.remote.tls.{field}"
