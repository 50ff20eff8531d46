"""The content keys of the router's index (`index.py`, "Keys"): a block's key chains the
previous block's key with the block's tokens (BLAKE2b, 8 bytes), the first block's from a seed
of the LoRA name; what one source (a topic) maps to them (`Source`, its media bits: `bit`);
and the pod a topic speaks for."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.blocks import TOKEN_NBYTES
from kvtier.routing.reading import BadEvent

KEY_BYTES = 8
MAX_MEDIA = 16  # distinct medium names a source may name; an event naming another is skipped
MAX_WEIGHTS = 1024  # media masks a source keeps the weight of (`weight`): bounded memory


@dataclass
class Source:
    """One topic's blocks in the router's index (`index.py`, Invariants)."""

    pod: str
    tenant: str | None  # the topic's fourth field, if any (`index.py`)
    keys: dict[Any, bytes] = field(default_factory=dict)  # the source's hash -> key
    masks: dict[Any, int] = field(default_factory=dict)  # the source's hash -> media bitmask
    held: dict[bytes, int] = field(default_factory=dict)  # key -> its hashes' media, together
    hashes: dict[bytes, tuple[Any, ...]] = field(default_factory=dict)  # key -> its hashes
    media: dict[str, int] = field(default_factory=dict)  # medium name -> bit, its own
    weight_of: dict[int, float] = field(default_factory=lambda: {0: 0.0})  # mask -> best weight

    def take(self, other: Source) -> None:
        """Hold what `other` (of the same topic, built apart: `PrefixIndex.reset`) holds."""
        self.keys, self.masks, self.held, self.hashes = (
            other.keys,
            other.masks,
            other.held,
            other.hashes,
        )
        self.media, self.weight_of = other.media, other.weight_of

    def check(self) -> None:
        """Assert the source's own invariants (`index.py`, Invariants)."""
        assert set(self.keys.values()) == set(self.held) == set(self.hashes), self.pod
        assert set(self.masks) == set(self.keys) and all(self.masks.values()), self.pod
        for key, hashes in self.hashes.items():
            assert hashes and all(self.keys[h] == key for h in hashes), self.pod
            union = 0
            for h in hashes:
                union |= self.masks[h]
            assert union == self.held[key], f"{self.pod}: a key's media are not its hashes'"
        assert sum(map(len, self.hashes.values())) == len(self.keys), self.pod


def weight(src: Source, mask: int, weights: Mapping[str, float]) -> float:
    """The best of `weights` of the media of `mask` in `src`'s table, kept (`MAX_WEIGHTS`)."""
    found = src.weight_of.get(mask)
    if found is None:
        held = [medium for medium, bit in src.media.items() if mask & bit]
        # a medium without a weight counts as GPU does (as llm-d weighs one)
        found = max((weights.get(medium, 1.0) for medium in held), default=0.0)
        if len(src.weight_of) < MAX_WEIGHTS:  # 16 media make 65,536 masks: kept bounded
            src.weight_of[mask] = found
    return found


def bit(src: Source, medium: str) -> int:
    """The bit of `medium` in `src`'s own table (a source cannot use up another's); `BadEvent`
    past `MAX_MEDIA`."""
    found = src.media.get(medium)
    if found is None:
        if len(src.media) >= MAX_MEDIA:
            raise BadEvent(f"medium: {medium!r} past the {MAX_MEDIA} media a source may name")
        found = src.media[medium] = 1 << len(src.media)
    return found


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
