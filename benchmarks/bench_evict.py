"""Bulk eviction (issue 13): free half of a large cache in one call, and 63 blocks at a time.

Two shapes, block_tokens 16:
- shared: prompts of 2000 tokens, each one of 20 shared 1000-token prefixes followed by 1000
  tokens of its own (1000 prompts: 64,240 blocks; more prompts for the larger sizes);
- branchy: prompts of 32 blocks cut in 8 segments of 4 blocks, each segment one of 6 variants
  chosen at random, so the tree branches 6 ways every 4 blocks (up to 8M blocks).
After the inserts, random lookups stir recency (one per prompt, of an earlier prompt).

Index level (a one-tier index, every victim dropped), at 10k, 100k and 1M cached blocks:
- new: `RadixIndex.victim_runs` + `drop_tail`, a node's tail in one edit (what `KVStore.evict`
  runs through `Demoter.make_room`);
- old: the algorithm before issue 13, kept here for the comparison: `reference_victims`, a
  copy of `eviction.victims` as it was (a heap of every candidate, rebuilt per call) without
  its rank call per candidate (no floors here: the rank was always 0, so the copy is a little
  faster than the original, which only lowers the ratios), with the per-block
  `RadixIndex.drop` loop of the old `make_room`, run over the same index. The faithful copy,
  ranks included, is the oracle of `tests/test_index_victims.py`.
Store level (`KVStore.evict("gpu", n)`, tiny KV: 1 layer, 1 head, head_dim 8, fp16; gpu and
host tiers of the same size) at 10k, 100k and 180k blocks (the filer's size), under
`write_through` (every gpu victim has a host copy: cleared) and `write_back` (every gpu victim
is copied down: one `Transfer` per run now, one per block before); the old side is the old
`make_room` loop (the same copy of the old victims, `decide`, then one clear, copy or drop and
one `pool.free` per block) over the same store's index and pools, under the store's lock.

Each repetition builds the cache afresh for each side, sides alternating; it first times
`CALLS` calls that free 63 blocks each, then one call that frees half of what is left. Prints
medians over the repetitions: ms per bulk call, ns per block freed, us per 63-block call, and
old / new. Times are CPU time of the process (`time.process_time`), the same clock for both
sides, so that other processes sharing the machine do not blur the ratio.
Run: `python benchmarks/bench_evict.py [--quick] [--reps N]`.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import torch

from kvtier.blocks import BlockHasher, encode_tokens
from kvtier.config import parse_config
from kvtier.index import BlockRef, Node, RadixIndex
from kvtier.store import KVStore
from kvtier.transfer.demotion import Action, decide, plan_copy_down, record_copies

BT = 16
PROMPT, SHARED, NUM_PREFIXES = 2000, 1000, 20
SEGMENTS, SEGMENT_BLOCKS, VARIANTS = 8, 4, 6
CALLS = 20  # calls of 63 blocks per repetition
HASHER = BlockHasher()
NS = HASHER.seed(b"bench-evict-ns!!", b"tenant-salt-0000")


def reference_victims(index: RadixIndex, tier: int) -> Iterator[BlockRef]:
    """`eviction.victims` before issue 13 (no floors): every candidate heapified per call."""
    candidates = index.candidates(tier)
    heap = [(0, node.tick, seq, node) for seq, node in enumerate(candidates)]
    heapq.heapify(heap)
    seq = len(candidates)
    queued = {entry[3] for entry in heap}
    skipped: set[Node] = set()
    while heap:
        _, tick, _, node = heapq.heappop(heap)
        queued.discard(node)
        if node not in candidates or node in skipped:
            continue
        if node.tick != tick:
            heapq.heappush(heap, (0, node.tick, seq, node))
            seq += 1
            queued.add(node)
            continue
        before = (node.size, node.depth[tier])
        parent = node.parent
        yield BlockRef(node, node.depth[tier] - 1)
        if node.parent is not None and (node.size, node.depth[tier]) == before:
            skipped.add(node)
            continue
        for nxt in (node, parent):
            if nxt is not None and nxt in candidates and nxt not in queued and nxt not in skipped:
                heapq.heappush(heap, (0, nxt.tick, seq, nxt))
                seq += 1
                queued.add(nxt)


# ---- workloads ------------------------------------------------------------------------------


def shared_prompts(count: int, seed: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 128_000, SHARED, dtype=np.int64) for _ in range(NUM_PREFIXES)]
    for i in range(count):
        own = rng.integers(0, 128_000, PROMPT - SHARED, dtype=np.int64)
        yield np.concatenate([prefixes[i % NUM_PREFIXES], own])


def branchy_prompts(count: int, seed: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    seg = SEGMENT_BLOCKS * BT
    for _ in range(count):
        path = rng.integers(0, VARIANTS, SEGMENTS)
        codes = np.cumsum(path * VARIANTS ** np.arange(SEGMENTS)) + 1  # the path so far
        yield (np.repeat(codes, seg) * 7919 + np.tile(np.arange(seg), SEGMENTS)) % 128_000


SHAPES: dict[str, Callable[[int, int], Iterator[np.ndarray]]] = {
    "shared": shared_prompts,
    "branchy": branchy_prompts,
}


def build_index(shape: str, blocks: int, seed: int) -> RadixIndex:
    """A one-tier index of about `blocks` blocks, recency stirred by lookups."""
    make = SHAPES[shape]
    index = RadixIndex(("gpu",), BT, HASHER)
    keys: list[bytes] = []
    rng = np.random.default_rng(seed + 1)
    slot = 0
    for tokens in make(10**9, seed):
        key = encode_tokens(tokens)
        match = index.match(NS, key)
        new = len(tokens) // BT - match.num_blocks
        if new > 0:
            index.insert(match, key, {0: list(range(slot, slot + new))})
            slot += new
        keys.append(key if len(keys) < 4096 else keys[int(rng.integers(len(keys)))])
        index.lookup(NS, keys[int(rng.integers(len(keys)))])
        if index.num_blocks >= blocks:
            return index
    raise AssertionError("unreachable: the prompt stream is endless")


# ---- the two algorithms -------------------------------------------------------------------


def free_old(index: RadixIndex, count: int) -> int:
    freed = 0
    for ref in reference_victims(index, 0):
        index.drop(ref)
        freed += 1
        if freed >= count:
            break
    return freed


def free_new(index: RadixIndex, count: int) -> int:
    freed = 0
    for run in index.victim_runs(0):
        take = min(run.hi - run.lo, count - freed)
        index.drop_tail(run.node, take)
        freed += take
        if freed >= count:
            break
    return freed


def measure(free: Callable[[int], int], total: int) -> tuple[float, float]:
    """(median s per 63-block call over CALLS calls, s for one call freeing half the rest)."""
    calls = []
    for _ in range(CALLS):
        t0 = time.process_time()
        assert free(63) == 63
        calls.append(time.process_time() - t0)
    half = (total - 63 * CALLS) // 2
    gc.collect()
    t0 = time.process_time()
    assert free(half) == half
    return statistics.median(calls), time.process_time() - t0


def report(
    label: str, old: list[tuple[float, float]], new: list[tuple[float, float]], half: int
) -> None:
    o63, obulk = (statistics.median(x) for x in zip(*old, strict=True))
    n63, nbulk = (statistics.median(x) for x in zip(*new, strict=True))
    print(
        f"{label:<28} bulk {half:>7} blocks: old {obulk * 1e3:9.2f} ms ({obulk / half * 1e9:6.0f} "
        f"ns/block)  new {nbulk * 1e3:8.2f} ms ({nbulk / half * 1e9:5.0f} ns/block)  "
        f"old/new {obulk / nbulk:6.1f}x | 63 at a time: old {o63 * 1e6:8.0f} us  "
        f"new {n63 * 1e6:6.0f} us  {o63 / n63:6.1f}x"
    )


def bench_index(sizes: list[int], reps: int) -> None:
    print("index level (one tier, victims dropped); medians of", reps, "repetitions")
    for shape in SHAPES:
        for size in sizes:
            old: list[tuple[float, float]] = []
            new: list[tuple[float, float]] = []
            half = 0
            for rep in range(reps):
                for side, out in ((free_old, old), (free_new, new))[:: 1 if rep % 2 else -1]:
                    index = build_index(shape, size, seed=rep)
                    total = index.num_blocks
                    half = (total - 63 * CALLS) // 2
                    out.append(measure(partial(side, index), total))
                    if total <= 200_000:
                        index.check()
                    del index
                    gc.collect()
            report(f"{shape}, {size:>9,} blocks", old, new, half)


# ---- the store ------------------------------------------------------------------------------

WRITES = {"write_through": "CLEAR: host copies exist", "write_back": "COPY: one gpu->host copy"}


def tiny_store(blocks: int, write: str) -> KVStore:
    block_bytes = 1 * 2 * BT * 1 * 8 * 2
    gpu = {"capacity": block_bytes * blocks, "high_watermark": 1.0, "low_watermark": 1.0}
    tiers = {"gpu": gpu, "host": {"capacity": block_bytes * blocks}}
    model = {"name": "bench", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16"}
    config = {"model": model, "block_tokens": BT, "tiers": tiers, "policy": {"write": write}}
    return KVStore(parse_config(config))


def fill_store(store: KVStore, shape: str, blocks: int, seed: int) -> None:
    make = SHAPES[shape]
    kv = torch.zeros((1, 2, PROMPT, 1, 8), dtype=torch.float16)
    for tokens in make(10**9, seed):
        store.store(tokens, kv[:, :, : len(tokens)])
        if store.index.num_blocks >= blocks - PROMPT // BT:
            return


def store_evict_old(store: KVStore, count: int) -> int:
    """The old `KVStore.evict("gpu", count)` -> `make_room` loop, block by block: the old
    victims, `decide`, then one clear, one copy (room below first) or one drop per block."""
    state, demoter, index = store.demoter.state, store.demoter, store.index
    pool, counters = store.pools[0], store.counters[0]
    assert not index.floors, "the copy of the old victims here has no fair shares"
    target = pool.num_free + count
    with store.operations.lock:
        for ref in reference_victims(index, 0):
            action = decide(state, ref, 0, demoter.admission)
            if action is Action.CLEAR:
                pool.free([index.clear_slot(ref, 0)])
                counters.demotions += 1
            elif action is Action.COPY:
                assert demoter.make_room(1, 1)
                copy = plan_copy_down(state, [ref], 0, 1)
                record_copies(state, copy, [ref], demoter.runner.run(copy.transfer))
                pool.free([index.clear_slot(ref, 0)])
                counters.demotions += 1
            else:
                assert action is Action.DROP
                for tier, slot in index.drop(ref):
                    store.pools[tier].free([slot])
                counters.evictions += 1
            if pool.num_free >= target:
                break
    return count


def store_evict_new(store: KVStore, count: int) -> int:
    return store.evict("gpu", count)


def bench_store(sizes: list[int], reps: int) -> None:
    print("KVStore.evict('gpu', n), tiny KV, gpu + host; medians of", reps, "repetitions")
    for write, what in WRITES.items():
        for shape in SHAPES:
            for size in sizes:
                old: list[tuple[float, float]] = []
                new: list[tuple[float, float]] = []
                half = 0
                for rep in range(reps):
                    sides = ((store_evict_old, old), (store_evict_new, new))
                    for side, out in sides[:: 1 if rep % 2 else -1]:
                        store = tiny_store(size, write)
                        fill_store(store, shape, size, seed=rep)
                        total = store.index.num_blocks
                        half = (total - 63 * CALLS) // 2
                        out.append(measure(partial(side, store), total))
                        store.check()
                        store.close()
                        del store
                        gc.collect()
                report(f"{write} ({what}), {shape}, {size:,}", old, new, half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    bench_index(sizes, reps)
    bench_store([10_000, 100_000] if args.quick else [10_000, 100_000, 180_000], reps)


if __name__ == "__main__":
    main()
