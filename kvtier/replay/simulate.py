"""Exact simulations of one prefix cache on a trace's block stream: the yardsticks of a replay.

The model is the replay's without tiers, mover or watermarks:

- A request is a chain of block keys (`chains`): the trace's hash ids (512-token blocks), or
  each id split into `512 / block_tokens` store blocks. Keys are chained: a key names its whole
  prefix, so every key has one parent (the key before it; none for the first).
- The cache holds at most `capacity` blocks, always a prefix-closed set: a block is cached
  only with every block before it in its chain.
- Per request: hit = the longest cached prefix of its chain; the hit uses exactly those
  blocks. Then the missing blocks are inserted in chain order; while the cache is full, the
  policy picks a victim among the LEAVES (cached blocks that no cached block extends) that
  the request does not use, and it is evicted. When every leaf is in use, the rest of the
  request is not cached.

    cached: a -> b, a -> x      request [a, b, c, d]: hit 2 (a, b: refreshed, in use),
    (leaves b, x)               insert c, d: leaves x, d (x is the only possible victim)

`LeafCache` keeps the tree and the in-use marks; a `Policy` keeps only its eviction order and
is told every hit, insertion, new leaf and eviction. Policies here: `LRU` (least recently used
leaf; a hit refreshes exactly the blocks it used) and `Furthest` (Belady on leaves, offline);
online candidates are in `policies.py`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.errors import InvalidArgumentError, shown
from kvtier.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest

Chain = Sequence[int]
"""The block keys of one request, in order."""


def chains(requests: Sequence[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS) -> list[Chain]:
    """The block keys of each request in store blocks of `block_tokens` (a divisor of the
    trace's block B, 512 in Mooncake's traces): trace id `h` becomes keys `h * k + j` for
    `j < k = B / block_tokens`, still chained."""
    trace_bt = requests[0].block_tokens if requests else TRACE_BLOCK_TOKENS
    if block_tokens < 1 or trace_bt % block_tokens:
        raise InvalidArgumentError(
            f"block_tokens: got {shown(block_tokens)}, expected a divisor of the trace's block "
            f"({trace_bt})"
        )
    k = trace_bt // block_tokens
    if k == 1:
        return [r.hash_ids for r in requests]
    return [[h * k + j for h in r.hash_ids for j in range(k)] for r in requests]


class Policy(Protocol):
    """An eviction order over a `LeafCache`'s blocks. The cache calls, per request `index`:
    `begin(index)`, `hit(b)` for each block the hit uses, then `insert(b)` for each new block,
    `leaf(b)` when a block's last cached child is evicted, and `evicted(b)`; `victim(cache)`
    returns a leaf that `cache.evictable` accepts, or None when there is none."""

    def begin(self, index: int) -> None: ...
    def hit(self, block: int) -> None: ...
    def insert(self, block: int) -> None: ...
    def leaf(self, block: int) -> None: ...
    def evicted(self, block: int) -> None: ...
    def victim(self, cache: LeafCache) -> int | None: ...


class LeafCache:
    """A prefix-closed cache of `capacity` blocks (module doc) whose victims `policy` picks."""

    def __init__(self, capacity: int, policy: Policy) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"capacity: got {shown(capacity)}, expected >= 1 block")
        self.capacity = capacity
        self.policy = policy
        self.index = -1
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}  # cached block -> its cached children
        self.used_at: dict[int, int] = {}  # cached block -> the last request that used it

    def evictable(self, block: int) -> bool:
        """Cached, a leaf, and not used by the current request."""
        return self.children.get(block) == 0 and self.used_at[block] != self.index

    def request(self, chain: Chain) -> int:
        """Serve one request (module doc); returns its hit blocks."""
        self.index += 1
        policy, children, used_at, now = self.policy, self.children, self.used_at, self.index
        parent = self.parent
        policy.begin(now)
        hits = 0
        previous: int | None = None
        for block in chain:
            if block not in children:
                break
            if parent.setdefault(block, previous) != previous:
                self._unchained(block, previous)
            used_at[block] = now
            policy.hit(block)
            hits += 1
            previous = block
        for block in chain[hits:]:
            if parent.setdefault(block, previous) != previous:
                self._unchained(block, previous)
            while len(children) >= self.capacity:
                victim = policy.victim(self)
                if victim is None:
                    return hits
                self._evict(victim)
            children[block] = 0
            used_at[block] = now
            if previous is not None:
                children[previous] += 1
            policy.insert(block)
            previous = block
        return hits

    def _unchained(self, block: int, previous: int | None) -> None:
        """Raise: `block` follows `previous` now but another block before (`request` learns
        every block's parent on its first reference)."""
        raise InvalidArgumentError(
            f"request {self.index}: block {block} follows {previous}, but followed "
            f"{self.parent[block]} before; expected chained keys (module doc)"
        )

    def _evict(self, block: int) -> None:
        assert self.evictable(block), f"victim {block} is not an unused cached leaf"
        del self.children[block], self.used_at[block]
        parent = self.parent[block]
        if parent is not None:
            self.children[parent] -= 1
            if self.children[parent] == 0:
                self.policy.leaf(parent)
        self.policy.evicted(block)

    def check(self) -> None:
        """The cache is within capacity, prefix-closed, and its child counts are exact."""
        assert len(self.children) <= self.capacity, (len(self.children), self.capacity)
        counted = dict.fromkeys(self.children, 0)
        for block in self.children:
            parent = self.parent[block]
            if parent is not None:
                assert parent in counted, f"cached block {block} without its parent {parent}"
                counted[parent] += 1
        assert counted == self.children, "child counts drifted"


class KeyedLeaves:
    """A policy whose victim is the evictable leaf of smallest `(key(block), block)` (a heap
    with lazy deletion: an entry is stale when its block is no longer a leaf or its key
    changed). Subclasses keep their state for every block ever seen, so `key` never fails, and
    a block's key changes only when it is used or when the subclass pushes it again (`leaf`).

    Entries are pushed only for blocks that can be victims. The blocks a request uses are all
    in use until it ends, so none needs an entry before then; when it ends, they are one path
    whose deepest block is the only one that can be a leaf. So a request's blocks give one
    entry, that block's, pushed when the next request begins; a block that becomes a leaf
    later is pushed then (`leaf`). The valid entries at every `victim` call are those of
    pushing every use (as a plain lazy heap would), so the victims are the same."""

    def __init__(self) -> None:
        self.heap: list[tuple[tuple[int, ...], int]] = []
        self.index = -1
        self.deepest: int | None = None  # the last block the current request used

    def key(self, block: int) -> tuple[int, ...]:
        raise NotImplementedError

    def used(self, block: int) -> None:
        """A block was used by the current request (hit or inserted): update its state."""
        raise NotImplementedError

    def begin(self, index: int) -> None:
        if self.deepest is not None:
            self.leaf(self.deepest)
            self.deepest = None
        self.index = index

    def hit(self, block: int) -> None:
        self.used(block)
        self.deepest = block

    def insert(self, block: int) -> None:
        self.hit(block)

    def leaf(self, block: int) -> None:
        heapq.heappush(self.heap, (self.key(block), block))

    def evicted(self, block: int) -> None:
        """Nothing to forget: the block's entries went stale."""

    def victim(self, cache: LeafCache) -> int | None:
        heap, in_use = self.heap, []
        found = None
        while heap:
            key, block = heapq.heappop(heap)
            if cache.children.get(block) != 0 or key != self.key(block):
                continue
            if cache.used_at[block] == cache.index:
                in_use.append((key, block))
                continue
            found = block
            break
        for entry in in_use:
            heapq.heappush(heap, entry)
        return found


class LRU(KeyedLeaves):
    """The least recently used leaf first; a hit refreshes exactly the blocks it used."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[int, int] = {}

    def used(self, block: int) -> None:
        self.last[block] = self.index

    def key(self, block: int) -> tuple[int, ...]:
        return (self.last[block],)


class Furthest(LRU):
    """Belady on leaves (offline): the leaf whose next use is furthest in the future first
    (never again counts as furthest; ties by LRU). With chained keys a block's next use is
    never earlier than its parent's, so the furthest block can always be found among the
    leaves and the cache stays prefix-closed, the case where Belady's exchange argument
    carries over; but every missing block is inserted (no bypass) and that argument is not
    written out here, so read this as a strong planner's headroom, not a proven optimum."""

    def __init__(self, chains: Sequence[Chain]) -> None:
        super().__init__()
        self.chains = chains
        never = len(chains)
        seen: dict[int, int] = {}
        self.after: list[list[int]] = [[] for _ in chains]
        for index in range(len(chains) - 1, -1, -1):
            self.after[index] = [seen.get(block, never) for block in chains[index]]
            for block in chains[index]:
                seen[block] = index
        self.next_use: dict[int, int] = {}
        self.current: dict[int, int] = {}

    def begin(self, index: int) -> None:
        super().begin(index)
        self.current = dict(zip(self.chains[index], self.after[index], strict=True))

    def used(self, block: int) -> None:
        super().used(block)
        self.next_use[block] = self.current[block]

    def key(self, block: int) -> tuple[int, ...]:
        return (-self.next_use[block], self.last[block])


@dataclass(frozen=True)
class SimResult:
    """The blocks one simulation served: `hits` of `references` block references."""

    capacity: int
    requests: int
    references: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.references if self.references else 0.0


def simulate(chains: Sequence[Chain], capacity: int, policy: Policy) -> SimResult:
    """Replay `chains` through a fresh `LeafCache` of `capacity` blocks evicting by `policy`
    (a policy serves one run: `LRU()`, `Furthest(chains)`, ...)."""
    cache = LeafCache(capacity, policy)
    hits = sum(cache.request(chain) for chain in chains)
    cache.check()
    return SimResult(capacity, len(chains), sum(len(c) for c in chains), hits)
