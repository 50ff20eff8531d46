"""A message's events as runs that one hold of the index's lock applies (`PrefixIndex.apply`),
bounded by blocks, not by events: a score waits for one run, whatever the events' sizes.

One event may tell of many blocks: a kvtier store tells of a prompt's run of blocks in one
BlockStored (128k tokens: 8,192 blocks), and its removals in a row in one BlockRemoved (up to
`events.max_message_bytes`: some 900,000 hashes). Runs of 256 events held the lock for 98
BlockStored of 2,048 blocks each for 0.96 s, and for one BlockStored of an 8 MiB message (94,244
blocks) 0.73 s, every score of the router waiting meanwhile. Here:

- `cut` cuts an event of more than `APPLY_BLOCKS` blocks into pieces of at most that many,
  each BlockStored's piece chained to the last hash of the one before (as a publisher cuts a
  long run, `kvtier.events.wire.Packer`; the index applies them alike). A BlockStored is checked
  whole before it is cut (hashes, block size, token ids: a bad one is left whole, and refused
  whole); a piece after the first that follows one refused (the pod full, an orphan) is
  skipped, uncounted: a pod holds a run's leading pieces at most, never a hole;
- its token ids are packed here (`Encoded`), outside the lock, once;
- `runs` groups the pieces, `APPLY_BLOCKS` blocks a run at most (one piece at least).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvtier.blocks import TOKEN_NBYTES, encode_tokens
from kvtier.errors import InvalidTokensError
from kvtier.routing.reading import BadEvent, block_hashes

APPLY_BLOCKS = 1024
"""Blocks applied in one hold of the index's lock (about 8 ms of them on a 2-core machine)."""
FIELDS = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 1}  # at least, per kind

Piece = tuple[Any, bool]
"""An event (or a piece of one) and whether it continues the piece before (`cut`)."""


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
    if kind == "BlockRemoved" and isinstance(hashes, list) and len(hashes) > most:
        return [
            (["BlockRemoved", hashes[a : a + most], *event[2:]], a > 0)
            for a in range(0, len(hashes), most)
        ]
    if kind != "BlockStored":
        return [(event, False)]
    tokens, bs = event[3], event[4]
    if not isinstance(hashes, list) or not isinstance(tokens, list) or type(bs) is not int:
        return [(event, False)]
    if bs != block_size or len(tokens) != len(hashes) * bs:
        return [(event, False)]
    try:  # each piece's parent is a hash of the one before: checked before it is taken
        block_hashes(hashes)
        data = encode_tokens(tokens) if tokens else b""
    except (BadEvent, InvalidTokensError):
        return [(event, False)]  # refused whole, under the lock, counted
    step = bs * TOKEN_NBYTES  # bytes a block
    pieces: list[Piece] = []
    for a in range(0, max(len(hashes), 1), most):
        parent = event[2] if a == 0 else hashes[a - 1]
        piece = Encoded(data[a * step : (a + most) * step])
        pieces.append((["BlockStored", hashes[a : a + most], parent, piece, bs, *event[5:]], a > 0))
    return pieces


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
