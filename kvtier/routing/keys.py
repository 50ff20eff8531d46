"""The content keys of the router's index (`index.py`, "Keys"): a block's key chains the
previous block's key with the block's tokens (BLAKE2b, 8 bytes), the first block's from a seed
of the LoRA name; and the pod a topic speaks for."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from kvtier.blocks import TOKEN_NBYTES

KEY_BYTES = 8


def chain(previous: bytes, data: bytes, block_size: int) -> Iterator[bytes]:
    """The keys of the full blocks of `data` (token ids as `encode_tokens` packs them: uint32
    little-endian), chained from `previous`, one at a time: `score` stops hashing at the first
    block no pod holds."""
    step = block_size * TOKEN_NBYTES
    for start in range(0, len(data) - step + 1, step):
        previous = hashlib.blake2b(previous + data[start : start + step], digest_size=8).digest()
        yield previous


def seed(lora_name: str | None) -> bytes:
    """The key the first block of a prompt chains from."""
    name = b"" if lora_name is None else lora_name.encode()
    return hashlib.blake2b(name, digest_size=KEY_BYTES, person=b"kvtier-route").digest()


def pod_of(topic: str) -> str:
    """The pod a topic speaks for: its second field (`kv@<pod>@<model>[@<tenant>]`), or the
    whole topic when it has none."""
    parts = topic.split("@")
    return parts[1] if len(parts) > 1 else topic
