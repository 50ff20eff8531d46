"""`RemoteTier` on a real Redis Cluster: blocks one node ("A") writes from KV tensors, another
("B", its own connection) finds and reads bit-exact; tenants and layouts never meet; a value
whose payload does not decode is a counted miss and is deleted, one that names a codec this
build lacks a miss that stays (a newer node's, in a rolling upgrade); a caller's mistake is a
typed error before anything is sent.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redis_cluster import start_cluster

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.errors import InvalidArgumentError, InvalidKVError
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.tiers.disk.codec import Lz4Codec, tier_codec
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import ValueMeta, encode_value
from kvtier.tiers.remote.tier import RemoteTier

LAYOUT = KVLayout("tiny", 2, 2, 8, "bfloat16", 4)
OTHER = KVLayout("tiny", 2, 2, 8, "float16", 4)  # same sizes, another dtype: another model
HASHER = BlockHasher()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    cluster = start_cluster(Path(tmp_path_factory.mktemp("redis")))
    yield cluster.nodes
    cluster.stop()


def node(nodes: list[str], layout: KVLayout = LAYOUT, **kwargs: object) -> RemoteTier:
    """One kvtier node's remote tier: a connection of its own to the shared cluster."""
    return RemoteTier(RemoteCluster(ClusterSettings(tuple(nodes))), layout, "t", 4, **kwargs)  # type: ignore[arg-type]


def path(
    tenant: str, start: int, blocks: int, layout: KVLayout = LAYOUT
) -> tuple[bytes, list[bytes]]:
    seed = HASHER.seed(layout.fingerprint, tenant_salt(tenant))
    tokens = encode_tokens(list(range(start, start + blocks * layout.block_tokens)))
    return seed, [
        bytes(i) for i in HASHER.split(HASHER.chain(seed, tokens, layout.block_tokens * 4))
    ]


def kv(count: int, layout: KVLayout = LAYOUT) -> list[torch.Tensor]:
    return [torch.randn(layout.block_shape).to(layout.dtype) for _ in range(count)]


def empty(count: int, layout: KVLayout = LAYOUT) -> list[torch.Tensor]:
    return [torch.full(layout.block_shape, 7.0, dtype=layout.dtype) for _ in range(count)]


def test_a_prefix_written_on_one_node_is_found_and_read_bit_exact_on_another(
    nodes: list[str],
) -> None:
    a, b = node(nodes), node(nodes)
    seed, ids = path("alice", 0, 20)
    blocks = kv(20)
    assert a.write(seed, ids, 0, blocks[:12]) == [True] * 12
    assert a.write(seed, ids, 12, blocks[12:]) == [True] * 8
    assert b.probe(seed, ids, 0) == 20 and b.probe(seed, ids, 15) == 5
    out = empty(20)
    assert b.read(seed, ids, 0, out) == [True] * 20
    assert all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(out, blocks, strict=True)
    )
    assert b.write(seed, ids, 0, blocks[:2]) == [True, True]  # already there: left as it is
    assert b.stats()["already_present"] == 2 and a.stats()["puts"] == 20
    a.check()
    b.check()


def test_tenants_and_layouts_never_meet(nodes: list[str]) -> None:
    a, b = node(nodes), node(nodes)
    seed, ids = path("alice", 1000, 6)
    a.write(seed, ids, 0, kv(6))
    bob_seed, bob_ids = path("bob", 1000, 6)
    assert b.probe(bob_seed, bob_ids, 0) == 0  # same tokens, another tenant: other ids
    other = node(nodes, OTHER)
    other_seed, other_ids = path("alice", 1000, 6, OTHER)
    assert other.probe(other_seed, other_ids, 0) == 0
    # even asked for alice's exact ids, another layout's reader gets no bytes of hers
    assert other.read(seed, ids, 0, empty(6, OTHER)) == [False] * 6
    assert other.stats()["verify_failures"] == 6


def test_compressed_blocks_round_trip_and_a_payload_that_does_not_decode_is_dropped(
    nodes: list[str],
) -> None:
    a, b = node(nodes, codec=Lz4Codec()), node(nodes)
    seed, ids = path("alice", 2000, 4)
    zeros = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in range(2)]
    assert a.write(seed, ids, 0, zeros) == [True, True]
    out = empty(2)
    assert b.read(seed, ids, 0, out) == [True, True] and all(not x.any() for x in out)
    keys = b._keys(ids, 2, 4)
    metas = [ValueMeta(ids[p], ids[p - 1], LAYOUT.fingerprint, LAYOUT.block_bytes) for p in (2, 3)]
    b.cluster.put(
        [
            (keys[0], encode_value(metas[0], "lz4", b"not an lz4 stream")),
            (keys[1], encode_value(metas[1], "zstd", b"\0" * LAYOUT.block_bytes)),
        ]
    )
    hits = b.stats()["hits"]
    assert b.read(seed, ids, 2, empty(2)) == [False, False]
    figures = b.stats()
    assert figures["verify_failures"] == 1 and figures["hits"] == hits
    assert "codec 'zstd', which this build lacks" in figures["last_error"]
    assert b.cluster.present([keys[0]]) == 0  # the corrupt one deleted
    assert b.cluster.present([keys[1]]) == 1  # was: deleted, a newer node's value
    assert b.read(seed, ids, 3, empty(1)) == [False]
    assert b.stats()["misses"] == figures["misses"] + 1
    b.check()


def test_quantized_values_decode_on_any_node_and_a_mis_scaled_one_is_dropped(
    nodes: list[str],
) -> None:
    int4 = tier_codec("int4", LAYOUT)  # R = 16: groups of 16
    a, b = node(nodes, codec=int4), node(nodes)  # b writes raw, reads whatever a value names
    seed, ids = path("alice", 3000, 4)
    blocks = kv(3)
    blocks[2][0, 0, 1, 1, 3] = float("inf")  # the codec cannot keep it: stored plain
    assert a.write(seed, ids, 0, blocks) == [True] * 3
    out = empty(3)
    assert b.read(seed, ids, 0, out) == [True] * 3
    quant = QuantCodec(QuantSpec("int4"), LAYOUT)
    for got, block in zip(out[:2], blocks[:2], strict=True):
        want = quant.decode(quant.encode(block[None]))[0]
        assert not torch.equal(want, block) and torch.equal(
            got.view(torch.int16), want.view(torch.int16)
        )
    assert torch.equal(out[2].view(torch.int16), blocks[2].view(torch.int16))
    payload = bytearray(quant.encode(blocks[0][None]).numpy().tobytes())
    payload[quant.code_nbytes : quant.code_nbytes + 2] = b"\x00\x7e"  # a NaN scale
    meta = ValueMeta(ids[3], ids[2], LAYOUT.fingerprint, LAYOUT.block_bytes)
    b.cluster.put([(b._keys(ids, 3, 4)[0], encode_value(meta, int4.name, bytes(payload)))])
    assert b.read(seed, ids, 3, empty(1)) == [False]
    assert b.stats()["verify_failures"] == 1 and b.probe(seed, ids, 3) == 0


def test_a_callers_mistake_is_a_typed_error_before_anything_is_sent(nodes: list[str]) -> None:
    a = node(nodes)
    seed, ids = path("alice", 3000, 3)
    with pytest.raises(InvalidKVError, match="expected"):
        a.write(seed, ids, 0, [torch.zeros(3, dtype=LAYOUT.dtype)])
    with pytest.raises(InvalidKVError, match="bfloat16"):
        a.read(seed, ids, 0, [torch.zeros(LAYOUT.block_shape, dtype=torch.float32)])
    with pytest.raises(InvalidArgumentError, match="path of 3 blocks"):
        a.write(seed, ids, 2, kv(2))
    with pytest.raises(InvalidArgumentError, match="group_blocks"):
        RemoteTier(a.cluster, LAYOUT, "t", 0)
    assert a.stats()["round_trips"] == 0
