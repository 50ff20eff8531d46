"""Disk slot headers: exact sizes, round trips, and every kind of damage is `CorruptHeader`."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from types import SimpleNamespace

import msgpack  # type: ignore[import-untyped]
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError
from kvtier.tiers.disk.format import (
    FORMAT_VERSION,
    MAGIC,
    SECTOR,
    BlockHeader,
    CorruptHeader,
    HeaderWriter,
    align_up,
    checksum,
    decode_header,
    empty_header,
    encode_header,
    header_region_size,
    slot_size,
)

PREFIX = 10  # MAGIC(4) | version u16 | body_len u32


def make_header(digest_size: int = 16, block_tokens: int = 16, **changes: object) -> BlockHeader:
    header = BlockHeader(
        block_id=bytes(range(1, digest_size + 1)),
        parent_id=bytes(range(101, 101 + digest_size)),
        namespace=bytes(range(201, 201 + digest_size)),
        tenant="acme-prod",
        layout=b"L" * 16,
        tokens=b"".join(struct.pack("<I", 1000 + i) for i in range(block_tokens)),
        codec="lz4",
        raw_nbytes=2 * 1024 * 1024,
        payload_nbytes=1_700_000,
        payload_checksum=checksum(b"payload"),
        seq=42,
    )
    return replace(header, **changes)  # type: ignore[arg-type]


def framed(body: bytes, version: int = FORMAT_VERSION, region: int = SECTOR) -> bytes:
    """A header region around any `body`, with a correct header checksum."""
    head = struct.pack("<4sHI", MAGIC, version, len(body)) + body
    out = head + xxhash.xxh3_128_digest(head)
    return out + bytes(region - len(out))


def body_of(header: BlockHeader) -> list[object]:
    return [
        header.block_id,
        header.parent_id,
        header.namespace,
        header.tenant,
        header.layout,
        header.tokens,
        header.codec,
        header.raw_nbytes,
        header.payload_nbytes,
        header.payload_checksum,
        header.seq,
    ]


def header_end(region: bytes) -> int:
    """End of the checksummed part: PREFIX + body_len + 16."""
    (body_len,) = struct.unpack_from("<I", region, 6)
    end: int = PREFIX + body_len + 16
    return end


# ---- geometry -----------------------------------------------------------------------------------


def test_align_up_and_slot_size_are_whole_sectors() -> None:
    assert [align_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    assert align_up(10, 8) == 16
    assert slot_size(4096, 2 * 1024 * 1024) == 4096 + 2 * 1024 * 1024
    assert slot_size(4096, 100) == 8192
    assert slot_size(8192, 4097) == 8192 + 8192
    with pytest.raises(ValueError, match="multiple of 4096"):
        slot_size(4000, 100)
    with pytest.raises(ValueError):
        align_up(-1)


@pytest.mark.parametrize(
    ("block_tokens", "digest_size", "region"),
    [(16, 16, 4096), (16, 32, 4096), (1000, 32, 8192), (4096, 16, 20480), (4096, 32, 20480)],
)
def test_header_region_size_is_exact_sectors(
    block_tokens: int, digest_size: int, region: int
) -> None:
    assert header_region_size(block_tokens, digest_size) == region


def test_largest_header_of_a_geometry_fits_its_region() -> None:
    region = header_region_size(4096, 32)
    widest = make_header(
        32,
        4096,
        tenant="\U0010ffff" * 64,
        codec="\U0010ffff" * 8,
        raw_nbytes=2**64 - 1,
        payload_nbytes=2**64 - 1,
        seq=2**64 - 1,
    )
    assert decode_header(encode_header(widest, region)) == widest


def test_header_region_size_refuses_unknown_geometry() -> None:
    with pytest.raises(ValueError, match="digest_size"):
        header_region_size(16, 20)
    with pytest.raises(ValueError, match="block_tokens"):
        header_region_size(0, 16)


# ---- round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize("digest_size", [16, 32])
@pytest.mark.parametrize("block_tokens", [16, 4096])
def test_header_round_trips_and_pads_to_exactly_the_region(
    digest_size: int, block_tokens: int
) -> None:
    header = make_header(digest_size, block_tokens)
    region = header_region_size(block_tokens, digest_size)
    encoded = encode_header(header, region)
    assert len(encoded) == region
    assert encoded[:4] == b"KVTB"
    assert struct.unpack_from("<H", encoded, 4) == (1,)
    end = header_end(encoded)
    assert encoded[end:] == bytes(region - end)
    assert msgpack.unpackb(encoded[PREFIX : end - 16], raw=False) == body_of(header)
    assert decode_header(encoded) == header
    # A whole slot (header region + payload) decodes the same.
    assert decode_header(memoryview(encoded + b"\xab" * 8192)) == header


def test_encode_refuses_a_region_too_small_or_not_whole_sectors() -> None:
    header = make_header(32, 4096)
    with pytest.raises(ValueError, match="does not fit a header region of 4096 bytes"):
        encode_header(header, 4096)
    with pytest.raises(ValueError, match="multiple of 4096"):
        encode_header(make_header(), 1000)


def test_block_header_refuses_malformed_fields() -> None:
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.block_id"):
        make_header(block_id=b"x" * 20)
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.parent_id"):
        make_header(parent_id=b"x" * 32)
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.tokens"):
        make_header(tokens=b"abc")
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.tenant"):
        make_header(tenant="t" * 65)
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.payload_nbytes"):
        make_header(raw_nbytes=10, payload_nbytes=11)
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.seq: got True, expected int"):
        make_header(seq=True)
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.seq"):
        make_header(seq=-1)


# ---- empty and damaged slots --------------------------------------------------------------------


def test_empty_slot_decodes_to_none() -> None:
    assert empty_header(8192) == bytes(8192)
    assert decode_header(empty_header(4096)) is None
    assert decode_header(bytes(16)) is None
    # Only the first 16 bytes decide: a retired header over an old payload is still empty.
    assert decode_header(bytes(16) + b"\xff" * 100) is None


def test_every_bit_flip_in_the_checksummed_part_is_corrupt() -> None:
    encoded = encode_header(make_header(), SECTOR)
    end = header_end(encoded)
    assert end == 10 + 182 + 16  # prefix, msgpack body, header checksum
    for pos in range(end):
        for bit in range(8):
            damaged = bytearray(encoded)
            damaged[pos] ^= 1 << bit
            with pytest.raises(CorruptHeader):
                decode_header(bytes(damaged))


def test_flip_in_the_padding_is_harmless() -> None:
    header = make_header()
    damaged = bytearray(encode_header(header, SECTOR))
    damaged[-1] ^= 0xFF
    assert decode_header(bytes(damaged)) == header


def test_every_truncation_is_corrupt() -> None:
    encoded = encode_header(make_header(), SECTOR)
    end = header_end(encoded)
    for n in range(end):
        with pytest.raises(CorruptHeader, match="truncated"):
            decode_header(encoded[:n])
    assert decode_header(encoded[:end]) == make_header()


def test_reasons_name_what_failed() -> None:
    encoded = encode_header(make_header(), SECTOR)
    body = msgpack.packb(body_of(make_header()), use_bin_type=True)
    cases = {
        b"XXXX" + encoded[4:]: "bad magic b'XXXX', expected b'KVTB'",
        framed(body, version=2): "format version 2, this build reads 1",
        encoded[:100]: "truncated: body of 182 bytes needs 208 bytes, got 100",
        encoded[:207] + bytes([encoded[207] ^ 1]) + encoded[208:]: "header checksum mismatch",
        framed(b"\xc1"): "body is not msgpack",
        framed(body + b"\x00"): "body is not msgpack",
        framed(msgpack.packb(body_of(make_header())[:10])): "body is not an array of 11 fields",
        framed(msgpack.packb({"seq": 1})): "body is not an array of 11 fields",
    }
    for region, reason in cases.items():
        with pytest.raises(CorruptHeader) as caught:
            decode_header(region)
        assert caught.value.reason.startswith(reason), (caught.value.reason, reason)


@pytest.mark.parametrize(
    ("index", "value", "field"),
    [
        (0, "a string id", "block_id"),
        (0, b"x" * 20, "block_id"),
        (1, b"x" * 32, "parent_id"),
        (3, b"tenant as bytes", "tenant"),
        (5, b"abcde", "tokens"),
        (7, 1.5, "raw_nbytes"),
        (8, 3_000_000, "payload_nbytes"),
        (9, b"short", "payload_checksum"),
        (10, True, "seq"),
        (10, -1, "seq"),
    ],
)
def test_checksummed_body_with_a_bad_field_is_corrupt(
    index: int, value: object, field: str
) -> None:
    """A writer's bug (valid checksum, wrong field) is caught by the field checks."""
    body = body_of(make_header())
    body[index] = value
    with pytest.raises(CorruptHeader, match=rf"BlockHeader\.{field}"):
        decode_header(framed(msgpack.packb(body, use_bin_type=True)))


# ---- fuzz ---------------------------------------------------------------------------------------


def decodes_or_is_corrupt(buf: bytes) -> None:
    try:
        result = decode_header(buf)
    except CorruptHeader as e:
        assert isinstance(e.reason, str) and e.reason
    else:
        assert result is None or isinstance(result, BlockHeader)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_only_ever_give_none_a_header_or_corrupt(buf: bytes) -> None:
    decodes_or_is_corrupt(buf)
    decodes_or_is_corrupt(MAGIC + buf)
    decodes_or_is_corrupt(MAGIC + struct.pack("<H", FORMAT_VERSION) + buf)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_checksummed_bodies_only_give_a_header_or_corrupt(body: bytes) -> None:
    decodes_or_is_corrupt(framed(body))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=70)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=12) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(msgpack_values, min_size=11, max_size=11) | msgpack_values)
def test_arbitrary_msgpack_bodies_only_give_a_header_or_corrupt(value: object) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    if len(body) <= SECTOR - PREFIX - 16:
        decodes_or_is_corrupt(framed(body))


@settings(max_examples=200, deadline=None)
@given(
    block_id=st.binary(min_size=16, max_size=16),
    tenant=st.text(st.characters(codec="utf-8"), min_size=1, max_size=64),
    n_tokens=st.integers(min_value=1, max_value=16),
    raw=st.integers(min_value=1, max_value=2**64 - 1),
    seq=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_any_valid_header_round_trips(
    block_id: bytes, tenant: str, n_tokens: int, raw: int, seq: int
) -> None:
    header = make_header(
        block_id=block_id,
        tenant=tenant,
        tokens=bytes(4 * n_tokens),
        raw_nbytes=raw,
        payload_nbytes=raw,
        seq=seq,
    )
    assert decode_header(encode_header(header, header_region_size(16, 16))) == header


# ---- the write path's headers (HeaderWriter) ------------------------------------------------


def test_the_bytes_of_a_header_are_pinned() -> None:
    """Slab files written before must keep recovering: these are the bytes of format 1."""
    pinned = {
        (16, 16, SECTOR): "bd4d14d31560262e4d6f145d198977ecc09f32fa4b15bd33e5d19bf02a0b3c79",
        (32, 1000, 8192): "90bae0eeae975bdf2bda6f76ec59fefd909b491cdd4c1614906437c4771b51ff",
    }
    for (digest_size, block_tokens, region), sha in pinned.items():
        header = make_header(digest_size, block_tokens)
        if digest_size == 32:
            header = replace(header, tenant="ténant-\U0010ffff", codec="none", seq=2**64 - 1)
        assert hashlib.sha256(encode_header(header, region)).hexdigest() == sha
        writer = HeaderWriter(region, header.layout, header.raw_nbytes)
        payload = b"payload" if digest_size == 16 else b"x" * header.payload_nbytes
        header = replace(header, payload_checksum=checksum(payload), payload_nbytes=len(payload))
        assert writer.encode(header, header.codec, payload, header.seq) == encode_header(
            header, region
        )


@settings(max_examples=300, deadline=None)
@given(
    digest_size=st.sampled_from([16, 32]),
    tenant=st.text(st.characters(codec="utf-8"), min_size=1, max_size=64),
    codec=st.text(st.characters(codec="utf-8"), min_size=1, max_size=8),
    n_tokens=st.integers(min_value=1, max_value=16),
    payload=st.binary(min_size=1, max_size=300),
    spare=st.integers(min_value=0, max_value=2**64 - 301),
    seq=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_the_writer_gives_the_bytes_of_encode_header(
    digest_size: int, tenant: str, codec: str, n_tokens: int, payload: bytes, spare: int, seq: int
) -> None:
    raw = len(payload) + spare
    header = make_header(
        digest_size,
        tenant=tenant,
        tokens=bytes(range(4 * n_tokens)),
        codec=codec,
        raw_nbytes=raw,
        payload_nbytes=len(payload),
        payload_checksum=checksum(payload),
        seq=seq,
    )
    writer = HeaderWriter(header_region_size(16, 32), b"L" * 16, raw)
    encoded = writer.encode(header, codec, memoryview(payload), seq)
    assert encoded == encode_header(header, writer.region_size)
    assert decode_header(encoded) == header


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"block_id": b"x" * 20}, "block_id"),
        ({"block_id": bytearray(16)}, "block_id"),
        ({"parent_id": b"x" * 32}, "parent_id"),
        ({"namespace": "a string"}, "namespace"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": b"bytes"}, "tenant"),
        ({"tokens": b"abc"}, "tokens"),
        ({"codec": "longer-than-8"}, "codec"),
        ({"payload_nbytes": 2 * 1024 * 1024 + 1}, "payload_nbytes"),
        ({"seq": True}, "seq"),
        ({"seq": 2**64}, "seq"),
    ],
)
def test_the_writer_refuses_what_block_header_refuses_with_its_message(
    change: dict[str, object], field: str
) -> None:
    fields = {f.name: getattr(make_header(), f.name) for f in dataclass_fields(BlockHeader)}
    fields |= change
    payload = bytes(fields["payload_nbytes"])
    fields["payload_checksum"] = checksum(payload)
    with pytest.raises(InvalidArgumentError, match=rf"BlockHeader\.{field}") as expected:
        BlockHeader(**fields)
    writer = HeaderWriter(SECTOR, fields["layout"], fields["raw_nbytes"])
    with pytest.raises(InvalidArgumentError) as caught:
        writer.encode(SimpleNamespace(**fields), fields["codec"], payload, fields["seq"])
    assert str(caught.value) == str(expected.value)


def test_the_writer_checks_its_fixed_fields_once() -> None:
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.layout"):
        HeaderWriter(SECTOR, b"short", 4096)
    with pytest.raises(InvalidArgumentError, match=r"BlockHeader\.raw_nbytes"):
        HeaderWriter(SECTOR, b"L" * 16, 0)
    with pytest.raises(ValueError, match="multiple of 4096"):
        HeaderWriter(1000, b"L" * 16, 4096)
    writer = HeaderWriter(SECTOR, b"L" * 16, 4096)
    with pytest.raises(ValueError, match="does not fit a header region of 4096 bytes"):
        writer.encode(make_header(32, 4096), "none", b"x", 1)


# ---- checksum -----------------------------------------------------------------------------------


def test_checksum_is_16_bytes_and_sees_a_single_bit() -> None:
    data = bytearray(b"kvtier block payload" * 1000)
    digest = checksum(bytes(data))
    assert len(digest) == 16
    assert digest == xxhash.xxh3_128_digest(bytes(data))
    assert checksum(memoryview(data)) == digest
    data[1234] ^= 0x01
    assert checksum(bytes(data)) != digest
