"""The remote tier's keys and values on a real Redis Cluster (3 primaries on loopback, started by
`tests/redis_cluster.py`, by CI or by the module): a group of blocks lives in one slot, so one
pipelined round trip reads it; values come back bit-exact, and one the cluster holds damaged is
a typed miss; a value sent in two parts (`SplitValue`) is stored as the bytes of the joined one.

Skipped without Debian's `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it), where a
missing server fails instead."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, ResponseError

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import (
    RemoteValueError,
    SplitValue,
    ValueMeta,
    decode_value,
    encode_value,
    encode_value_parts,
)
from kvtier.tiers.remote.entry import path_keys as keys_of

LAYOUT = KVLayout("tiny", 1, 1, 8, "float16", 4)
HASHER = BlockHasher()
SEED = HASHER.seed(LAYOUT.fingerprint, tenant_salt("alice"))
GROUP = 4


@pytest.fixture
def client(redis_nodes: list[str]) -> Iterator[RedisCluster]:
    host, port = redis_nodes[0].split(":")
    redis = RedisCluster(startup_nodes=[ClusterNode(host, int(port))])
    yield redis
    redis.close()


def fetch(client: RedisCluster, key: bytes) -> bytes:
    value = client.get(key)
    assert isinstance(value, bytes)
    return value


def ids_of(tokens: list[int]) -> list[bytes]:
    return list(HASHER.split(HASHER.chain(SEED, encode_tokens(tokens), LAYOUT.block_tokens * 4)))


def test_a_group_is_one_slot_and_one_pipelined_round_trip_reads_it(client: RedisCluster) -> None:
    ids = ids_of(list(range(48)))  # 12 blocks: 3 groups of 4
    keys = keys_of("kvtier-test", ids, 0, 12, GROUP)
    slots = [key_slot(key) for key in keys]
    assert len(set(slots[0:4])) == len(set(slots[4:8])) == len(set(slots[8:12])) == 1
    assert len(set(slots)) == 3  # 3 groups: 3 slots (with these ids; 1 in 16384 could collide)
    values = {key: os.urandom(32) + key for key in keys}
    client.mset_nonatomic(values)
    assert client.mget(keys[4:8]) == [values[k] for k in keys[4:8]]  # one slot: one MGET
    with pytest.raises((RedisClusterException, ResponseError)):
        client.execute_command("MGET", *keys[3:5])  # two groups: two slots, refused
    client.delete(*keys)


def test_values_come_back_bit_exact_and_a_damaged_one_is_a_miss(client: RedisCluster) -> None:
    ids = ids_of(list(range(100, 124)))  # 6 blocks
    keys = keys_of("kvtier-test", ids, 0, 6, GROUP)
    block_bytes = LAYOUT.block_bytes
    payloads = [os.urandom(block_bytes) for _ in ids]
    parents = [SEED, *ids[:-1]]
    metas = [
        ValueMeta(i, p, LAYOUT.fingerprint, block_bytes) for i, p in zip(ids, parents, strict=True)
    ]
    pipe = client.pipeline()
    for key, meta, payload in zip(keys, metas, payloads, strict=True):
        pipe.set(key, encode_value(meta, "none", payload))
    assert all(pipe.execute())
    got = [fetch(client, key) for key in keys[:4]]
    for value, meta, payload in zip(got, metas, payloads, strict=False):
        assert bytes(decode_value(value, meta)[1]) == payload
    client.setrange(keys[4], 40, b"\xff")  # a byte of the header changed in the cluster
    client.set(keys[5], fetch(client, keys[5])[:-3])  # a value cut short
    for key, meta in zip(keys[4:], metas[4:], strict=True):
        with pytest.raises(RemoteValueError):
            decode_value(fetch(client, key), meta)
    with pytest.raises(RemoteValueError, match="another block"):  # stored under another key
        decode_value(got[0], metas[1])
    client.delete(*keys)


def test_a_split_value_is_stored_as_the_bytes_of_the_joined_value(
    client: RedisCluster, redis_nodes: list[str]
) -> None:
    """`RemoteCluster.put` sends a `SplitValue`'s header and payload one after the other (no
    joined copy): the cluster must hold exactly `encode_value`'s bytes, for payloads below and
    above redis-py's 6000-byte chunking cutoff, in one pipeline with plain values."""
    remote = RemoteCluster(ClusterSettings(tuple(redis_nodes), timeout_s=5.0))
    ids = ids_of(list(range(200, 232)))  # 8 blocks, 2 groups
    keys = keys_of("kvtier-split", ids, 0, 8, GROUP)
    metas = [
        ValueMeta(i, p, LAYOUT.fingerprint, 2**16)
        for i, p in zip(ids, [SEED, *ids[:-1]], strict=True)
    ]
    payloads = [os.urandom(size) for size in (1, 100, 5999, 6000, 6001, 2**15, 2**16, 7)]
    values: list[bytes | SplitValue] = [
        encode_value_parts(m, "none", p) if i % 4 else encode_value(m, "none", p)
        for i, (m, p) in enumerate(zip(metas, payloads, strict=True))
    ]
    assert remote.put(list(zip(keys, values, strict=True))) == [True] * 8
    for key, m, payload in zip(keys, metas, payloads, strict=True):
        assert fetch(client, key) == encode_value(m, "none", payload)
    got = remote.get(keys, metas)
    assert [bytes(entry[1]) if entry else None for entry in got] == payloads
    assert remote.put([(keys[1], values[1])]) == [True]  # NX: present already, left as it is
    stats = remote.stats()
    assert (stats["puts"], stats["already_present"], stats["errors"]) == (8, 1, 0)
    remote.delete(keys)
    remote.close()
