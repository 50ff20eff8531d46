"""Payload codecs: bit-exact round trips, exact shuffle layout, corrupt input is CorruptPayload."""

from __future__ import annotations

from collections.abc import Callable

import lz4.block  # type: ignore[import-untyped]
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError
from kvtier.tiers.disk.codec import (
    CODECS,
    CorruptPayload,
    Lz4Codec,
    NoneCodec,
    get_codec,
    shuffle,
    unshuffle,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
N_ELEMENTS = 2 * 2 * 16 * 8 * 64  # a small block: 2 layers, K|V, 16 tokens, 8 heads, dim 64


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def random_kv(dtype: torch.dtype, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return raw_bytes(torch.randn(N_ELEMENTS, generator=gen).to(dtype))


def smooth_kv(dtype: torch.dtype) -> bytes:
    """Slowly varying values, like neighbouring KV channels: the exponent bytes repeat."""
    return raw_bytes(torch.sin(torch.linspace(0, 20, N_ELEMENTS)).to(dtype))


# ---- shuffle ------------------------------------------------------------------------------------


def test_shuffle_puts_each_byte_of_an_element_in_its_plane() -> None:
    assert bytes(shuffle(bytes([1, 2, 3, 4, 5, 6]), 2)) == bytes([1, 3, 5, 2, 4, 6])
    assert bytes(shuffle(bytes(range(8)), 4)) == bytes([0, 4, 1, 5, 2, 6, 3, 7])
    assert bytes(unshuffle(bytes([1, 3, 5, 2, 4, 6]), 2)) == bytes([1, 2, 3, 4, 5, 6])
    assert bytes(unshuffle(bytes([0, 4, 1, 5, 2, 6, 3, 7]), 4)) == bytes(range(8))


def test_shuffle_of_single_bytes_is_the_input_itself() -> None:
    raw = bytes([9, 8, 7])
    assert shuffle(raw, 1) is raw
    assert unshuffle(raw, 1) is raw


def test_shuffle_returns_a_flat_byte_view() -> None:
    planes = shuffle(bytes(12), 4)
    assert isinstance(planes, memoryview)
    assert (planes.format, len(planes), planes.nbytes) == ("B", 12, 12)


def test_shuffle_refuses_a_partial_element() -> None:
    with pytest.raises(InvalidArgumentError, match="5 bytes are not a whole number of 2-byte"):
        shuffle(bytes(5), 2)
    with pytest.raises(InvalidArgumentError, match="itemsize"):
        shuffle(bytes(4), 0)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=8), st.binary(max_size=256))
def test_unshuffle_inverts_shuffle(itemsize: int, data: bytes) -> None:
    data = data[: len(data) - len(data) % itemsize]
    assert bytes(unshuffle(shuffle(data, itemsize), itemsize)) == data


# ---- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["none", "lz4"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [random_kv, smooth_kv])
def test_round_trip_is_bit_exact(
    name: str, dtype: torch.dtype, make: Callable[[torch.dtype], bytes]
) -> None:
    raw = make(dtype)
    codec = get_codec(name)
    stored = codec.encode(raw, dtype.itemsize)
    assert bytes(codec.decode(stored, len(raw), dtype.itemsize)) == raw


def test_round_trip_from_a_memoryview_of_a_tensor() -> None:
    kv = torch.sin(torch.linspace(0, 5, 1024)).to(torch.bfloat16)
    raw = kv.view(torch.uint8).numpy().data
    lz4c = CODECS["lz4"]
    back = lz4c.decode(lz4c.encode(raw, 2), raw.nbytes, 2)
    restored = torch.frombuffer(bytearray(back), dtype=torch.bfloat16)
    assert torch.equal(restored.view(torch.int16), kv.view(torch.int16))


@pytest.mark.parametrize(("dtype", "at_most"), [(torch.float16, 0.25), (torch.bfloat16, 0.12)])
def test_lz4_with_shuffle_shrinks_smooth_16_bit_data(dtype: torch.dtype, at_most: float) -> None:
    raw = smooth_kv(dtype)
    stored = CODECS["lz4"].encode(raw, 2)
    assert len(stored) <= at_most * len(raw)
    unshuffled = lz4.block.compress(raw, store_size=False)
    assert len(stored) < len(unshuffled) / 2


def test_lz4_may_grow_noise_so_the_tier_stores_it_as_none() -> None:
    raw = random_kv(torch.float16)
    assert len(CODECS["lz4"].encode(raw, 2)) > len(raw)


def test_none_is_zero_copy() -> None:
    raw = memoryview(bytearray(b"abcd" * 8))
    none = CODECS["none"]
    assert none.encode(raw, 2) is raw
    assert none.decode(raw, 32, 2) is raw


# ---- corrupt payloads ---------------------------------------------------------------------------


def test_none_refuses_a_payload_of_the_wrong_size() -> None:
    with pytest.raises(CorruptPayload, match="'none' payload of 31 bytes, expected 32"):
        CODECS["none"].decode(bytes(31), 32, 2)


def test_lz4_refuses_corrupt_truncated_or_missized_payloads() -> None:
    raw = smooth_kv(torch.bfloat16)
    lz4c = CODECS["lz4"]
    stored = bytes(lz4c.encode(raw, 2))
    with pytest.raises(CorruptPayload, match="does not decode"):
        lz4c.decode(b"\xff" * 50, len(raw), 2)
    with pytest.raises(CorruptPayload, match="does not decode"):
        lz4c.decode(stored[: len(stored) // 2], len(raw), 2)
    with pytest.raises(CorruptPayload, match="does not decode"):
        lz4c.decode(stored, len(raw) - 2, 2)
    with pytest.raises(CorruptPayload, match=f"decodes to {len(raw)} bytes, not {len(raw) + 2}"):
        lz4c.decode(stored, len(raw) + 2, 2)
    with pytest.raises(CorruptPayload, match="not a positive multiple of itemsize 2"):
        lz4c.decode(stored, len(raw) + 1, 2)
    with pytest.raises(CorruptPayload, match="not a positive multiple"):
        lz4c.decode(stored, 0, 2)
    assert bytes(lz4c.decode(stored, len(raw), 2)) == raw


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=2048))
def test_lz4_decode_of_arbitrary_bytes_is_exact_or_corrupt(stored: bytes, raw_nbytes: int) -> None:
    try:
        out = CODECS["lz4"].decode(stored, raw_nbytes, 1)
    except CorruptPayload:
        return
    assert len(out) == raw_nbytes


# ---- registry -----------------------------------------------------------------------------------


def test_registry_holds_none_and_lz4_by_name() -> None:
    assert sorted(CODECS) == ["lz4", "none"]
    assert all(codec.name == name for name, codec in CODECS.items())
    assert isinstance(get_codec("none"), NoneCodec)
    assert isinstance(get_codec("lz4"), Lz4Codec)


def test_unknown_codec_names_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown codec 'zstd', expected one of \['lz4', 'none'\]"
    ):
        get_codec("zstd")
