"""Edits of one block at a time (the mover's paths: a prefetch published block by block,
eviction and demotion from a node's end) join the event queued just before them when they
continue it, so a run of them is one event, not one per block. The sending thread drains the
queue all the while (`flush_s` 0): however the two meet, a subscriber that applies what it reads,
decoded by field position, ends with exactly the residency the index holds, and no block is
told of twice in a row."""

from __future__ import annotations

import random
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import zmq

from kvtier.blocks import BlockHasher, encode_tokens
from kvtier.events import EventPublisher, EventSettings
from kvtier.events.observer import IndexEvents
from kvtier.events.wire import TOLD_REMOVED, TOLD_STORED
from kvtier.index import BlockRef, RadixIndex
from kvtier.index.node import Node

MEDIA = ("GPU", "CPU")
BLOCKS = 8  # per prompt


def residency(index: RadixIndex) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    stack: list[Node] = [c for r in index.roots() for c in (r.children or {}).values()]
    while stack:
        node = stack.pop()
        for i in range(node.size):
            media = {MEDIA[t] for t in range(2) if node.slots[t][i] is not None}
            if media:
                out[node.ev + i] = media
        stack += list((node.children or {}).values())
    return out


def one_prompt(tier: int) -> tuple[RadixIndex, EventPublisher, Node]:
    """An index (gpu, host) with events queued and never sent (`flush_s` long), holding one
    prompt of `BLOCKS` blocks in `tier`; its node."""
    hasher = BlockHasher()
    index = RadixIndex(("gpu", "host"), 4, hasher)
    settings = EventSettings("kv@pod@m", queue_limit=10**6, flush_s=1000.0)
    publisher = EventPublisher("tcp://127.0.0.1:0", settings=settings)
    index.observer = IndexEvents(publisher, index, lambda namespace: "t")
    ns = hasher.seed(b"\0" * 16, b"t")
    key = encode_tokens(np.arange(4 * BLOCKS))
    end = index.insert(index.match(ns, key), key, {tier: list(range(BLOCKS))}).end
    return index, publisher, end


def test_blocks_promoted_and_demoted_one_by_one_are_one_event_each_way() -> None:
    """Nothing drains meanwhile here (`flush_s` long), so what joins is certain: 8 blocks
    promoted in order are one BlockStored of 8, chained to the prompt's parent as a store of
    the 8 would be, and 8 cleared from the end one BlockRemoved."""
    index, publisher, end = one_prompt(tier=1)
    for i in range(BLOCKS):
        index.set_slot(BlockRef(end, i), 0, 100 + i)
    for i in reversed(range(BLOCKS)):
        index.clear_slot(BlockRef(end, i), 0)
    index.check()
    specs = [spec for _, spec in publisher.pending]
    assert len(specs) == 3  # the insert's BlockStored in CPU, then one each way in GPU
    (_, _, _, ev, lo, hi, parent, _, tiers, _), removed = specs[1], specs[2]
    assert (ev, lo, hi, parent, tiers) == (end.ev, 0, BLOCKS, None, (0,))
    assert removed[1:] == (end.ev, BLOCKS, "GPU")
    publisher.close()


def test_a_block_at_a_time_is_told_in_runs_and_exactly() -> None:
    hasher = BlockHasher()
    index = RadixIndex(("gpu", "host"), 4, hasher)
    settings = EventSettings("kv@pod@m", queue_limit=10**6, flush_s=0.0)
    publisher = EventPublisher("tcp://127.0.0.1:0", settings=settings)
    ctx: Any = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    time.sleep(0.3)
    index.observer = IndexEvents(publisher, index, lambda namespace: "t")
    ns = hasher.seed(b"\0" * 16, b"t")
    rng = random.Random(7)
    free = {0: list(range(10_000)), 1: list(range(10_000))}
    edits = 0
    for p in range(60):
        tokens = np.arange(p * 1000, p * 1000 + 4 * BLOCKS)
        key = encode_tokens(tokens)
        end = index.insert(index.match(ns, key), key, {1: free[1][-BLOCKS:]}).end
        del free[1][-BLOCKS:]
        refs = [BlockRef(end, i) for i in range(BLOCKS)]
        for ref in refs[: rng.randint(1, BLOCKS)]:  # promoted in order, as a prefetch does
            index.set_slot(ref, 0, free[0].pop())
            edits += 1
        for ref in reversed(refs):  # demoted from the end while gpu holds the block
            if ref.node.slots[0][ref.i] is None or rng.random() < 0.3:
                continue
            if not index.can_clear(ref, 0):
                break
            free[0].append(index.clear_slot(ref, 0))
            edits += 1
        if rng.random() < 0.5:  # another prompt on gpu only, demoted to host from the end
            key = encode_tokens(np.arange(p * 1000 + 500, p * 1000 + 500 + 4 * BLOCKS))
            top = index.insert(index.match(ns, key), key, {0: free[0][-BLOCKS:]}).end
            del free[0][-BLOCKS:]
            for i in reversed(range(BLOCKS - rng.randint(0, BLOCKS), BLOCKS)):
                ref = BlockRef(top, i)
                if not index.can_clear(ref, 0):
                    break
                index.set_slot(ref, 1, free[1].pop())
                free[0].append(index.clear_slot(ref, 0))
                edits += 2
        if rng.random() < 0.5:  # dropped a block at a time from the end, as eviction does
            for _ in range(rng.randint(1, BLOCKS)):
                node = refs[0].node
                for tier, slot in index.drop(BlockRef(node, node.size - 1)):
                    free[tier].append(slot)
                edits += 1
                if node.parent is None:
                    break
        index.check()
    publisher.flush()
    held: dict[int, set[str]] = {}
    events = 0
    last: list[Any] | None = None
    for _ in range(publisher.sent("kv@pod@m")):
        _ts, batch, _rank = msgpack.unpackb(sub.recv_multipart()[2])
        for event in batch:
            events += 1
            if event[0] == "BlockStored":
                for h in event[1]:
                    held.setdefault(h, set()).add(event[6])
            elif event[0] == "BlockRemoved":
                for h in event[1]:
                    held[h].discard(event[2])
                    if not held[h]:
                        del held[h]
            else:
                held.clear()
            assert event != last  # a block told of once per change, not twice in a row
            last = event
    assert held == residency(index)
    assert events < edits, (events, edits)  # runs of single-block edits went as one
    publisher.close()
    sub.close()
    ctx.destroy(linger=0)


def test_a_block_moved_between_two_media_at_a_time_joins_a_run_in_each() -> None:
    """A demotion a block at a time from a node's end gains the copy below, then loses the one
    above; a drop of a block held in both loses both copies. Each medium's edits join their
    own run past the other medium's entry: an event a medium each way, not one a block and medium;
    an event queued by the publisher itself (a clear) is never joined past."""
    index, publisher, end = one_prompt(tier=0)
    for i in reversed(range(BLOCKS)):  # demoted from the end: host gains, then gpu loses
        index.set_slot(BlockRef(end, i), 1, 100 + i)
        index.clear_slot(BlockRef(end, i), 0)
    for i in range(BLOCKS // 2):  # promoted again in order: gpu gains, host keeps its copy
        index.set_slot(BlockRef(end, i), 0, 200 + i)
    for i in reversed(range(BLOCKS // 2, BLOCKS)):  # host-only blocks dropped from the end
        index.drop(BlockRef(end, i))
    index.check()
    specs = [spec for _, spec in publisher.pending]
    assert len(specs) == 5, specs  # the insert, then one event a medium each way
    stored_cpu, removed_gpu, stored_gpu, removed_cpu = specs[1:5]
    kind, lo, hi, parent, tiers = (stored_cpu[k] for k in (0, 4, 5, 6, 8))
    assert (kind, lo, hi, parent, tiers) == (TOLD_STORED, 0, BLOCKS, None, (1,))
    assert removed_gpu == (TOLD_REMOVED, end.ev, BLOCKS, "GPU")
    assert (stored_gpu[4], stored_gpu[5], stored_gpu[8]) == (0, BLOCKS // 2, (0,))
    assert removed_cpu == (TOLD_REMOVED, end.ev + BLOCKS // 2, BLOCKS // 2, "CPU")
    publisher.cleared("t")  # queued by the publisher: what follows starts afresh
    index.drop(BlockRef(end, BLOCKS // 2 - 1))  # held in both: a removal from each
    after = [spec for _, spec in publisher.pending][len(specs) + 1 :]
    assert after == [
        (TOLD_REMOVED, end.ev + BLOCKS // 2 - 1, 1, "GPU"),
        (TOLD_REMOVED, end.ev + BLOCKS // 2 - 1, 1, "CPU"),
    ]
    index.drop(BlockRef(end, BLOCKS // 2 - 2))  # the next one joins both, past each other
    assert [spec for _, spec in publisher.pending][len(specs) + 1 :] == [
        (TOLD_REMOVED, end.ev + BLOCKS // 2 - 2, 2, "GPU"),
        (TOLD_REMOVED, end.ev + BLOCKS // 2 - 2, 2, "CPU"),
    ]
    publisher.close()


def test_a_block_gained_in_two_media_never_joins_past_a_newer_edit_in_either() -> None:
    """The observer called as the index would: a run stored in host and disk, then block 8's
    disk copy lost, then block 8 stored in both. Joining the store into the run would move the
    disk copy's arrival ahead of its loss; it is queued after it instead."""
    hasher = BlockHasher()
    index = RadixIndex(("gpu", "host", "disk"), 4, hasher)
    settings = EventSettings("kv@pod@m", queue_limit=10**6, flush_s=1000.0)
    publisher = EventPublisher("tcp://127.0.0.1:0", settings=settings)
    observer = IndexEvents(publisher, index, lambda namespace: "t")
    ns = hasher.seed(b"\0" * 16, b"t")
    key = encode_tokens(np.arange(4 * 9))
    end = index.insert(index.match(ns, key), key, {1: list(range(9)), 2: list(range(9))}).end
    observer.gained(end, 0, 8, (1, 2))
    observer.lost(end, 8, 9, (2,))
    observer.gained(end, 8, 9, (1, 2))
    specs = [spec for _, spec in publisher.pending]
    assert [(s[0], s[4], s[5]) if s[0] == TOLD_STORED else s for s in specs] == [
        (TOLD_STORED, 0, 8),
        (TOLD_REMOVED, end.ev + 8, 1, "DISK"),
        (TOLD_STORED, 8, 9),
    ]
    publisher.close()
