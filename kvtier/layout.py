"""The geometry of one model's KV cache, and what follows from it.

A block holds the keys and values of `block_tokens` consecutive tokens for every layer, stored
block-major and contiguous so that one block moves between tiers as one copy:

    block = [num_layers, 2, block_tokens, num_kv_heads, head_dim]      (2 = K | V)
    pool  = [num_slots, num_layers, 2, block_tokens, num_kv_heads, head_dim]

    block_bytes = num_layers * 2 * block_tokens * num_kv_heads * head_dim * itemsize

`KVLayout` is frozen; `fingerprint` names the model and the geometry, and seeds every block id
(see `hashing.py`), so blocks of another model or layout can never be confused with ours.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError

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
    num_kv_heads: int
    head_dim: int
    dtype_name: str
    block_tokens: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(name, value, "a positive integer")
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

    @property
    def fingerprint(self) -> bytes:
        """16 bytes naming the model and every field that changes the bytes of a block."""
        text = (
            f"kvtier-layout/v1|{self.model_name}|{self.num_layers}|{self.num_kv_heads}|"
            f"{self.head_dim}|{self.dtype_name}|{self.block_tokens}"
        )
        return hashlib.blake2b(text.encode(), digest_size=16).digest()
