"""The remote tier's key and value (`kvtier/tiers/remote/entry.py`): a value is served only
when it is exactly the block a reader asked for; anything else, whatever its bytes, is a typed
`RemoteValueError` (a miss), never another exception and never other bytes."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.blocks import BlockHasher, KVLayout, encode_tokens, tenant_salt
from kvtier.errors import InvalidArgumentError
from kvtier.tiers.remote.entry import (
    RemoteValueError,
    ValueMeta,
    block_key,
    check_prefix,
    decode_value,
    encode_value,
    encode_value_parts,
    header_nbytes,
    path_keys,
)

LAYOUT = KVLayout("tiny", 1, 1, 8, "float16", 4)
HASHER = BlockHasher()
SEED = HASHER.seed(LAYOUT.fingerprint, tenant_salt("alice"))


def meta(raw_nbytes: int = 64, id_len: int = 16) -> ValueMeta:
    return ValueMeta(os.urandom(id_len), os.urandom(id_len), LAYOUT.fingerprint, raw_nbytes)


def test_a_value_round_trips_and_its_payload_is_a_view() -> None:
    m = meta()
    payload = os.urandom(64)
    value = encode_value(m, "none", payload)
    assert len(value) == header_nbytes(16, "none") + 64
    codec, got = decode_value(value, m)
    assert (codec, bytes(got)) == ("none", payload)
    assert got.obj is memoryview(value).obj  # no copy of the payload


def test_a_split_value_is_the_same_bytes_with_the_payload_only_viewed() -> None:
    for raw_nbytes, id_len, codec in ((64, 16, "none"), (4096, 32, "lz4")):
        m = meta(raw_nbytes=raw_nbytes, id_len=id_len)
        payload = bytearray(os.urandom(raw_nbytes // 2))
        split = encode_value_parts(m, codec, payload)
        assert b"".join(split.parts) == encode_value(m, codec, bytes(payload))
        assert split.nbytes == len(encode_value(m, codec, bytes(payload)))
        assert len(split.head) == header_nbytes(id_len, codec)
        assert split.payload.obj is payload  # a view: no copy of the payload
        assert decode_value(b"".join(split.parts), m)[0] == codec
    with pytest.raises(InvalidArgumentError, match="codec"):  # checked as encode_value checks
        encode_value_parts(meta(), "", b"x" * 64)


def test_a_compressed_payload_keeps_its_codec_and_sizes() -> None:
    m = meta(raw_nbytes=4096, id_len=32)
    value = encode_value(m, "lz4", b"\x01" * 100)
    assert decode_value(value, m)[0] == "lz4"
    assert bytes(decode_value(value, m)[1]) == b"\x01" * 100


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        ("block_id", "another block"),
        ("parent_id", "another block"),
        ("layout", "another model layout"),
        ("raw_nbytes", "sizes"),
    ],
)
def test_a_value_for_another_block_layout_or_size_is_a_miss(field: str, reason: str) -> None:
    m = meta()
    value = encode_value(m, "none", os.urandom(64))
    other = {
        "block_id": os.urandom(16),
        "parent_id": os.urandom(16),
        "layout": os.urandom(16),
        "raw_nbytes": 128,
    }[field]
    expect = ValueMeta(**{**m.__dict__, field: other})
    with pytest.raises(RemoteValueError, match=reason):
        decode_value(value, expect)


def test_every_truncation_and_every_flipped_bit_is_a_miss() -> None:
    m = meta(raw_nbytes=32)
    value = encode_value(m, "none", os.urandom(32))
    for length in range(len(value)):
        with pytest.raises(RemoteValueError):
            decode_value(value[:length], m)
    with pytest.raises(RemoteValueError, match="length"):
        decode_value(value + b"\0", m)
    for at in range(len(value)):
        for bit in (0, 7):
            flipped = bytearray(value)
            flipped[at] ^= 1 << bit
            with pytest.raises(RemoteValueError):
                decode_value(bytes(flipped), m)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_are_a_value_or_a_typed_miss(data: bytes) -> None:
    m = meta()
    try:
        codec, payload = decode_value(data, m)
    except RemoteValueError as e:
        assert e.reason
    else:  # only a value written for exactly this block gets through
        assert encode_value(m, codec, payload) == data


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 200), st.binary(min_size=1, max_size=4))
def test_overwritten_bytes_of_a_real_value_are_a_miss(noise: bytes, at: int, _: bytes) -> None:
    m = meta()
    value = bytearray(encode_value(m, "none", os.urandom(64)))
    at %= len(value)
    original = bytes(value)
    value[at : at + len(noise)] = noise  # may also shorten or lengthen it
    if bytes(value) == original:
        return
    with pytest.raises(RemoteValueError):
        decode_value(bytes(value), m)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"block_id": b"short"}, "block_id"),
        ({"parent_id": b"\0" * 32}, "parent_id"),
        ({"layout": b"\0" * 15}, "layout"),
    ],
)
def test_encode_refuses_malformed_metadata_naming_the_field(
    change: dict[str, bytes], field: str
) -> None:
    m = meta()
    with pytest.raises(InvalidArgumentError, match=field):
        encode_value(ValueMeta(**{**m.__dict__, **change}), "none", b"x" * 64)


@pytest.mark.parametrize("codec", ["", "toolongname", "n\u00e9", "a\nb"])
def test_encode_refuses_a_codec_name_that_is_not_short_printable_ascii(codec: str) -> None:
    with pytest.raises(InvalidArgumentError, match="codec"):
        encode_value(meta(), codec, b"x" * 64)


@pytest.mark.parametrize("size", [0, 65])
def test_encode_refuses_a_payload_empty_or_larger_than_its_block(size: int) -> None:
    with pytest.raises(InvalidArgumentError, match="payload"):
        encode_value(meta(raw_nbytes=64), "none", b"x" * size)


# ---- keys -----------------------------------------------------------------------------------


def chain(tokens: list[int], seed: bytes = SEED) -> list[bytes]:
    key = encode_tokens(tokens)
    ids = HASHER.chain(seed, key, LAYOUT.block_tokens * 4)
    return [bytes(block_id) for block_id in HASHER.split(ids)]


def test_keys_of_one_group_share_a_hash_tag_and_later_groups_move_on() -> None:
    ids = chain(list(range(40)))  # 10 blocks of 4 tokens
    keys = path_keys("fleet-a", ids, 0, 10, group_blocks=4)
    tags = [key.split(b"{")[1].split(b"}")[0] for key in keys]
    assert tags[0:4] == [ids[0][:8].hex().encode()] * 4
    assert tags[4:8] == [ids[4][:8].hex().encode()] * 4
    assert tags[8:] == [ids[8][:8].hex().encode()] * 2
    assert keys[6] == block_key("fleet-a", ids[4], ids[6])
    assert keys[6] == f"fleet-a:v1:{{{ids[4][:8].hex()}}}:{ids[6].hex()}".encode()
    assert path_keys("fleet-a", ids, 5, 7, 4) == keys[5:7]
    assert len(set(keys)) == 10


def test_keys_hold_no_token_or_tenant_and_differ_by_tenant_and_prefix() -> None:
    tokens = [123456, 7, 8, 9] * 2
    alice = path_keys("fleet", chain(tokens), 0, 2, 4)
    bob = path_keys(
        "fleet", chain(tokens, HASHER.seed(LAYOUT.fingerprint, tenant_salt("bob"))), 0, 2, 4
    )
    assert set(alice).isdisjoint(bob)
    assert set(alice).isdisjoint(path_keys("other", chain(tokens), 0, 2, 4))
    for key in alice:
        assert b"alice" not in key and b"123456" not in key and b"1e240" not in key


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", "a:b", "a b", "x" * 65, "caf\u00e9"])
def test_a_key_prefix_that_could_move_the_hash_tag_is_refused(prefix: str) -> None:
    with pytest.raises(InvalidArgumentError, match="key_prefix"):
        check_prefix(prefix)
    assert check_prefix("kvtier-prod_1.eu") == "kvtier-prod_1.eu"
