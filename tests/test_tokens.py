"""encode_tokens: one canonical key for every input kind, and errors that name the bad value."""

from __future__ import annotations

import re
from typing import Any, Literal

import numpy as np
import pytest
import torch

from kvtier.blocks import TOKEN_NBYTES, encode_tokens, token_array
from kvtier.errors import InvalidTokensError

VALUES = [0, 1, 100, 127]
"""Token ids that every integer dtype (int8 included) can hold."""

CANONICAL = b"".join(v.to_bytes(TOKEN_NBYTES, "little") for v in VALUES)

NP_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
TORCH_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def test_canonical_bytes_are_little_endian_uint32() -> None:
    assert encode_tokens([1, 256]) == bytes([1, 0, 0, 0, 0, 1, 0, 0])
    assert encode_tokens([2**32 - 1]) == b"\xff\xff\xff\xff"
    assert encode_tokens([0x01020304]) == bytes([4, 3, 2, 1])
    assert len(encode_tokens(list(range(7)))) == 7 * TOKEN_NBYTES


def test_list_and_tuple_give_the_canonical_bytes() -> None:
    assert encode_tokens(VALUES) == CANONICAL
    assert encode_tokens(tuple(VALUES)) == CANONICAL


def test_numpy_integer_items_in_a_list_are_accepted() -> None:
    items: list[Any] = [np.int64(v) for v in VALUES]
    assert encode_tokens(items) == CANONICAL


@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_numpy_integer_dtype_gives_the_same_bytes(dtype: Any) -> None:
    assert encode_tokens(np.array(VALUES, dtype=dtype)) == CANONICAL


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_integer_dtype_gives_the_same_bytes(dtype: torch.dtype) -> None:
    assert encode_tokens(torch.tensor(VALUES, dtype=dtype)) == CANONICAL


def test_big_endian_and_strided_arrays_give_values_not_raw_memory() -> None:
    assert encode_tokens(np.array([1, 256], dtype=">u4")) == bytes([1, 0, 0, 0, 0, 1, 0, 0])
    assert encode_tokens(np.array([1, 256], dtype=">i8")) == bytes([1, 0, 0, 0, 0, 1, 0, 0])
    assert encode_tokens(np.arange(10)[::3]) == encode_tokens([0, 3, 6, 9])
    assert encode_tokens(torch.arange(10)[::3]) == encode_tokens([0, 3, 6, 9])


def test_largest_token_id_passes_from_every_wide_kind() -> None:
    top = b"\xff\xff\xff\xff"
    assert encode_tokens(np.array([2**32 - 1], dtype=np.int64)) == top
    assert encode_tokens(np.array([2**32 - 1], dtype=np.uint64)) == top
    assert encode_tokens(torch.tensor([2**32 - 1], dtype=torch.int64)) == top


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([5, -1], "tokens[1]: got -1, expected a token id in [0, 2**32)"),
        ((7, 8, 2**32), "tokens[2]: got 4294967296, expected a token id in [0, 2**32)"),
        ([2**64], "tokens[0]: got 18446744073709551616, expected a token id in [0, 2**32)"),
        ([np.int64(-3)], "tokens[0]: got -3, expected a token id in [0, 2**32)"),
        ([1, 2.0], "tokens[1]: got 2.0 (float), expected an int"),
        ([1, "2"], "tokens[1]: got '2' (str), expected an int"),
        ([None], "tokens[0]: got None (NoneType), expected an int"),
        ([[1, 2]], "tokens[0]: got [1, 2] (list), expected an int"),
        ([1, 2.0, -1], "tokens[1]: got 2.0 (float), expected an int"),
        ([], "tokens: got an empty sequence, expected at least one token"),
        ((), "tokens: got an empty sequence, expected at least one token"),
    ],
    ids=lambda x: repr(x)[:30],
)
def test_bad_sequence_names_the_position_and_value(tokens: Any, message: str) -> None:
    with pytest.raises(InvalidTokensError, match=re.escape(message) + "$"):
        encode_tokens(tokens)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (np.array([3, -5], dtype=np.int8), "tokens[1]: got -5, expected a token id in [0, 2**32)"),
        (np.array([-1], dtype=np.int64), "tokens[0]: got -1, expected a token id in [0, 2**32)"),
        (
            np.array([1, 2, 2**32], dtype=np.int64),
            "tokens[2]: got 4294967296, expected a token id in [0, 2**32)",
        ),
        (
            np.array([2**40], dtype=np.uint64),
            "tokens[0]: got 1099511627776, expected a token id in [0, 2**32)",
        ),
        (torch.tensor([3, -2]), "tokens[1]: got -2, expected a token id in [0, 2**32)"),
        (
            torch.tensor([0, 2**32], dtype=torch.int64),
            "tokens[1]: got 4294967296, expected a token id in [0, 2**32)",
        ),
        (np.array([1.0, 2.0]), "tokens: got an array of float64, expected integers"),
        (np.array([True]), "tokens: got an array of bool, expected integers"),
        (np.array([1, 2], dtype=object), "tokens: got an array of object, expected integers"),
        (torch.tensor([1.0]), "tokens: got a tensor of torch.float32, expected integers"),
        (torch.tensor([1, 2], dtype=torch.bfloat16), "got a tensor of torch.bfloat16"),
        (torch.tensor([True, False]), "tokens: got a tensor of torch.bool, expected integers"),
        (torch.tensor([1j]), "tokens: got a tensor of torch.complex64, expected integers"),
        (np.zeros((2, 2), dtype=np.int64), "tokens: got an array of shape (2, 2), expected 1-D"),
        (np.array(5), "tokens: got an array of shape (), expected 1-D"),
        (
            torch.zeros((2, 3), dtype=torch.int64),
            "tokens: got a tensor of shape (2, 3), expected a 1-D tensor",
        ),
        (np.array([], dtype=np.int64), "tokens: got an empty array, expected at least one token"),
        (
            torch.tensor([], dtype=torch.int32),
            "tokens: got an empty array, expected at least one token",
        ),
    ],
    ids=lambda x: repr(x)[:30],
)
def test_bad_array_or_tensor_names_the_value_dtype_or_shape(tokens: Any, message: str) -> None:
    with pytest.raises(InvalidTokensError, match=re.escape(message)):
        encode_tokens(tokens)


@pytest.mark.parametrize(
    ("tokens", "kind"),
    [("abc", "str"), (b"ab", "bytes"), ({1: 2}, "dict"), (None, "NoneType"), (range(3), "range")],
)
def test_other_types_are_refused_by_name(tokens: Any, kind: str) -> None:
    expected = f"tokens: got {kind}, expected a list, tuple, ndarray or tensor of ints"
    with pytest.raises(InvalidTokensError, match=re.escape(expected)):
        encode_tokens(tokens)


def test_invalid_tokens_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        encode_tokens([-1])


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("order", ["<", ">"])
def test_signed_arrays_are_checked_at_both_ends_in_either_byte_order(
    dtype: Any, order: str
) -> None:
    kind = np.dtype(dtype).newbyteorder(order)
    top = min(int(np.iinfo(dtype).max), 2**32 - 1)
    assert encode_tokens(np.array([0, top], dtype=kind)) == encode_tokens([0, top])
    lowest = int(np.iinfo(dtype).min)
    with pytest.raises(InvalidTokensError, match=re.escape(f"tokens[1]: got {lowest}, expected")):
        encode_tokens(np.array([0, lowest], dtype=kind))
    with pytest.raises(InvalidTokensError, match=re.escape("tokens[0]: got -1, expected")):
        encode_tokens(torch.from_numpy(np.array([-1, 5], dtype=dtype)))


@pytest.mark.parametrize("order", ["<", ">"])
def test_wide_unsigned_arrays_stop_at_2_to_the_32(order: Literal["<", ">"]) -> None:
    kind = np.dtype(np.uint64).newbyteorder(order)
    assert encode_tokens(np.array([2**32 - 1], dtype=kind)) == b"\xff\xff\xff\xff"
    with pytest.raises(InvalidTokensError, match=re.escape("tokens[1]: got 4294967296")):
        encode_tokens(np.array([7, 2**32], dtype=kind))


@pytest.mark.parametrize(
    "tokens",
    [VALUES, tuple(VALUES), np.array(VALUES, dtype=">i8"), torch.tensor(VALUES, dtype=torch.int16)],
    ids=("list", "tuple", "big-endian", "tensor"),
)
def test_token_array_packs_once_and_encodes_again_to_the_same_bytes(tokens: Any) -> None:
    """What the clients pack once and hand on (`Client.store`: the pools' check, the
    reservation and the body): the canonical bytes, unchanged however often encoded again."""
    packed = token_array(tokens)
    assert packed.dtype == np.dtype("<u4") and not packed.flags.writeable
    assert packed.tobytes() == CANONICAL
    assert encode_tokens(packed) == encode_tokens(token_array(packed)) == CANONICAL


def test_token_array_refuses_what_encode_tokens_refuses() -> None:
    with pytest.raises(InvalidTokensError, match=re.escape("tokens[1]: got -2, expected")):
        token_array([1, -2])
