"""The msgpack bytes of KV events, built without a Python object per token, and the specs a
store queues for the publisher's thread to pack (`told_stored`, `told_removed`: plain tuples of
numbers and references, what the index's observer can afford under the store's lock; `Stored`,
`Removed`: the same with their bytes, from the publisher's own calls and snapshots).

A store tells of a new run of blocks once per tier it wrote them to, each event holding every
token of the run: packed the usual way (a list of ints for `msgpack.packb`) that is a Python
int per token, twice per event. Here the arrays are written by numpy in one pass: each token as
msgpack's uint 32 (0xce and 4 big-endian bytes), each hash as uint 64 (0xcf and 8 bytes). Any
msgpack decoder reads them (a shortest form is not required of an encoder); the scalars, strings
and nil are `msgpack.packb`'s. `tests/test_events.py` decodes them with `msgpack.unpackb`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import msgpack  # type: ignore[import-untyped]
import numpy as np

NIL = b"\xc0"
TOKEN_BYTES = 4  # a token id on the wire's input: a little-endian uint32 (`encode_tokens`)
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


def stored_body(hashes: bytes, parent: int | None, tokens: bytes, block_size: int) -> bytes:
    """A BlockStored's fields up to its medium: `hashes` big-endian uint64s, `tokens`
    little-endian uint32s."""
    return stored_fields(
        len(hashes) >> 3, tagged_u64(hashes), parent, len(tokens) >> 2, tagged_tokens(tokens),
        block_size,
    )  # fmt: skip


def stored_fields(
    count: int, hashes: bytes, parent: int | None, num_tokens: int, tokens: bytes, bs: int
) -> bytes:
    """`stored_body` of `count` hashes and `num_tokens` tokens already tagged (`tagged_u64`,
    `tagged_tokens`, `tagged_numbers`)."""
    return b"".join(
        (
            b"\x98",  # an array of 8 fields
            _STORED,
            array_header(count),
            hashes,
            NIL if parent is None else b"\xcf" + parent.to_bytes(8, "big"),
            array_header(num_tokens),
            tokens,
            msgpack.packb(bs),
            NIL,  # lora_id
        )
    )


_MEDIA: dict[str, bytes] = {}  # medium -> its msgpack string


def medium_bytes(medium: str) -> bytes:
    """`medium` as msgpack packs it, kept."""
    packed = _MEDIA.get(medium)
    if packed is None:
        packed = _MEDIA[medium] = bytes(msgpack.packb(medium))
    return packed


def stored(body: bytes, medium: str) -> bytes:
    """The BlockStored of `stored_body` in `medium` (no LoRA name)."""
    return body + medium_bytes(medium) + NIL


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


TOLD_STORED, TOLD_REMOVED = 1, 2
"""Tags of the plain tuples the index's observer queues under the store's lock (`told_stored`,
`told_removed`): numbers, and a reference to the node's immutable key bytes, sliced and packed
on the publisher's thread (a NamedTuple alone costs 0.5 us to make on CPython 3.11)."""


def told_stored(
    key: bytes,
    kb: int,
    ev: int,
    lo: int,
    hi: int,
    parent: int | None,
    bs: int,
    tiers: tuple[int, ...],
    media: Sequence[str],
) -> tuple[Any, ...]:
    """A BlockStored in the medium of each of `tiers` (`media`: by tier, each `MEDIUM_ROOM`
    bytes at most once packed) of blocks lo..hi-1 of
    a node whose key is `key` (`kb` bytes a block) and whose block i has the hash `ev + i`,
    after the block whose hash is `parent` (None: the first block of a namespace). The observer
    builds this tuple inline; the function names its fields."""
    return (TOLD_STORED, key, kb, ev, lo, hi, parent, bs, tiers, media)


def told_removed(first: int, count: int, medium: str) -> tuple[Any, ...]:
    """A BlockRemoved in `medium` of the blocks whose hashes are first, first + 1, ..."""
    return (TOLD_REMOVED, first, count, medium)


def numbers(first: int, count: int) -> bytes:
    """The big-endian uint64s first, first + 1, ..., count of them."""
    if count == 1:
        return first.to_bytes(8, "big")
    return np.arange(first, first + count, dtype=np.uint64).astype(">u8").tobytes()


Spec = Stored | Removed | bytes | tuple[Any, ...]  # bytes: packed already; tuple: `told_*`


EVENT_OVERHEAD = 96
"""Bytes of a BlockStored or BlockRemoved besides its hashes, tokens and medium (at most: the
fixed fields at their longest)."""
MEDIUM_ROOM = 64
"""Bytes a medium of a `told_stored` takes at most, packed (a tier's: `IndexEvents.media`)."""


def blocks_per_event(max_bytes: int, block_size: int, medium: str) -> int:
    """The most blocks a BlockStored of `block_size`-token blocks in `medium` may hold in
    `max_bytes` (each block: a uint 64 hash, 9 bytes, and its tokens, 5 bytes each); at least
    one."""
    room = max_bytes - EVENT_OVERHEAD - len(medium_bytes(medium))
    return max(1, room // (9 + 5 * block_size))


class Packer:
    """Packs specs; a `Blocks` told of again (the same object: one store writing to two
    tiers) reuses its packed fields, and removals next to each other in one medium are packed
    as one BlockRemoved (`pack_all`). No event is longer than `max_event_bytes`: a run of blocks
    that would be is told as several events, each chained to the one before by its parent hash
    (a router applies them alike), so that a publisher can bound its messages."""

    def __init__(self, max_event_bytes: int = 1 << 62) -> None:
        self.max_event_bytes = max_event_bytes
        # a `told_stored` whose hashes and tokens take this many bytes at most fits one event
        self._quick = max_event_bytes - EVENT_OVERHEAD - MEDIUM_ROOM
        self._rooms: dict[str, int] = {}  # medium -> `removals_per_event`
        self._last: tuple[Blocks, list[bytes]] | None = None

    def pack(self, spec: Stored | bytes) -> list[bytes]:
        """The events of one `Stored` (one unless it is longer than `max_event_bytes`), or
        bytes packed already; `pack_all` for the rest."""
        if isinstance(spec, Stored):
            blocks = spec.blocks
            if self._last is None or self._last[0] is not blocks:
                per = blocks_per_event(self.max_event_bytes, blocks.block_size, spec.medium)
                self._last = (blocks, [stored_body(*part) for part in split_blocks(blocks, per)])
            return [stored(body, spec.medium) for body in self._last[1]]
        return [spec]

    def pack_all(self, specs: list[Spec]) -> list[bytes]:
        """The events of `specs`, in order: a `told_stored` of n tiers is n events (one body),
        and removals next to each other in one medium merge into one BlockRemoved (eviction
        tells of a run, or a block, at a time; a router applies the hashes alike), both cut
        where an event would pass `max_event_bytes`. The hashes and tokens of every `told_*`
        spec are packed in one NumPy pass for the whole batch: per event, NumPy's calls cost
        more than the bytes (5-7 us for a 63-block BlockStored)."""
        firsts: list[int] = []
        counts: list[int] = []
        keys: list[bytes] = []
        for spec in specs:
            if type(spec) is tuple:
                if spec[0] == TOLD_STORED:
                    _, key, kb, ev, lo, hi = spec[:6]
                    firsts.append(ev + lo)
                    counts.append(hi - lo)
                    keys.append(key[lo * kb : hi * kb])
                else:
                    firsts.append(spec[1])
                    counts.append(spec[2])
        hashes = tagged_numbers(firsts, counts)
        tokens = tagged_tokens(b"".join(keys)) if keys else b""
        at_hash = at_token = 0
        out: list[bytes] = []
        group: list[bytes] = []  # tagged hashes of the removals in a row, in `medium`
        size, medium, room = 0, "", 0  # room: hashes the group may still take
        for spec in specs:
            if type(spec) is tuple and spec[0] == TOLD_REMOVED:
                _, _, n, this = spec
                piece = hashes[at_hash : at_hash + n * 9]
                at_hash += n * 9
            elif isinstance(spec, Removed):
                n, this = len(spec.hashes) >> 3, spec.medium
                piece = tagged_u64(spec.hashes)
            else:
                if group:
                    out.append(removed_tagged(group, size, medium))
                    group, size = [], 0
                if isinstance(spec, (Stored, bytes)):
                    out.extend(self.pack(spec))
                else:  # a `told_stored`
                    _, key, kb, ev, lo, hi, parent, bs, tiers, media = spec
                    n, count = hi - lo, (hi - lo) * kb >> 2
                    if n * (9 + 5 * bs) <= self._quick:  # one event (the common case)
                        own = hashes[at_hash : at_hash + n * 9]
                        body = stored_fields(
                            n, own, parent, count, tokens[at_token : at_token + count * 5], bs
                        )
                        out.extend(stored(body, media[tier]) for tier in tiers)
                    else:
                        self._cut(out, spec, hashes[at_hash:], tokens[at_token:])
                    at_hash, at_token = at_hash + n * 9, at_token + count * 5
                continue
            if group and this != medium:
                out.append(removed_tagged(group, size, medium))
                group, size = [], 0
            if not group:
                medium, room = this, self._rooms.get(this) or self._room(this)
            while n > room:  # the group is full before this piece ends: cut it there
                group.append(piece[: room * 9])
                out.append(removed_tagged(group, size + room, medium))
                piece, n = piece[room * 9 :], n - room
                group, size, room = [], 0, self._room(medium)
            group.append(piece)
            size += n
            room -= n
        if group:
            out.append(removed_tagged(group, size, medium))
        return out

    def _cut(self, out: list[bytes], spec: tuple[Any, ...], hashes: bytes, tokens: bytes) -> None:
        """The events of a `told_stored` too long for one, each chained to the one before,
        appended to `out`; `hashes` and `tokens` tagged, from the spec's first block on."""
        _, _, _, ev, lo, hi, parent, bs, tiers, media = spec
        n = hi - lo
        per = min(blocks_per_event(self.max_event_bytes, bs, media[tier]) for tier in tiers)
        for a in range(0, n, per):
            b = min(n, a + per)
            body = stored_fields(
                b - a,
                hashes[a * 9 : b * 9],
                parent if a == 0 else ev + lo + a - 1,
                (b - a) * bs,
                tokens[a * bs * 5 : b * bs * 5],
                bs,
            )
            out.extend(stored(body, media[tier]) for tier in tiers)

    def _room(self, medium: str) -> int:
        """The most hashes a BlockRemoved in `medium` holds (`removals_per_event`), kept."""
        room = self._rooms[medium] = removals_per_event(self.max_event_bytes, medium)
        return room


def removals_per_event(max_bytes: int, medium: str) -> int:
    """The most hashes a BlockRemoved in `medium` may hold in `max_bytes`; at least one."""
    return max(1, (max_bytes - EVENT_OVERHEAD - len(medium_bytes(medium))) // 9)


def split_blocks(blocks: Blocks, per: int) -> list[Blocks]:
    """`blocks` as runs of at most `per` blocks, each chained to the last block of the one
    before (`per` >= 1)."""
    count = len(blocks.hashes) >> 3
    if count <= per:
        return [blocks]
    step = blocks.block_size * TOKEN_BYTES
    parts = []
    for a in range(0, count, per):
        b = min(count, a + per)
        parent = (
            blocks.parent if a == 0 else int.from_bytes(blocks.hashes[a * 8 - 8 : a * 8], "big")
        )
        parts.append(
            Blocks(
                blocks.hashes[a * 8 : b * 8],
                parent,
                blocks.tokens[a * step : b * step],
                blocks.block_size,
            )
        )
    return parts


def tagged_u64(be_bytes: bytes) -> bytes:
    """The big-endian uint64s of `be_bytes` as msgpack's uint 64 items (no array header)."""
    out = np.empty(len(be_bytes) >> 3, _UINT64)
    out["tag"] = 0xCF
    out["value"] = np.frombuffer(be_bytes, ">u8")
    return out.tobytes()


def tagged_numbers(firsts: list[int], counts: list[int]) -> bytes:
    """msgpack's uint 64 items (no array header) of the runs first, first + 1, ... (`counts`
    of each), one run after another."""
    total = sum(counts)
    if not total:
        return b""
    out = np.empty(total, _UINT64)
    out["tag"] = 0xCF
    starts = np.array(firsts, dtype=np.uint64)
    if total == len(firsts):  # runs of one: eviction a block at a time
        out["value"] = starts
    else:  # each run's first, repeated, plus the place in its run (uint64: wraps alike)
        before = np.cumsum(counts, dtype=np.uint64) - np.array(counts, dtype=np.uint64)
        place = np.arange(total, dtype=np.uint64) - np.repeat(before, counts)
        out["value"] = np.repeat(starts, counts) + place
    return out.tobytes()


def tagged_tokens(le_bytes: bytes) -> bytes:
    """The little-endian uint32s of `le_bytes` as msgpack's uint 32 items (no array header)."""
    out = np.empty(len(le_bytes) >> 2, _UINT32)
    out["tag"] = 0xCE
    out["value"] = np.frombuffer(le_bytes, "<u4")  # swapped to big-endian as it is copied
    return out.tobytes()


def removed_tagged(pieces: list[bytes], count: int, medium: str) -> bytes:
    """A BlockRemoved of `count` hashes, given as uint 64 items in `pieces`."""
    return b"\x93" + _REMOVED + array_header(count) + b"".join(pieces) + medium_bytes(medium)


def is_removal(spec: Spec) -> bool:
    """Whether `spec` is a BlockRemoved (a `Removed`, or a `told_removed`)."""
    return isinstance(spec, Removed) or (type(spec) is tuple and spec[0] == TOLD_REMOVED)


def messages(events: list[bytes], limit: int, most: int) -> Iterator[list[bytes]]:
    """`events` cut into the events of messages of at most `most` events and `limit` bytes of
    them (a packer cut every event to fit one); one empty message when there are none."""
    start, size = 0, 0
    for i, event in enumerate(events):
        if i > start and (i - start == most or size + len(event) > limit):
            yield events[start:i]
            start, size = i, 0
        size += len(event)
    if start < len(events) or not events:
        yield events[start:]
