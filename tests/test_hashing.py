"""Block ids: chained, namespaced by layout and tenant, and the same in every process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from kvtier.blocks import ALGORITHMS, BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.errors import ConfigError

BT = 4
BLOCK_NBYTES = BT * 4
LAYOUT = KVLayout(
    "tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype_name="bfloat16", block_tokens=BT
)
TOKENS = list(range(2 * BT))  # two blocks: [0 1 2 3] [4 5 6 7]

# Computed once (blake2b-128, LAYOUT, tenant "alice", TOKENS). Ids are keys on disk and in
# events, so they must never change silently: a new id scheme needs a new version tag.
EXPECTED_SEED = "a4f212b131ca9efb7f358010af34e5fa"
EXPECTED_IDS = "dd98f00439700d079376766ddfb99b6cced744603f6b4970f6d12d5778dbe863"

CHILD = """
from kvtier.blocks import BlockHasher, tenant_salt
from kvtier.blocks import KVLayout
from kvtier.blocks import encode_tokens
layout = KVLayout("tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype_name="bfloat16",
                  block_tokens=4)
hasher = BlockHasher()
seed = hasher.seed(layout.fingerprint, tenant_salt("alice"))
print(seed.hex(), hasher.chain(seed, encode_tokens(list(range(8))), 16).hex())
"""


def ids_of(hasher: BlockHasher, tenant: str = "alice", layout: KVLayout = LAYOUT) -> list[bytes]:
    seed = hasher.seed(layout.fingerprint, tenant_salt(tenant))
    return list(hasher.split(hasher.chain(seed, encode_tokens(TOKENS), BLOCK_NBYTES)))


def test_chain_returns_one_digest_per_block() -> None:
    hasher = BlockHasher()
    parent = b"\x00" * 16
    assert len(hasher.chain(parent, encode_tokens(list(range(3 * BT))), BLOCK_NBYTES)) == 3 * 16
    assert hasher.chain(parent, b"", BLOCK_NBYTES) == b""
    with pytest.raises(AssertionError, match="whole blocks"):
        hasher.chain(parent, encode_tokens([1, 2, 3]), BLOCK_NBYTES)


def test_ids_follow_the_documented_scheme() -> None:
    """seed = H("kvtier-ns/v1" || fingerprint || salt); id_i = H(id_{i-1} || block i)."""
    salt = tenant_salt("alice")
    seed = hashlib.blake2b(b"kvtier-ns/v1" + LAYOUT.fingerprint + salt, digest_size=16).digest()
    block0, block1 = encode_tokens(TOKENS[:BT]), encode_tokens(TOKENS[BT:])
    id0 = hashlib.blake2b(seed + block0, digest_size=16).digest()
    id1 = hashlib.blake2b(id0 + block1, digest_size=16).digest()
    hasher = BlockHasher()
    assert hasher.seed(LAYOUT.fingerprint, salt) == seed
    assert ids_of(hasher) == [id0, id1]


def test_chaining_in_pieces_equals_chaining_at_once() -> None:
    hasher = BlockHasher()
    seed = hasher.seed(LAYOUT.fingerprint, tenant_salt("alice"))
    key = encode_tokens(TOKENS)
    first = hasher.chain(seed, key[:BLOCK_NBYTES], BLOCK_NBYTES)
    second = hasher.chain(first, key[BLOCK_NBYTES:], BLOCK_NBYTES)
    assert first + second == hasher.chain(seed, key, BLOCK_NBYTES)


def test_id_of_a_block_depends_on_the_blocks_before_it() -> None:
    hasher = BlockHasher()
    seed = hasher.seed(LAYOUT.fingerprint, tenant_salt("alice"))
    same_second_block = encode_tokens([9, 9, 9, 9, 4, 5, 6, 7])
    other = hasher.split(hasher.chain(seed, same_second_block, BLOCK_NBYTES))
    ours = ids_of(hasher)
    assert other[0] != ours[0]
    assert other[1] != ours[1]  # block 1 has the same tokens, but a different prefix


def test_same_tokens_under_another_tenant_or_layout_get_other_ids() -> None:
    hasher = BlockHasher()
    ours = ids_of(hasher)
    other_tenant = ids_of(hasher, tenant="bob")
    other_layout = ids_of(
        hasher,
        layout=KVLayout(
            "tiny", num_layers=3, num_kv_heads=2, head_dim=4, dtype_name="bfloat16", block_tokens=BT
        ),
    )
    other_model = ids_of(
        hasher,
        layout=KVLayout(
            "tiny2",
            num_layers=2,
            num_kv_heads=2,
            head_dim=4,
            dtype_name="bfloat16",
            block_tokens=BT,
        ),
    )
    assert len({*ours, *other_tenant, *other_layout, *other_model}) == 8


def test_tenant_salt_is_keyed_by_the_server_secret() -> None:
    assert len(tenant_salt("alice")) == 16
    assert tenant_salt("alice") == tenant_salt("alice")
    assert tenant_salt("alice") != tenant_salt("bob")
    assert tenant_salt("alice", b"secret-1") != tenant_salt("alice", b"secret-2")
    assert tenant_salt("alice", b"secret-1") != tenant_salt("alice")


@pytest.mark.parametrize(
    ("algorithm", "size"), [("blake2b-128", 16), ("blake2b-256", 32), ("sha256", 32)]
)
def test_every_algorithm_has_its_digest_size(algorithm: str, size: int) -> None:
    hasher = BlockHasher(algorithm)
    assert hasher.digest_size == size
    seed = hasher.seed(LAYOUT.fingerprint, tenant_salt("alice"))
    assert len(seed) == size
    ids = ids_of(hasher)
    assert [len(i) for i in ids] == [size, size]
    assert ids[0] != ids[1]


def test_algorithms_give_different_ids() -> None:
    seeds = {BlockHasher(name).seed(LAYOUT.fingerprint, b"") for name in ALGORITHMS}
    assert len(seeds) == len(ALGORITHMS) == 3


def test_unknown_algorithm_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="'md5'") as info:
        BlockHasher("md5")
    assert info.value.field == "hashing.algorithm"
    assert "blake2b-128" in info.value.expected


def test_ids_match_the_recorded_values() -> None:
    hasher = BlockHasher()
    seed = hasher.seed(LAYOUT.fingerprint, tenant_salt("alice"))
    assert seed.hex() == EXPECTED_SEED
    assert b"".join(ids_of(hasher)).hex() == EXPECTED_IDS


@pytest.mark.parametrize("hash_seed", ["0", pytest.param("12345", marks=pytest.mark.slow)])
def test_ids_are_the_same_in_another_process(hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    child = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    seed_hex, ids_hex = child.stdout.split()
    hasher = BlockHasher()
    seed = hasher.seed(LAYOUT.fingerprint, tenant_salt("alice"))
    assert (seed_hex, ids_hex) == (seed.hex(), b"".join(ids_of(hasher)).hex())
    assert (seed_hex, ids_hex) == (EXPECTED_SEED, EXPECTED_IDS)


def test_a_tensor_parallel_shard_has_a_fingerprint_of_its_own_and_one_rank_keeps_the_old() -> None:
    """Ranks hold other heads under the same tokens: their blocks never share an id. An
    unsharded layout keeps the fingerprint it had before shards were named (disk copies stay
    readable)."""
    fields = ("m", 2, 2, 8, "float16", 4)
    old_text = "kvtier-layout/v1|m|2|2|8|float16|4"
    assert (
        KVLayout(*fields).fingerprint == hashlib.blake2b(old_text.encode(), digest_size=16).digest()
    )
    shards = {KVLayout(*fields, tp_rank=r, tp_size=4).fingerprint for r in range(4)}
    assert len(shards) == 4 and KVLayout(*fields).fingerprint not in shards
    assert KVLayout(*fields, tp_rank=0, tp_size=1) == KVLayout(*fields)
    for rank, size in ((4, 4), (-1, 2), (0, 0)):
        with pytest.raises(ConfigError):
            KVLayout(*fields, tp_rank=rank, tp_size=size)
