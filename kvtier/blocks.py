"""What a block is: the geometry of its KV, the KV tensors at the public API, and its name.

The geometry of one model's KV cache, and what follows from it: a block holds the keys and values of
`block_tokens` consecutive tokens for every layer, stored block-major and contiguous so that one
block moves between tiers as one copy:

    block = [num_layers, 2, block_tokens, num_kv_heads, head_dim]      (2 = K | V)
    pool  = [num_slots, num_layers, 2, block_tokens, num_kv_heads, head_dim]
    block_bytes = num_layers * 2 * block_tokens * num_kv_heads * head_dim * itemsize

`KVLayout` is frozen; `fingerprint` names the model and the geometry, and seeds every block id
(see the block ids below), so blocks of another model or layout can never be confused with ours.

KV tensors at the public API, validated, and cut into blocks or joined back: the engine hands KV
over as `[num_layers, 2, num_tokens, num_kv_heads, head_dim]` (K at 0, V at 1), tiers hold blocks:

    kv [L, 2, n*bt, H, D]  --to_blocks (a view)-->  [n, L, 2, bt, H, D]
    [n, L, 2, bt, H, D]    --from_blocks (a copy)-> kv [L, 2, n*bt, H, D], contiguous

Token ids in, canonical bytes out: the index keys blocks by the bytes of their token ids as
little-endian uint32, so that the same tokens give the same key (and the same block id) whether they
arrive as a Python list, a NumPy array or a torch tensor of any integer dtype. `encode_tokens` is on
every hot path, so each input kind takes its cheapest route: arrays are range-checked and cast in C;
a list is packed by `struct` in one call, which also rejects negatives, values of 2**32 or more and
non-integers without a Python loop. Bools are refused in every kind (a bool array, tensor, list item
or tensor item: `True` is no token id), a list's by one pass over its types in C.

Chained, collision-resistant block ids:
    seed    = H("kvtier-ns/v1" || layout fingerprint || tenant salt)
    id_0    = H(seed    || tokens of block 0)
    id_i    = H(id_{i-1} || tokens of block i)

Tokens enter the hash as little-endian uint32 (`encode_tokens` above), so an id depends only on the
token values, never on the dtype they arrived in. An id names the whole prefix up to its block: two
blocks share an id only when everything before them is the same, under the same model geometry and
the same tenant. `H` is BLAKE2b-128 by default (never Python's `hash()`), so ids are stable across
processes and machines and safe as keys on disk and in events. The tenant salt is derived here
from the tenant id and an optional server secret (a keyed BLAKE2b); callers never supply one.

Ids that a client sees (leases, reservations) are random, so that they tell nothing: an id drawn
from a shared counter counts the calls of every other client between two of one's own, and a small
id is easy to guess (issue 11, point 4). Every such id is instead 63 random bits from `secrets` (it
fits a signed 64-bit integer, so msgpack, JSON and SQL all carry it intact), never 0 (0 means "none"
in `Reservation`), and unique among the ids live in its table. Guessing a live id of another client
takes about 2**63 / (live ids) tries.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, NewType, Protocol

import numpy as np
import torch

from kvtier.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidKVError,
    InvalidTokensError,
    shown,
)

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one model's KV cache. Validated on construction; immutable."""

    model_name: str
    num_layers: int
    num_kv_heads: int  # of one tensor-parallel rank
    head_dim: int
    dtype_name: str
    block_tokens: int
    tp_rank: int = 0  # the tensor-parallel shard these heads are (an engine's rank)
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(name, value, "a positive integer")
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError("tp_rank", self.tp_rank, f"a rank in [0, tp_size = {self.tp_size})")
        if self.dtype_name not in DTYPES:
            raise ConfigError("dtype", self.dtype_name, f"one of {sorted(DTYPES)}")
        if not self.model_name:
            raise ConfigError("name", self.model_name, "a non-empty model name")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: `[num_layers, 2, block_tokens, num_kv_heads, head_dim]`."""
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        layers, kv, tokens, heads, dim = self.block_shape
        return layers * kv * tokens * heads * dim * self.itemsize

    def pool_shape(self, num_slots: int) -> tuple[int, int, int, int, int, int]:
        return (num_slots, *self.block_shape)

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes naming the model and every field that changes the bytes of a block
        (computed once: every disk copy written or read compares it). A tensor-parallel
        shard (tp_size > 1) is named too: ranks hold other heads under the same tokens. The
        text of an unsharded layout is what it was before shards were named."""
        text = (
            f"kvtier-layout/v1|{self.model_name}|{self.num_layers}|{self.num_kv_heads}|"
            f"{self.head_dim}|{self.dtype_name}|{self.block_tokens}"
        )
        if self.tp_size > 1:
            text += f"|tp{self.tp_rank}/{self.tp_size}"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


def check_kv(layout: KVLayout, kv: object, num_tokens: int) -> None:
    """`InvalidKVError` unless `kv` is a tensor of the layout's dtype and shape for
    `num_tokens` tokens."""
    want = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    if not isinstance(kv, torch.Tensor):
        raise InvalidKVError(f"kv: got {type(kv).__name__}, expected a torch.Tensor")
    if kv.dtype != layout.dtype:
        raise InvalidKVError(f"kv: got dtype {kv.dtype}, expected {layout.dtype}")
    if tuple(kv.shape) != want:
        raise InvalidKVError(
            f"kv: got shape {tuple(kv.shape)}, expected {want} "
            "= [num_layers, 2, len(tokens), num_kv_heads, head_dim]"
        )


def check_start(start: object, num_tokens: int, block_tokens: int) -> int:
    """The first block a KV that begins at token `start` holds: `start` must be an int, a
    multiple of `block_tokens` in [0, num_tokens], else `InvalidArgumentError` naming it."""
    if type(start) is not int or not 0 <= start <= num_tokens or start % block_tokens:
        kind = "" if type(start) is int else f" ({type(start).__name__}, not int)"  # np.int64
        raise InvalidArgumentError(
            f"start: got {shown(start)}{kind}, expected an int, a multiple of block_tokens "
            f"({block_tokens}), in [0, {num_tokens}]"
        )
    return start // block_tokens


def check_device(device: torch.device | str | None) -> torch.device | None:
    """The device that a `device=` argument names, or `InvalidArgumentError`."""
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        target = None
    got = f"device: got {shown(device)}"
    if target is None or target.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{got}, expected 'cpu', 'cuda' or 'cuda:N'")
    if target.type == "cuda" and (target.index or 0) >= (count := torch.cuda.device_count()):
        raise InvalidArgumentError(f"{got}, but this machine has {count} CUDA devices")
    return target


def to_blocks(kv: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """`[L, 2, n*bt, H, D]` -> a `[n, L, 2, bt, H, D]` view (no copy)."""
    return blocks_of(kv, block_tokens, 0, kv.shape[2] // block_tokens)


def blocks_of(kv: torch.Tensor, block_tokens: int, first: int, count: int) -> torch.Tensor:
    """Blocks `first .. first + count - 1` of `kv` `[L, 2, tokens, H, D]`, as a
    `[count, L, 2, bt, H, D]` view (no copy), whatever `kv`'s strides: one `as_strided`, where
    a slice, a reshape and a permute cost three torch calls on the store's path."""
    layers, two, tokens, heads, dim = kv.shape
    assert first >= 0 and (first + count) * block_tokens <= tokens, "blocks past the end of kv"
    s_layer, s_kv, s_token, s_head, s_dim = kv.stride()
    return kv.as_strided(
        (count, layers, two, block_tokens, heads, dim),
        (s_token * block_tokens, s_layer, s_kv, s_token, s_head, s_dim),
        kv.storage_offset() + first * block_tokens * s_token,
    )


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, L, 2, bt, H, D]` -> a contiguous `[L, 2, n*bt, H, D]`."""
    n, layers, two, bt, heads, dim = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, two, n * bt, heads, dim)


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
        if tokens.is_nested or tokens.is_meta or tokens.layout != torch.strided:
            form = f"{'nested' if tokens.is_nested else tokens.layout} tensor on {tokens.device}"
            raise InvalidTokensError(f"tokens: got a {form}, expected a dense tensor with data")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidTokensError(f"tokens: got a tensor of {tokens.dtype}, expected integers")
        if tokens.ndim != 1:
            raise InvalidTokensError(
                f"tokens: got a tensor of shape {tuple(tokens.shape)}, expected a 1-D tensor"
            )
        # an integer tensor never requires grad, so a CPU one goes to NumPy without a copy
        return _encode_array(tokens.cpu().numpy())
    if isinstance(tokens, np.ndarray):
        return _encode_array(tokens)
    raise InvalidTokensError(
        f"tokens: got {type(tokens).__name__}, expected a list, tuple, ndarray or tensor of ints"
    )


def token_array(tokens: Tokens) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """`tokens` checked and packed once (`encode_tokens`), as a read-only little-endian uint32
    array over the packed bytes: encoding it again copies its bytes, where a list of ints is
    checked and packed int by int again (15 us for 2000 tokens, against 1.1 us)."""
    return np.frombuffer(encode_tokens(tokens), _LE_U32)


def _encode_array(array: np.ndarray[Any, Any]) -> bytes:
    if array.ndim != 1:
        raise InvalidTokensError(f"tokens: got an array of shape {array.shape}, expected 1-D")
    kind = array.dtype.kind
    if kind not in "iu":
        raise InvalidTokensError(f"tokens: got an array of {array.dtype}, expected integers")
    if len(array) == 0:
        raise InvalidTokensError("tokens: got an empty array, expected at least one token")
    size = array.dtype.itemsize
    if kind == "i" or size > TOKEN_NBYTES:
        # Read as unsigned of the same size and byte order, a negative id is at least
        # 2**(8 * size - 1): one max() checks both ends without a temporary array.
        limit = 2**32 if size > TOKEN_NBYTES else 2 ** (8 * size - 1)
        if int(array.view(_unsigned(array.dtype)).max()) >= limit:
            _raise_out_of_range(array.tolist())
    return array.astype(_LE_U32, copy=False).tobytes()


@lru_cache(maxsize=32)
def _unsigned(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The unsigned integer dtype of `dtype`'s size and byte order (made once: building a dtype
    from its string cost a third of encoding a short prompt)."""
    return np.dtype(dtype.str.replace("i", "u"))


def _encode_sequence(tokens: Sequence[int]) -> bytes:
    if not tokens:
        raise InvalidTokensError("tokens: got an empty sequence, expected at least one token")
    try:  # struct packs what has __index__, and lets its TypeError by (a float tensor's) ...
        packed = _packer(len(tokens)).pack(*tokens)
    except (struct.error, TypeError, RuntimeError):
        packed = b""
    # ... and packs a bool, or a tensor of one, as 0 or 1: refused, as a bool array is
    if packed and not any(t is bool or issubclass(t, torch.Tensor) for t in set(map(type, tokens))):
        return packed
    for position, value in enumerate(tokens):
        if not _is_token_int(value):
            raise InvalidTokensError(
                f"tokens[{position}]: got {shown(value)} ({type(value).__name__}), expected an int"
            ) from None
    _raise_out_of_range([int(value) for value in tokens])
    assert packed, "struct refused tokens that look valid"
    return packed  # 0-d integer tensors (a `list(tensor)`)


def _is_token_int(value: object) -> bool:
    """An int (not a bool), a NumPy integer, or a 0-d integer tensor with data."""
    if isinstance(value, torch.Tensor):
        kind = value.dtype
        return value.ndim == 0 and not value.is_meta and not kind.is_floating_point and (
            not kind.is_complex and kind != torch.bool)  # fmt: skip
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _raise_out_of_range(values: list[int]) -> None:
    for position, value in enumerate(values):
        if not 0 <= value < 2**32:
            raise InvalidTokensError(
                f"tokens[{position}]: got {shown(int(value))}, expected a token id in [0, 2**32)"
            )


BlockId = NewType("BlockId", bytes)
"""A block id: `digest_size` bytes naming a whole prefix of blocks."""


class _Hash(Protocol):
    def update(self, data: bytes, /) -> None: ...
    def digest(self) -> bytes: ...
    def copy(self) -> _Hash: ...


_NewHash = Callable[[], _Hash]

ALGORITHMS: dict[str, tuple[int, _NewHash]] = {
    "blake2b-128": (16, lambda: hashlib.blake2b(digest_size=16)),
    "blake2b-256": (32, lambda: hashlib.blake2b(digest_size=32)),
    "sha256": (32, hashlib.sha256),
}
"""name -> (digest size, a fresh hash object). `chain` copies one fresh object per block, which
is a third faster than constructing a new one with its parameters each time."""


def tenant_salt(tenant_id: str, secret: bytes = b"") -> bytes:
    """16-byte salt of a tenant: BLAKE2b keyed by the server secret (empty key when none). A
    secret longer than BLAKE2b's 64-byte key is keyed by its BLAKE2b-512 digest, so that every
    byte of it counts (two secrets that differ only past byte 64 give different salts); one of
    at most 64 bytes is the key itself, as it always was (ids made with it stay valid)."""
    if len(secret) > 64:
        secret = hashlib.blake2b(secret, digest_size=64, person=b"kvtier-secret").digest()
    return hashlib.blake2b(tenant_id.encode(), key=secret, digest_size=16).digest()


@dataclass(frozen=True)
class BlockHasher:
    """Computes block ids with one algorithm from `ALGORITHMS`."""

    algorithm: str = "blake2b-128"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError("hashing.algorithm", self.algorithm, f"one of {sorted(ALGORITHMS)}")

    @property
    def digest_size(self) -> int:
        return ALGORITHMS[self.algorithm][0]

    def seed(self, layout_fingerprint: bytes, salt: bytes) -> BlockId:
        """The id before the first block: the namespace of one model geometry and one tenant."""
        h = ALGORITHMS[self.algorithm][1]()
        h.update(b"kvtier-ns/v1" + layout_fingerprint + salt)
        return BlockId(h.digest())

    def chain(self, parent: bytes, token_bytes: bytes, block_nbytes: int) -> bytes:
        """Ids of the consecutive blocks in `token_bytes`, concatenated, chained from `parent`.

        `token_bytes` holds whole blocks of `block_nbytes` bytes; the result holds
        `len(token_bytes) // block_nbytes` ids of `digest_size` bytes each.
        """
        assert len(token_bytes) % block_nbytes == 0, "chain() takes whole blocks"
        # The loop is inherently one hash per block; around it, NumPy cuts the blocks in one
        # C call (a void dtype keeps every byte) and the methods are looked up once.
        blocks = np.frombuffer(token_bytes, np.dtype((np.void, block_nbytes))).tolist()
        fresh = ALGORITHMS[self.algorithm][1]().copy
        out: list[bytes] = []
        append = out.append
        prev = parent
        for block in blocks:
            h = fresh()
            h.update(prev)
            h.update(block)
            prev = h.digest()
            append(prev)
        return b"".join(out)

    def split(self, ids: bytes) -> list[BlockId]:
        """Cut concatenated ids into a list of `BlockId`s."""
        size = self.digest_size
        return [BlockId(ids[i : i + size]) for i in range(0, len(ids), size)]


ID_BITS = 63


def fresh_id(taken: Container[int]) -> int:
    """A random id in [1, 2**63) that is not in `taken` (the ids live now)."""
    while True:
        candidate = secrets.randbits(ID_BITS)
        if candidate and candidate not in taken:
            return candidate
