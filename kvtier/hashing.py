"""Chained, collision-resistant block ids.

    seed    = H("kvtier-ns/v1" || layout fingerprint || tenant salt)
    id_0    = H(seed    || tokens of block 0)
    id_i    = H(id_{i-1} || tokens of block i)

Tokens enter the hash as little-endian uint32 (`tokens.py`), so an id depends only on the
token values, never on the dtype they arrived in. An id names the whole prefix up to its block:
two blocks share an id only when everything before them is the same, under the same model
geometry and the same tenant. `H` is BLAKE2b-128 by default (never Python's `hash()`), so ids
are stable across processes and machines and safe as keys on disk and in events.

The tenant salt is derived here from the tenant id and an optional server secret (a keyed
BLAKE2b); callers never supply a salt of their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NewType, Protocol

from kvtier.errors import ConfigError

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
    """16-byte salt of a tenant: BLAKE2b keyed by the server secret (empty key when none)."""
    return hashlib.blake2b(tenant_id.encode(), key=secret[:64], digest_size=16).digest()


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
        fresh = ALGORITHMS[self.algorithm][1]()
        out = []
        prev = parent
        for start in range(0, len(token_bytes), block_nbytes):
            h = fresh.copy()
            h.update(prev)
            h.update(token_bytes[start : start + block_nbytes])
            prev = h.digest()
            out.append(prev)
        return b"".join(out)

    def split(self, ids: bytes) -> list[BlockId]:
        """Cut concatenated ids into a list of `BlockId`s."""
        size = self.digest_size
        return [BlockId(ids[i : i + size]) for i in range(0, len(ids), size)]
