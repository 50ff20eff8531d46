"""The msgpack bytes of KV events, built without a Python object per token, and the specs a
store queues for the publisher's thread to pack (`Stored`, `Removed`: the store's lock is held
while it tells of events, so the packing is left to the thread).

A store tells of a new run of blocks once per tier it wrote them to, each event holding every
token of the run: packed the usual way (a list of ints for `msgpack.packb`) that is a Python
int per token, twice per event. Here the arrays are written by numpy in one pass: each token as
msgpack's uint 32 (0xce and 4 big-endian bytes), each hash as uint 64 (0xcf and 8 bytes). Any
msgpack decoder reads them (a shortest form is not required of an encoder); the scalars, strings
and nil are `msgpack.packb`'s. `tests/test_events.py` decodes them with `msgpack.unpackb`.
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack  # type: ignore[import-untyped]
import numpy as np

NIL = b"\xc0"
CLEARED: bytes = msgpack.packb(["AllBlocksCleared"])
_STORED: bytes = msgpack.packb("BlockStored")
_REMOVED: bytes = msgpack.packb("BlockRemoved")


def array_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


_UINT64 = np.dtype([("tag", "u1"), ("value", ">u8")])  # msgpack's uint 64, packed: 9 bytes
_UINT32 = np.dtype([("tag", "u1"), ("value", ">u4")])  # uint 32: 5 bytes


def uint64s(be_bytes: bytes) -> bytes:
    """A msgpack array of the big-endian uint64s in `be_bytes`."""
    out = np.empty(len(be_bytes) >> 3, _UINT64)
    out["tag"] = 0xCF
    out["value"] = np.frombuffer(be_bytes, ">u8")
    return array_header(len(out)) + out.tobytes()


def uint32s(le_bytes: bytes) -> bytes:
    """A msgpack array of the little-endian uint32s in `le_bytes` (the index's key bytes)."""
    out = np.empty(len(le_bytes) >> 2, _UINT32)
    out["tag"] = 0xCE
    out["value"] = np.frombuffer(le_bytes, "<u4")  # swapped to big-endian as it is copied
    return array_header(len(out)) + out.tobytes()


def stored_body(hashes: bytes, parent: int | None, tokens: bytes, block_size: int) -> bytes:
    """A BlockStored's fields up to its medium: `hashes` big-endian uint64s, `tokens`
    little-endian uint32s."""
    return b"".join(
        (
            b"\x98",  # an array of 8 fields
            _STORED,
            uint64s(hashes),
            NIL if parent is None else b"\xcf" + parent.to_bytes(8, "big"),
            uint32s(tokens),
            msgpack.packb(block_size),
            NIL,  # lora_id
        )
    )


_MEDIA: dict[str, bytes] = {}  # medium -> its msgpack string


def _medium(medium: str) -> bytes:
    packed = _MEDIA.get(medium)
    if packed is None:
        packed = _MEDIA[medium] = bytes(msgpack.packb(medium))
    return packed


def stored(body: bytes, medium: str) -> bytes:
    """The BlockStored of `stored_body` in `medium` (no LoRA name)."""
    return body + _medium(medium) + NIL


def removed(hashes: bytes, medium: str) -> bytes:
    """A BlockRemoved of the big-endian uint64s in `hashes` (one, most often: eviction takes
    a block at a time)."""
    packed = b"\x91\xcf" + hashes if len(hashes) == 8 else uint64s(hashes)
    return b"\x93" + _REMOVED + packed + _medium(medium)


def batch(ts: float, events: list[bytes], dp_rank: int | None) -> bytes:
    """An event batch `[ts, [events], dp_rank]` of events already packed."""
    head: bytes = msgpack.packb(float(ts))
    tail: bytes = msgpack.packb(dp_rank)
    return b"\x93" + head + array_header(len(events)) + b"".join(events) + tail


class Blocks(NamedTuple):
    """A BlockStored's fields up to its medium: `hashes` big-endian uint64s, `tokens`
    little-endian uint32s (`stored_body`)."""

    hashes: bytes
    parent: int | None
    tokens: bytes
    block_size: int


class Stored(NamedTuple):
    blocks: Blocks
    medium: str


class Removed(NamedTuple):
    hashes: bytes  # big-endian uint64s
    medium: str


Spec = Stored | Removed | bytes  # bytes: an event packed already


class Packer:
    """Packs specs; a `Blocks` told of again (the same object: one store writing to two
    tiers) reuses its packed fields."""

    def __init__(self) -> None:
        self._last: tuple[Blocks, bytes] | None = None

    def pack(self, spec: Spec) -> bytes:
        if isinstance(spec, Stored):
            if self._last is None or self._last[0] is not spec.blocks:
                self._last = (spec.blocks, stored_body(*spec.blocks))
            return stored(self._last[1], spec.medium)
        if isinstance(spec, Removed):
            return removed(spec.hashes, spec.medium)
        return spec
