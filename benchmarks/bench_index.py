"""Radix index speed and memory (issue 2).

Workload: 1000 requests of 2000 tokens, each one of 20 shared 1000-token prefixes followed by
1000 tokens of its own; block_tokens=16. Three tiers are tracked (gpu, host, disk), with the
shared prefixes on gpu and the private suffixes half on gpu, half on host, so a lookup splits
every match by tier. Prints median and p99 microseconds for:

- lookup, full hit (tokens as ndarray, as torch tensor, as Python list): the whole prompt is
  cached; through `KVStore.lookup`'s path (`encode_tokens` + `RadixIndex.lookup`);
- lookup, half hit: only the shared prefix is cached;
- insert: a prompt whose first 1000 tokens are cached: match + insert of the 62 new blocks
  (their BLAKE2b ids are chained when first read, not by insert), and the same insert followed
  by reading the new ids, which is what an insert cost before ids were deferred;
- eviction: blocks per CPU second demoted by the LRU victim walk (gpu -> host) and dropped;
- memory: bytes of the index per cached block at 1M blocks, ids read (tracemalloc);
- events (issue 16): insert and eviction again, alternated between an index without events,
  one with an observer that does nothing (the floor, and the rows' noise) and one whose
  observer tells a real publisher (`bench_events.observe`), and the ratios to the first.

Baseline in the same run: a plain dict of block-token tuples (what a hash-chain cache without a
tree does per block) for the full-hit lookup. Run: `python benchmarks/bench_index.py [--quick]`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from bench_events import observe

from kvtier.blocks import BlockHasher, BlockId, encode_tokens
from kvtier.config import parse_config
from kvtier.events import EventPublisher
from kvtier.index import RadixIndex
from kvtier.index.node import Node
from kvtier.store import KVStore

BT = 16
PROMPT, SHARED, NUM_PREFIXES, NUM_REQUESTS = 2000, 1000, 20, 1000
GPU, HOST, DISK = 0, 1, 2


class ListRadixBaseline:
    """Baseline in the same run: the classic Python radix cache shape (token lists as keys,
    children keyed by the first page, pages compared by list slices), as engines such as
    SGLang write it, tracking no tiers. Written here for the comparison; not kvtier code."""

    class _Node:
        __slots__ = ("children", "key")

        def __init__(self, key: list[int]) -> None:
            self.key = key
            self.children: dict[tuple[int, ...], ListRadixBaseline._Node] = {}

    def __init__(self, page: int) -> None:
        self.page = page
        self.root = self._Node([])

    def _common(self, a: list[int], b: list[int]) -> int:
        page, i, n = self.page, 0, min(len(a), len(b))
        while i + page <= n and a[i : i + page] == b[i : i + page]:
            i += page
        return i

    def match(self, key: list[int]) -> int:
        node, pos, page = self.root, 0, self.page
        while pos + page <= len(key):
            child = node.children.get(tuple(key[pos : pos + page]))
            if child is None:
                break
            common = self._common(child.key, key[pos:])
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def insert(self, key: list[int]) -> None:
        node, pos, page = self.root, 0, self.page
        key = key[: len(key) - len(key) % page]
        while pos < len(key):
            first = tuple(key[pos : pos + page])
            child = node.children.get(first)
            if child is None:
                node.children[first] = self._Node(key[pos:])
                return
            common = self._common(child.key, key[pos:])
            if common < len(child.key):
                head = self._Node(child.key[:common])
                child.key = child.key[common:]
                head.children[tuple(child.key[:page])] = child
                node.children[first] = head
                child = head
            node, pos = child, pos + common


class SlotCounter:
    def __init__(self) -> None:
        self.next = [0, 0, 0]

    def take(self, tier: int, n: int) -> list[int]:
        start = self.next[tier]
        self.next[tier] += n
        return list(range(start, start + n))


def make_prefixes(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.integers(0, 128_000, SHARED, dtype=np.int64) for _ in range(NUM_PREFIXES)]


def build_requests(
    rng: np.random.Generator, prefixes: list[np.ndarray], num_requests: int
) -> list[np.ndarray]:
    return [
        np.concatenate(
            [prefixes[i % NUM_PREFIXES], rng.integers(0, 128_000, PROMPT - SHARED, dtype=np.int64)]
        )
        for i in range(num_requests)
    ]


def fill(index: RadixIndex, ns: BlockId, requests: list[np.ndarray], slots: SlotCounter) -> None:
    for request in requests:
        key = encode_tokens(request)
        match = index.match(ns, key)
        new = len(request) // BT - match.num_blocks
        if new > 0:
            tier = GPU if match.num_blocks == 0 else HOST
            index.insert(match, key, {tier: slots.take(tier, new), DISK: slots.take(DISK, new)})


def fill_alike(indexes: list[RadixIndex], ns: BlockId, requests: list[np.ndarray]) -> None:
    """`fill` each of `indexes`, a request into each in turn: their nodes are allocated
    interleaved, so that no side's tree lies in memory more favourably than another's (filled
    one after the other, three identical indexes evicted at 0.54-1.53x one another's speed)."""
    counters = [SlotCounter() for _ in indexes]
    for request in requests:
        for index, slots in zip(indexes, counters, strict=True):
            fill(index, ns, [request], slots)


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - start) / 1000)
    return out


def summary(name: str, samples_us: list[float]) -> tuple[float, float]:
    samples = sorted(samples_us)
    p50 = statistics.median(samples)
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    print(f"{name:<48} p50 {p50:8.2f} us   p99 {p99:8.2f} us")
    return p50, p99


class NoEvents:
    """An observer that does nothing: what a call per edit costs at all, and the noise of the
    rows (issue 16's 5 % is measured against the index's own Python, a few microseconds an
    edit: an event of any kind built in Python is one more such edit)."""

    def gained(self, node: Node, lo: int, hi: int, tiers: tuple[int, ...]) -> None:
        pass

    def lost(self, node: Node, lo: int, hi: int, tiers: tuple[int, ...]) -> None:
        pass


SIDES = ("off", "no-op observer", "on")
EVICTION_ROUNDS = 3


def with_events(side: str, index: RadixIndex) -> EventPublisher | None:
    """Events on `index` as `side` says; the publisher to close, for "on"."""
    if side == "no-op observer":
        index.observer = NoEvents()
    return observe(index) if side == "on" else None


def events_rows(
    hasher: BlockHasher, ns: BlockId, prefixes: list[np.ndarray], requests: list[np.ndarray]
) -> None:
    """Insert and eviction on three indexes built alike: without an observer, with one that does
    nothing, and with events published; insert alternated sample by sample (each side first in
    turn), eviction tier by tier in `EVICTION_ROUNDS` rounds on fresh indexes (CPU time of the
    process, the publisher's thread included; the median of each round's ratio). The no-op
    column is the rows' noise as much as a floor: it measured 0.84-1.38 of none from run to
    run (freezing the indexes out of the garbage collector's view did not narrow that)."""
    print("\nevents (issue 16): the same rows, an index without events / with a no-op observer "
          "/ one publishing them")  # fmt: skip
    fresh = build_requests(np.random.default_rng(3), prefixes, 3000)
    inserts = []
    for side in SIDES:
        index = RadixIndex(("gpu", "host", "disk"), BT, hasher)
        publisher = with_events(side, index)
        slots = SlotCounter()
        fill(index, ns, prefixes, slots)
        inserts.append((index, slots, publisher))
    gc.collect()
    times: list[list[float]] = [[] for _ in SIDES]
    for i, request in enumerate(fresh):
        key = encode_tokens(request)
        for k in range(len(SIDES)):
            at = (i + k) % len(SIDES)  # each side first every third sample
            index, slots, _ = inserts[at]
            start = time.perf_counter_ns()
            match = index.match(ns, key)
            n = PROMPT // BT - match.num_blocks
            index.insert(match, key, {HOST: slots.take(HOST, n), DISK: slots.take(DISK, n)})
            times[at].append((time.perf_counter_ns() - start) / 1000)
    p50 = [summary(f"insert, events {side}", times[k])[0] for k, side in enumerate(SIDES)]
    rows = {"insert p50": [p50[1] / p50[0], p50[2] / p50[0]]}
    dropped = 0
    for index, _, publisher in inserts:
        index.check()
        dropped += close(publisher)
    for label, evict in (("eviction", evict_tier), ("eviction by runs", evict_runs)):
        ratios: dict[str, list[list[float]]] = {}
        for round_ in range(EVICTION_ROUNDS):
            built = []
            for side in SIDES:
                index = RadixIndex(("gpu", "host", "disk"), BT, hasher)
                built.append((index, with_events(side, index)))
            fill_alike([index for index, _ in built], ns, requests)
            gc.collect()
            for tier, name in ((GPU, "gpu -> host"), (HOST, "host -> disk"), (DISK, "drop")):
                order = [(round_ + tier + k) % len(SIDES) for k in range(len(SIDES))]
                rates = [0.0] * len(SIDES)
                for k in order:  # each side first in turn
                    rates[k] = evict(built[k][0], tier)
                ratios.setdefault(name, []).append([rates[0] / rates[1], rates[0] / rates[2]])
            for index, publisher in built:
                index.check()
                dropped += close(publisher)
        for name, per_round in ratios.items():
            rows[f"{label} {name}"] = [statistics.median(r[k] for r in per_round) for k in (0, 1)]
    print("events / off, CPU time, medians (issue 16's target: on <= 1.05):")
    for row, (noop, on) in rows.items():
        print(f"    {row:<34} no-op observer {noop:6.3f}   on {on:6.3f}")
    print(f"events dropped by a full queue (a router told to forget): {dropped}")


def close(publisher: EventPublisher | None) -> int:
    """Close `publisher` (None: none); the events it dropped."""
    if publisher is None:
        return 0
    publisher.close()
    return int(publisher.stats()["dropped_events"])


def evict_tier(index: RadixIndex, tier: int) -> float:
    """Blocks per CPU second of the process (its threads included) of demoting (or, from
    disk, dropping) every block of `tier`."""
    taken = SlotCounter()
    taken.next = [0, 10**7, 2 * 10**7]
    t0 = time.process_time()
    count = 0
    for ref in index.victims(tier):
        if tier == DISK:
            index.drop(ref)
        else:
            if ref.node.slots[tier + 1][ref.i] is None:
                index.set_slot(ref, tier + 1, taken.take(tier + 1, 1)[0])
            index.clear_slot(ref, tier)
        count += 1
    return count / (time.process_time() - t0)


def evict_runs(index: RadixIndex, tier: int) -> float:
    """Blocks per CPU second of the same, a run of a node's tail at a time, as
    `Demoter.make_room` does: `victim_runs`, then `add_copies` + `clear_tail`, or `drop_tail`
    from the lowest tier."""
    taken = SlotCounter()
    taken.next = [0, 10**7, 2 * 10**7]
    t0 = time.process_time()
    count = 0
    for run in index.victim_runs(tier):
        node, lo, hi = run.node, run.lo, run.hi
        if tier == DISK:
            index.drop_tail(node, hi - lo)
        else:
            if node.slots[tier + 1][lo:hi].count(None) == hi - lo:
                index.add_copies(node, tier + 1, lo, taken.take(tier + 1, hi - lo))
            index.clear_tail(node, tier, hi - lo)
        count += hi - lo
    return count / (time.process_time() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k blocks for memory, not 1M")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    hasher = BlockHasher()
    ns = hasher.seed(b"\0" * 16, b"bench")
    prefixes = make_prefixes(rng)
    requests = build_requests(rng, prefixes, NUM_REQUESTS)
    index = RadixIndex(("gpu", "host", "disk"), BT, hasher)
    fill(index, ns, requests, SlotCounter())
    index.check()
    print(f"index: {index.num_blocks} blocks in {index.num_nodes} nodes\n")

    lists = [r.tolist() for r in requests]
    tensors = [torch.from_numpy(r) for r in requests]
    half = [np.concatenate([r[:SHARED], rng.integers(200_000, 300_000, SHARED)]) for r in requests]

    def cycle(seq: Sequence[Any], fn: Callable[[Any], object]) -> Callable[[], object]:
        it = iter(range(10**9))
        return lambda: fn(seq[next(it) % len(seq)])

    def look(tokens: object) -> object:
        return index.lookup(ns, encode_tokens(tokens))  # type: ignore[arg-type]

    reps = 5000
    results = {}
    results["lookup full hit, ndarray"] = summary(
        "lookup full hit (ndarray int64)", timed(cycle(requests, look), reps)
    )
    summary("lookup full hit (torch int64 tensor)", timed(cycle(tensors, look), reps))
    results["lookup full hit, list"] = summary(
        "lookup full hit (Python list)", timed(cycle(lists, look), reps)
    )
    summary("lookup half hit (ndarray int64)", timed(cycle(half, look), reps))

    # the same lookups through the public API: KVStore.lookup (lock, tenant, counters, result)
    store = KVStore(
        parse_config(
            {
                "model": {
                    "name": "bench",
                    "num_layers": 1,
                    "num_kv_heads": 1,
                    "head_dim": 2,
                    "dtype": "float16",
                },
                "block_tokens": BT,
                "tiers": {
                    "gpu": {
                        "capacity": 64 * 2 * 2 * BT * 70_000,
                        "high_watermark": 1.0,
                        "low_watermark": 1.0,
                    },
                    "host": {"capacity": 64 * 2 * 2 * BT * 70_000},
                },
            }
        )
    )
    for r in requests:
        store.store(r, torch.zeros((1, 2, PROMPT, 1, 2), dtype=torch.float16))
    assert store.lookup(requests[0]).num_tokens == PROMPT
    results["store lookup, ndarray"] = summary(
        "KVStore.lookup full hit (ndarray int64)", timed(cycle(requests, store.lookup), reps)
    )
    summary("KVStore.lookup full hit (Python list)", timed(cycle(lists, store.lookup), reps))
    store.close()
    del store
    gc.collect()

    baseline = ListRadixBaseline(BT)
    for r in lists:
        baseline.insert(r)
    assert all(baseline.match(r) == PROMPT // BT * BT for r in lists[:20])
    results["baseline"] = summary(
        "baseline: list-keyed radix tree, no tiers (list)",
        timed(cycle(lists, baseline.match), reps),
    )

    del baseline, lists, tensors, half
    gc.collect()

    # insert: a fresh index holding only the shared prefixes; each sample inserts a new prompt
    ins_index = RadixIndex(("gpu", "host", "disk"), BT, hasher)
    slots = SlotCounter()
    fill(ins_index, ns, prefixes, slots)
    fresh = build_requests(np.random.default_rng(1), prefixes, 3000)
    fresh_slots = [(slots.take(HOST, 63), slots.take(DISK, 63)) for _ in fresh]
    it = iter(range(len(fresh)))

    def insert_one(read_ids: bool = False) -> None:
        i = next(it)
        key = encode_tokens(fresh[i])
        match = ins_index.match(ns, key)
        n = PROMPT // BT - match.num_blocks
        host, disk = fresh_slots[i]
        end = ins_index.insert(match, key, {HOST: host[:n], DISK: disk[:n]}).end
        if read_ids:
            ins_index.forest.ids_of(end)

    half_of = len(fresh) // 2
    results["insert"] = summary(
        "insert 2000 tokens, 1000 cached (ids deferred)", timed(insert_one, half_of)
    )
    summary(
        "insert, then its 62 new ids (BLAKE2b chain)",
        timed(lambda: insert_one(read_ids=True), len(fresh) - half_of),
    )
    ins_index.check()

    # eviction, tier by tier: gpu -> host (copy where host lacks one), host -> disk (every
    # block has a disk copy here), then drop everything from the lowest tier
    gc.collect()  # the rows should not pay the collection debt of the sections before them
    for tier, name in (
        (GPU, "demote gpu -> host"),
        (HOST, "demote host -> disk"),
        (DISK, "drop from disk (lowest tier)"),
    ):
        count = index.resident(tier)  # every copy in the tier is a victim
        rate = evict_tier(index, tier)
        print(f"{'eviction: ' + name:<48} {rate:10.0f} blocks/s ({count} blocks)")
    assert index.num_blocks == 0, "every block should have been evicted"
    index.check()

    events_rows(hasher, ns, prefixes, requests)

    # memory per block at 1M blocks
    target = 100_000 if args.quick else 1_000_000
    per_request = (PROMPT - SHARED) // BT
    count = (target - NUM_PREFIXES * SHARED // BT) // per_request + 1
    gc.collect()
    mem_requests = build_requests(np.random.default_rng(2), prefixes, count)
    mem_keys = [encode_tokens(r) for r in mem_requests]
    del mem_requests
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem_index = RadixIndex(("gpu", "host", "disk"), BT, hasher)
    ms = SlotCounter()
    for key in mem_keys:
        match = mem_index.match(ns, key)
        n = PROMPT // BT - match.num_blocks
        end = mem_index.insert(match, key, {GPU: ms.take(GPU, n), DISK: ms.take(DISK, n)}).end
        mem_index.forest.ids_of(end)  # counted with its ids, as a block on disk holds them
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_block = (after - before) / mem_index.num_blocks
    print(
        f"{'memory per cached block':<48} {per_block:8.1f} bytes "
        f"at {mem_index.num_blocks} blocks (gpu + disk copies)"
    )

    print()
    lk, ll, ins = (
        results["lookup full hit, ndarray"][0],
        results["lookup full hit, list"][0],
        results["insert"][0],
    )
    print(
        f"targets: lookup ndarray {lk:.1f}/12 us, list {ll:.1f}/25 us, insert {ins:.1f}/80 us, "
        f"memory {per_block:.0f}/600 B"
    )
    base = results["baseline"][0]
    print(
        f"ratio, full-hit lookup of a list, baseline / kvtier (3 tiers tracked): "
        f"{base / ll:.2f}x (ndarray: {base / lk:.2f}x)"
    )


if __name__ == "__main__":
    main()
