"""Token ids in, canonical bytes out.

The index keys blocks by the bytes of their token ids as little-endian uint32, so that the same
tokens give the same key (and the same block id) whether they arrive as a Python list, a NumPy
array or a torch tensor of any integer dtype. `encode_tokens` is on every hot path, so each input
kind takes its cheapest route: arrays are range-checked and cast in C; a list is packed by
`struct` in one call (about 11 us for 2000 ints here, half of building an array from it), which
also rejects negatives, values of 2**32 or more and non-integers without a Python loop.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidTokensError

TOKEN_NBYTES = 4
"""Bytes per token id in keys and hashes (uint32, little-endian)."""

Tokens = Sequence[int] | np.ndarray[Any, Any] | torch.Tensor
"""What public methods accept as token ids: a 1-D sequence of ints in [0, 2**32)."""

_LE_U32 = np.dtype("<u4")


@lru_cache(maxsize=512)
def _packer(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}I")


def encode_tokens(tokens: Tokens) -> bytes:
    """Return the canonical key bytes of `tokens`; raise `InvalidTokensError` if they are bad."""
    if isinstance(tokens, (list, tuple)):
        return _encode_sequence(tokens)
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidTokensError(f"tokens: got a tensor of {tokens.dtype}, expected integers")
        if tokens.ndim != 1:
            raise InvalidTokensError(
                f"tokens: got a tensor of shape {tuple(tokens.shape)}, expected a 1-D tensor"
            )
        return _encode_array(tokens.detach().cpu().numpy())
    if isinstance(tokens, np.ndarray):
        return _encode_array(tokens)
    raise InvalidTokensError(
        f"tokens: got {type(tokens).__name__}, expected a list, tuple, ndarray or tensor of ints"
    )


def _encode_array(array: np.ndarray[Any, Any]) -> bytes:
    if array.ndim != 1:
        raise InvalidTokensError(f"tokens: got an array of shape {array.shape}, expected 1-D")
    kind = array.dtype.kind
    if kind not in "iu":
        raise InvalidTokensError(f"tokens: got an array of {array.dtype}, expected integers")
    if len(array) == 0:
        raise InvalidTokensError("tokens: got an empty array, expected at least one token")
    if (array.dtype.itemsize > TOKEN_NBYTES and (array >> 32).any()) or (
        kind == "i" and array.dtype.itemsize <= TOKEN_NBYTES and (array < 0).any()
    ):
        _raise_out_of_range(array.tolist())
    return array.astype(_LE_U32, copy=False).tobytes()


def _encode_sequence(tokens: Sequence[int]) -> bytes:
    if not tokens:
        raise InvalidTokensError("tokens: got an empty sequence, expected at least one token")
    try:
        return _packer(len(tokens)).pack(*tokens)
    except struct.error:
        pass
    for position, value in enumerate(tokens):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise InvalidTokensError(
                f"tokens[{position}]: got {value!r} ({type(value).__name__}), expected an int"
            ) from None
    _raise_out_of_range(list(tokens))
    raise AssertionError("unreachable: struct refused tokens that look valid")


def _raise_out_of_range(values: list[int]) -> None:
    for position, value in enumerate(values):
        if not 0 <= value < 2**32:
            raise InvalidTokensError(
                f"tokens[{position}]: got {value}, expected a token id in [0, 2**32)"
            )
