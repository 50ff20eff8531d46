"""The remote tier after auditor Z, over a real Redis Cluster:

- a fill reads the cluster's blocks in bounded chunks and stops at the first chunk the local
  tiers cannot take, storing what they can (before: the whole rest of the prompt in one read,
  stored all or nothing: with a prompt past the local room, all of it read on every load, none
  kept, `fills` +1 with nothing filled and nothing counted refused);
- the writer keeps only the blocks it takes, in a copy of its own (before: views of the whole
  store's copy, pinning far more than `max_pending_bytes`);
- an empty value under a block's key is a verify failure, deleted (before: taken for no key,
  so EXISTS kept reporting it, loads missed it, and SET NX refused the real block for good);
- a value whose checks pass but whose payload does not decode is a miss, not also a hit.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import gc
import socket
import weakref
from typing import Any

import pytest
import torch
from test_remote_audit3 import config, kv_for, node, twin

import kvtier.transfer.remote
from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import ValueMeta, encode_value, mac_key_of, path_keys
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.remote.writer import RemoteWriter

BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # `config`'s layout: layers, K/V, tokens, heads, dim, fp16
LAYOUT = KVLayout("z", 2, 2, 8, "float16", 4)
HASHER = BlockHasher()


def small_gpu(cfg: dict[str, Any], blocks: int) -> dict[str, Any]:
    """`cfg` (same cluster, same key prefix) with a gpu tier of `blocks` blocks and no host."""
    tiers = {**cfg["tiers"], "gpu": {"capacity": blocks * BLOCK_BYTES, "device": "cpu"}}
    return {**cfg, "tiers": {**tiers, "host": None}}


def path(tenant: str, start: int, blocks: int) -> tuple[bytes, list[bytes]]:
    seed = HASHER.seed(LAYOUT.fingerprint, tenant_salt(tenant))
    tokens = encode_tokens(list(range(start, start + blocks * LAYOUT.block_tokens)))
    chained = HASHER.chain(seed, tokens, LAYOUT.block_tokens * 4)
    return seed, [bytes(i) for i in HASHER.split(chained)]


def tier(nodes: list[str], mac_key: bytes | None = None) -> RemoteTier:
    cluster = RemoteCluster(ClusterSettings(tuple(nodes)))
    return RemoteTier(cluster, LAYOUT, "auditz", 4, mac_key=mac_key)


def blocks(count: int) -> torch.Tensor:
    return torch.randn(count, *LAYOUT.block_shape).to(LAYOUT.dtype)


# ---- 1. a fill is bounded by what the local tiers take -----------------------------------


def test_a_fill_past_the_local_room_stores_what_fits_and_reads_one_chunk_more(
    redis_nodes: list[str],
) -> None:
    ca = config(redis_nodes)
    tokens = list(range(20_000, 20_256))  # 64 blocks
    kv = kv_for(tokens, seed=11)
    with node(ca) as a, node(small_gpu(twin(ca), 8)) as b:
        assert a.store(tokens, kv).stored_tokens == 256
        assert a.drain()
        assert b.lookup(tokens).remote_tokens == 256
        got = b.load(tokens)  # chunks of 4, then 8: the 8 find no room (4 free, 4 its prefix)
        assert got.num_tokens == 16 and torch.equal(got.kv, kv[:, :, :16])
        figures = b.status()["remote"]
        assert (figures["fills"], figures["filled_blocks"], figures["fill_refused"]) == (1, 4, 1)
        assert figures["hits"] == 12  # read: 12 blocks of 64
        got = b.load(tokens)  # 4 more fit; the next 8 again do not
        assert got.num_tokens == 32 and torch.equal(got.kv, kv[:, :, :32])
        figures = b.status()["remote"]
        assert (figures["fills"], figures["filled_blocks"], figures["fill_refused"]) == (2, 8, 2)
        assert figures["hits"] == 24 and figures["fill_misses"] == 0
        b.check()


def test_a_fill_reads_at_most_fill_chunk_bytes_a_round_trip(
    redis_nodes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.transfer.remote, "FILL_CHUNK_BYTES", 2 * BLOCK_BYTES, raising=False)
    ca = config(redis_nodes)
    tokens = list(range(30_000, 30_064))  # 16 blocks
    kv = kv_for(tokens, seed=12)
    with node(ca) as a, node(twin(ca)) as b:
        assert a.store(tokens, kv).stored_tokens == 64
        assert a.drain()
        before = b.status()["remote"]["round_trips"]
        got = b.load(tokens)
        assert got.num_tokens == 64 and torch.equal(got.kv, kv)
        figures = b.status()["remote"]
        assert figures["round_trips"] - before == 1 + 8  # the probe, then 2 blocks at a time
        assert (figures["fills"], figures["filled_blocks"], figures["fill_refused"]) == (1, 16, 0)
        b.check()


# ---- 2. the writer holds what it counts ------------------------------------------------------


def test_the_writer_keeps_a_copy_of_the_blocks_it_takes_not_the_callers_tensor() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connects, never answers
        port = silent.getsockname()[1]
        cluster = RemoteCluster(ClusterSettings((f"127.0.0.1:{port}",), timeout_s=0.5))
        writer = RemoteWriter(RemoteTier(cluster, LAYOUT, "auditz", 4), 2 * LAYOUT.block_bytes)
        try:
            seed, ids = path("alice", 0, 65)
            writer.submit(seed, ids, 0, blocks(1))  # taken; its write waits on the connect
            big = blocks(64)
            held = weakref.ref(big)
            assert not writer.submit(seed, ids, 1, big)  # room for one block of 64
            assert writer.pending_bytes == 2 * LAYOUT.block_bytes
            assert writer.stats["dropped_blocks"] == 63
            del big
            gc.collect()
            assert held() is None  # the queued block is the writer's own, not a view of `big`
        finally:
            writer.close()
            cluster.close()


# ---- 3. an empty value is a verify failure ---------------------------------------------------


@pytest.mark.parametrize("authenticate", [False, True])
def test_an_empty_value_under_a_blocks_key_is_a_verify_failure_and_deleted(
    redis_nodes: list[str], authenticate: bool
) -> None:
    mac_key = mac_key_of(b"cluster-secret-0123456789") if authenticate else None
    a, b = tier(redis_nodes, mac_key), tier(redis_nodes, mac_key)
    seed, ids = path(f"empty-{authenticate}", 500, 2)
    keys = path_keys("auditz", ids, 0, 2, 4, keyed=authenticate)
    assert b.cluster.put([(keys[0], b"")]) == [True]  # planted before any node writes it
    kv = blocks(2)
    assert a.write(seed, ids, 0, list(kv)) == [True, True]  # SET NX: block 0 refused
    assert b.probe(seed, ids, 0) == 2  # EXISTS sees the empty value
    out = list(torch.empty_like(kv))
    assert b.read(seed, ids, 0, out) == [False, True]
    figures = b.stats()
    assert (figures["verify_failures"], figures["hits"], figures["misses"]) == (1, 1, 1)
    assert b.probe(seed, ids, 0) == 0  # deleted
    assert a.write(seed, ids, 0, list(kv[:1])) == [True]  # the real block can land now
    assert b.read(seed, ids, 0, out[:1]) == [True] and torch.equal(out[0], kv[0])
    absent_seed, absent = path(f"absent-{authenticate}", 900, 1)
    assert b.read(absent_seed, absent, 0, out[:1]) == [False]  # no key: a plain miss
    assert b.stats()["verify_failures"] == 1
    a.check()
    b.check()


# ---- 4. a payload that does not decode is no hit ---------------------------------------------


def test_a_value_whose_payload_does_not_decode_is_a_miss_not_a_hit(redis_nodes: list[str]) -> None:
    b = tier(redis_nodes)
    seed, ids = path("decode", 700, 2)
    keys = path_keys("auditz", ids, 0, 2, 4)
    metas = [ValueMeta(ids[0], seed, LAYOUT.fingerprint, LAYOUT.block_bytes)]
    metas.append(ValueMeta(ids[1], ids[0], LAYOUT.fingerprint, LAYOUT.block_bytes))
    payload = b"\0" * LAYOUT.block_bytes
    planted = [encode_value(metas[0], "zzz", payload), encode_value(metas[1], "lz4", payload)]
    assert b.cluster.put(list(zip(keys, planted, strict=True))) == [True, True]
    assert b.read(seed, ids, 0, list(blocks(2))) == [False, False]
    figures = b.stats()
    assert (figures["hits"], figures["misses"], figures["verify_failures"]) == (0, 2, 1)
    assert b.probe(seed, ids, 0) == 1  # the lz4 one deleted; "zzz", a newer node's, kept
    b.check()
