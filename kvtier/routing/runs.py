"""A message's events as runs that one hold of the index's lock applies (`PrefixIndex.apply`),
bounded by blocks, not by events: a score waits for one run, whatever the events' sizes.

One event may tell of many blocks: a kvtier store tells of a prompt's run of blocks in one
BlockStored (128k tokens: 8,192 blocks), and its removals in a row in one BlockRemoved (up to
`events.max_message_bytes`: some 900,000 hashes). Runs of 256 events held the lock for 98
BlockStored of 2,048 blocks each for 0.96 s, and for one BlockStored of an 8 MiB message (94,244
blocks) 0.73 s, every score of the router waiting meanwhile. Here:

- `cut` cuts an event of more than `APPLY_BLOCKS` blocks into pieces of at most that many,
  each BlockStored's piece chained to the last hash of the one before (as a publisher cuts a
  long run, `kvtier.events.wire.Packer`; the index applies them alike). An event is checked
  whole before it is cut (a BlockStored's hashes, block size, token ids; a BlockRemoved's
  hashes: a bad one is left whole, and refused whole); a piece after the first that follows one
  refused (the pod full, an orphan) is skipped: a pod holds a run's leading pieces at most,
  never a hole. An event is counted applied when its last piece is, `bad` when one is refused;
- its token ids are packed here (`Encoded`), outside the lock, once;
- `runs` groups the pieces, `APPLY_BLOCKS` blocks a run at most (one piece at least).

Most messages (a vLLM engine step: a few one-block events) need none of that: `whole` tells
the index to apply them in one hold, as they are (their tokens packed here past `PACK_BLOCKS`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvtier.blocks import TOKEN_NBYTES, encode_tokens
from kvtier.errors import InvalidTokensError
from kvtier.routing.reading import BadEvent, block_hashes

APPLY_BLOCKS = 1024
"""Blocks applied in one hold of the index's lock (about 8 ms of them on a 2-core machine)."""
PACK_BLOCKS = 64
"""Blocks a message has at least for its token ids to be packed outside the lock (`whole`): fewer
are packed under it, in microseconds, as cheaply as a pass over them outside would cost."""
FIELDS = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 1}  # at least, per kind

Piece = tuple[Any, bool, bool]
"""An event (or a piece of one), whether it continues the piece before, and whether it ends its
event (`cut`): an event is counted applied when its last piece is, refused when one is."""


class Encoded(bytes):
    """A BlockStored's token ids packed by `cut` (`encode_tokens`), in place of the list: never
    what msgpack decodes (a `bin` is `bytes`), so a payload cannot pass one off as checked."""


def shaped(event: Any) -> bool:
    """Is `event` an array of a known kind with its fields (the index checks their values)?"""
    if not isinstance(event, list) or not event or not isinstance(event[0], str):
        return False
    least = FIELDS.get(event[0])
    return least is not None and len(event) >= least


def cut(event: Any, block_size: int, most: int = APPLY_BLOCKS) -> list[Piece]:
    """`event` (`shaped`) as pieces of `most` blocks at most (module doc)."""
    kind, hashes = event[0], event[1] if len(event) > 1 else None
    if kind == "BlockRemoved":
        return _removals(event, hashes, most)
    if kind != "BlockStored" or not isinstance(hashes, list) or len(hashes) <= most:
        if kind == "BlockStored":  # one piece: its hashes are checked under the lock
            _pack(event, block_size)
        return [(event, False, True)]
    _pack(event, block_size)
    try:  # each piece's parent is a hash of the one before: checked before it is taken
        block_hashes(hashes)
    except BadEvent:
        return [(event, False, True)]  # refused whole, under the lock, counted
    data = event[3]
    if type(data) is not Encoded:  # not packed: refused whole, under the lock, counted
        return [(event, False, True)]
    step = block_size * TOKEN_NBYTES  # bytes a block
    return [
        (
            [
                "BlockStored",
                hashes[a : a + most],
                event[2] if a == 0 else hashes[a - 1],
                Encoded(data[a * step : (a + most) * step]),
                block_size,
                *event[5:],
            ],
            a > 0,
            a + most >= len(hashes),
        )
        for a in range(0, len(hashes), most)
    ]


def _removals(event: Any, hashes: Any, most: int) -> list[Piece]:
    """A BlockRemoved's pieces; one bad hash leaves it whole, refused whole (as before it was
    cut: no piece of it removed)."""
    if not isinstance(hashes, list) or len(hashes) <= most:
        return [(event, False, True)]
    try:
        block_hashes(hashes)
    except BadEvent:
        return [(event, False, True)]
    return [
        (["BlockRemoved", hashes[a : a + most], *event[2:]], a > 0, a + most >= len(hashes))
        for a in range(0, len(hashes), most)
    ]


def whole(events: list[Any], block_size: int, most: int = APPLY_BLOCKS) -> bool:
    """Do `events` (`shaped`) make one run of `most` blocks at most, none cut (most messages:
    a vLLM engine step's)? Then their token ids are packed, in place (`cut`'s fast path)."""
    size = 0
    for event in events:
        hashes = event[1] if len(event) > 1 else None
        size += len(hashes) or 1 if type(hashes) is list else 1  # `blocks`, inlined: per event
    if size > most:
        return False
    if size > PACK_BLOCKS:
        for event in events:
            if event[0] == "BlockStored":
                _pack(event, block_size)
    return True


def _pack(event: list[Any], block_size: int) -> None:
    """A BlockStored's token ids packed in place (`Encoded`) when it has the index's block size
    and as many as its hashes make blocks; else, or an id out of range, left for the index to
    refuse (its hashes too are checked there: this only picks what to pack)."""
    hashes, tokens = event[1], event[3]
    if type(tokens) is not list or type(hashes) is not list or event[4] != block_size:
        return
    if type(event[4]) is not int or len(tokens) != len(hashes) * block_size:
        return
    try:
        event[3] = Encoded(encode_tokens(tokens) if tokens else b"")
    except InvalidTokensError:
        return


def packed(tokens: Any, blocks: int, block_size: int) -> bytes:
    """A BlockStored's `tokens` packed (`encode_tokens`), or `BadEvent`: `blocks` full blocks
    of ids in [0, 2**32), never cast to one."""
    if not isinstance(tokens, list) or len(tokens) != blocks * block_size:
        raise BadEvent(f"token_ids: expected {blocks} blocks of {block_size}")
    try:
        return encode_tokens(tokens) if tokens else b""
    except InvalidTokensError as e:
        raise BadEvent(f"token_ids: {e}") from None


def blocks(event: Any) -> int:
    """The blocks `event` tells of (1 at least: a clear, a piece with none)."""
    return max(1, len(event[1])) if len(event) > 1 and isinstance(event[1], list) else 1


def runs(events: list[Any], block_size: int, most: int = APPLY_BLOCKS) -> Iterator[list[Piece]]:
    """The pieces of `events` (`cut`) in runs of `most` blocks at most, one piece at least; one
    empty run for no events (the source is heard of)."""
    run: list[Piece] = []
    size = 0
    for event in events:
        for piece in cut(event, block_size, most):
            n = blocks(piece[0])
            if run and size + n > most:
                yield run
                run, size = [], 0
            run.append(piece)
            size += n
    yield run
