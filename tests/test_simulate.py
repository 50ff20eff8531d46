"""The leaf-cache simulator (`kvtier.replay.simulate`, `policies`): hand-counted traces with
exact hits, then properties on random chained traces (an exhaustive search for the optimum)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError
from kvtier.replay import ceiling, read_trace
from kvtier.replay.policies import LRU2, POLICIES, S3FIFO, Lookahead
from kvtier.replay.simulate import LRU, Chain, Furthest, KeyedLeaves, LeafCache, chains, simulate
from kvtier.replay.trace import TraceRequest

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


def served(cache: LeafCache, trace: Sequence[Chain]) -> list[int]:
    """Hits per request, checking the cache after each."""
    hits = []
    for chain in trace:
        hits.append(cache.request(chain))
        cache.check()
    return hits


def test_a_hit_refreshes_the_blocks_it_used_not_the_tail() -> None:
    # r2 uses 1 of the chain 1-2-3: 3 keeps r0's recency, so r3 evicts 3 (not 5) and r4 hits 5
    cache = LeafCache(4, LRU())
    assert served(cache, [[1, 2, 3], [5], [1], [6], [5], [1, 2]]) == [0, 0, 1, 0, 1, 2]
    assert sorted(cache.children) == [1, 2, 5, 6]


def test_only_leaves_are_evicted() -> None:
    # r1 needs room: 1 is older than 3 but has a child; the leaf 3 goes, then 2 is a leaf
    cache = LeafCache(3, LRU())
    assert served(cache, [[1, 2, 3], [1, 4], [1, 2, 3]]) == [0, 1, 2]
    assert sorted(cache.children) == [1, 2, 3]  # r2 evicted 4, the only leaf not in use


def test_a_request_never_evicts_what_it_uses() -> None:
    # 2 blocks of room: r0 caches 1, 2 and drops 3; r1 hits 1, 2 and cannot insert 3
    cache = LeafCache(2, LRU())
    assert served(cache, [[1, 2, 3], [1, 2, 3]]) == [0, 2]
    assert cache.children == {1: 1, 2: 0}


def test_lru_and_the_furthest_leaf_on_a_cycle() -> None:
    # capacity 2, requests 1, 2, 3, 1, 2: LRU always evicts what comes next (0 hits); the
    # furthest-next-use leaf evicts 2 for 3, then hits 1 (1 hit)
    trace = [[1], [2], [3], [1], [2]]
    assert simulate(trace, 2, LRU()).hits == 0
    assert served(LeafCache(2, Furthest(trace)), trace) == [0, 0, 0, 1, 0]


def test_lru2_keeps_the_block_used_twice() -> None:
    # capacity 2: 1 is used twice, 2 once; r3's 3 evicts 2 (LRU would evict 1, the older)
    trace = [[1], [1], [2], [3], [1]]
    assert simulate(trace, 2, LRU()).hits == 1
    assert served(LeafCache(2, POLICIES["lru-2"](trace, 2)), trace) == [0, 1, 0, 0, 1]


def test_lookahead_spares_what_the_queue_will_use() -> None:
    # capacity 2, a queue of 2: at r2, request 4 will use 1, so 2 goes although it is newer
    trace = [[1], [2], [3], [4], [1]]
    assert simulate(trace, 2, LRU()).hits == 0
    assert served(LeafCache(2, Lookahead(trace, 3)), trace) == [0, 0, 0, 0, 1]


def test_s3fifo_sends_a_returning_block_to_main() -> None:
    # capacity 10: small FIFO of 1 block. 1 is evicted unused (to the ghost), comes back into
    # main, and then outlives the one-hit blocks that pass through the small FIFO
    policy = S3FIFO(10)
    cache = LeafCache(10, policy)
    trace = [[k] for k in range(1, 12)] + [[1]] + [[k] for k in range(20, 30)] + [[1]]
    hits = served(cache, trace)
    assert hits[11] == 0 and hits[-1] == 1
    assert 1 in policy.main and 1 not in policy.ghost


def test_store_blocks_split_each_trace_id() -> None:
    request = TraceRequest(0, 1000, 1, (7, 3))
    assert chains([request], 256) == [[14, 15, 6, 7]]
    assert chains([request]) == [(7, 3)]
    with pytest.raises(InvalidArgumentError, match="block_tokens: got 100"):
        chains([request], 100)


def test_unchained_keys_and_an_empty_cache_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="block 2 follows 3, but followed 1"):
        simulate([[1, 2], [3, 2]], 4, LRU())
    with pytest.raises(InvalidArgumentError, match="block 2 follows None, but followed 1"):
        simulate([[1, 2], [2]], 4, LRU())
    with pytest.raises(InvalidArgumentError, match="capacity: got 0"):
        LeafCache(0, LRU())


@st.composite
def chained_traces(draw: st.DrawFn, max_requests: int = 8) -> list[list[int]]:
    """Requests that each extend a prefix of an earlier one with fresh keys."""
    trace: list[list[int]] = []
    fresh = 0
    for _ in range(draw(st.integers(1, max_requests))):
        prefix: list[int] = []
        shares = draw(st.booleans())
        if trace and shares:
            earlier = draw(st.sampled_from(trace))
            prefix = earlier[: draw(st.integers(0, len(earlier)))]
        grow = draw(st.integers(0 if prefix else 1, 3))
        trace.append(prefix + list(range(fresh, fresh + grow)))
        fresh += grow
    return trace


def optimum(trace: Sequence[Chain], capacity: int) -> int:
    """The most hits any sequence of leaf evictions gets (exhaustive search)."""
    parent = {b: a for chain in trace for a, b in zip([None, *chain[:-1]], chain, strict=True)}

    @functools.cache
    def after(i: int, cached: frozenset[int]) -> int:
        if i == len(trace):
            return 0
        hits = 0
        while hits < len(trace[i]) and trace[i][hits] in cached:
            hits += 1
        return hits + insert(i, hits, cached)

    @functools.cache
    def insert(i: int, k: int, cached: frozenset[int]) -> int:
        chain = trace[i]
        if k == len(chain):
            return after(i + 1, cached)
        if len(cached) < capacity:
            return insert(i, k + 1, cached | {chain[k]})
        parents = {parent[b] for b in cached}
        victims = [b for b in cached if b not in parents and b not in chain[:k]]
        if not victims:
            return after(i + 1, cached)
        return max(insert(i, k + 1, (cached - {v}) | {chain[k]}) for v in victims)

    return after(0, frozenset())


@settings(max_examples=300, deadline=None)
@given(trace=chained_traces(), capacity=st.integers(1, 6))
def test_furthest_matches_an_exhaustive_search(trace: list[list[int]], capacity: int) -> None:
    assert simulate(trace, capacity, Furthest(trace)).hits == optimum(trace, capacity)


@settings(max_examples=200, deadline=None)
@given(trace=chained_traces(12), capacity=st.integers(1, 12))
def test_every_policy_stays_between_nothing_and_the_furthest_leaf(
    trace: list[list[int]], capacity: int
) -> None:
    unique = len({b for chain in trace for b in chain})
    requests = [TraceRequest(i, 512 * len(c), 1, tuple(c)) for i, c in enumerate(trace)]
    infinite = ceiling(requests).prefix_hits
    best = simulate(trace, capacity, Furthest(trace)).hits
    assert best <= infinite
    for name, make in POLICIES.items():
        hits = simulate(trace, capacity, make(trace, capacity)).hits  # checks the cache
        assert 0 <= hits <= best, name
        assert simulate(trace, unique, make(trace, unique)).hits == infinite, name


class Scanned:
    """`inner`'s eviction order, its victim found by scanning every cached leaf for the least
    `(key, block)`: what `KeyedLeaves`' lazy heap must pick, whichever entries it keeps."""

    def __init__(self, inner: KeyedLeaves) -> None:
        self.inner = inner

    def begin(self, index: int) -> None:
        self.inner.begin(index)

    def hit(self, block: int) -> None:
        self.inner.hit(block)

    def insert(self, block: int) -> None:
        self.inner.insert(block)

    def leaf(self, block: int) -> None:
        self.inner.leaf(block)

    def evicted(self, block: int) -> None:
        self.inner.evicted(block)

    def victim(self, cache: LeafCache) -> int | None:
        leaves = [(self.inner.key(b), b) for b in cache.children if cache.evictable(b)]
        return min(leaves)[1] if leaves else None


KEYED: dict[str, Callable[[Sequence[Chain]], KeyedLeaves]] = {
    "lru": lambda trace: LRU(),
    "lru-2": lambda trace: LRU2(),
    "furthest": Furthest,
    "lookahead-2": lambda trace: Lookahead(trace, 2),
}


@settings(max_examples=200, deadline=None)
@given(trace=chained_traces(12), capacity=st.integers(1, 8))
def test_the_lazy_heap_picks_the_least_leaf(trace: list[list[int]], capacity: int) -> None:
    for name, make in KEYED.items():
        heap, scan = LeafCache(capacity, make(trace)), LeafCache(capacity, Scanned(make(trace)))
        assert served(heap, trace) == served(scan, trace), name
        assert heap.children == scan.children, name


@pytest.mark.skipif(not TRACE.exists(), reason=f"no trace at {TRACE}")
def test_lru_on_the_first_requests_of_the_real_trace() -> None:
    requests = read_trace(TRACE, limit=2000)
    trace = chains(requests)
    unique = ceiling(requests).unique_blocks
    lru = simulate(trace, unique // 20, LRU())
    best = simulate(trace, unique // 20, Furthest(trace))
    assert 0 < lru.hits < best.hits <= ceiling(requests).prefix_hits
    assert simulate(trace, unique, LRU()).hits == ceiling(requests).prefix_hits
