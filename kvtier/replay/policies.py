"""Online eviction candidates for the leaf cache of `simulate.py`, and the table of all policies.

Each evicts only leaves the current request does not use (`LeafCache.evictable`):

- `LRU2`: frequency-aware LRU-2 (O'Neil et al.): the leaf whose second-to-last use is oldest
  first (a block used once counts as never, so one-hit blocks go first; ties by last use). The
  history of a block outlives its eviction, so a block that comes back is not a newcomer.
- `Lookahead`: LRU that spares the leaves the next `window` queued requests will use
  (AttentionStore's scheduler-aware eviction): those go only when no other leaf is left.
- `S3FIFO`: S3-FIFO (Yang et al., SOSP'23) on leaves: a small FIFO (10% of the cache) takes
  new blocks, a main FIFO the rest, a ghost FIFO remembers keys evicted from the small one (a
  returning key goes straight to main). A block used again while in the small FIFO moves to
  main when it reaches the head; the main FIFO gives a used block another round (its count,
  capped at 3, goes down by one). A request's new blocks enter deepest first, so the leaf of a
  chain leaves before its parents; a block that is not an evictable leaf when it reaches a
  head goes round again.

`POLICIES` names the online policies for a benchmark: LRU of leaves (`simulate.py`) and these.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence

from kvtier.replay.simulate import LRU, Chain, KeyedLeaves, LeafCache, Policy

NEVER = -1
"""The second-to-last use of a block used once."""


class LRU2(KeyedLeaves):
    """Frequency-aware LRU-2 on leaves (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.uses: dict[int, tuple[int, int]] = {}  # block -> (second-to-last use, last use)

    def used(self, block: int) -> None:
        self.uses[block] = (self.uses.get(block, (NEVER, NEVER))[1], self.index)

    def key(self, block: int) -> tuple[int, ...]:
        return self.uses[block]


class Lookahead(LRU):
    """LRU of leaves sparing those of the next `window` requests (module doc)."""

    def __init__(self, chains: Sequence[Chain], window: int) -> None:
        super().__init__()
        self.chains, self.window = chains, window
        self.pending: Counter[int] = Counter()
        for chain in chains[1 : window + 1]:
            self.pending.update(chain)

    def begin(self, index: int) -> None:
        super().begin(index)
        if index == 0:
            return
        leaving = self.chains[index]  # now served, no longer queued
        arriving = (
            self.chains[index + self.window] if index + self.window < len(self.chains) else ()
        )
        self.pending.subtract(leaving)
        self.pending.update(arriving)
        for block in (*leaving, *arriving):
            if block in self.last:
                self.leaf(block)  # its key may have changed; a stale entry is skipped

    def key(self, block: int) -> tuple[int, ...]:
        return (self.pending[block] > 0, self.last[block])


class S3FIFO:
    """S3-FIFO on leaves (module doc)."""

    def __init__(self, capacity: int) -> None:
        self.small_capacity = max(1, capacity // 10)
        self.ghost_capacity = capacity - self.small_capacity
        self.small: deque[int] = deque()
        self.main: deque[int] = deque()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}
        self.arrived: list[int] = []  # this request's new blocks, queued at the next begin

    def begin(self, index: int) -> None:
        self._enqueue()

    def hit(self, block: int) -> None:
        self.freq[block] = min(3, self.freq[block] + 1)

    def insert(self, block: int) -> None:
        self.freq[block] = 0
        self.arrived.append(block)

    def leaf(self, block: int) -> None:
        """A FIFO keeps its order when a block becomes a leaf."""

    def evicted(self, block: int) -> None:
        del self.freq[block]

    def victim(self, cache: LeafCache) -> int | None:
        first, second = self._from_small, self._from_main
        if len(self.small) < self.small_capacity and self.main:
            first, second = second, first
        # the first queue again: the second may have moved its used blocks into it
        for take in (first, second, first):
            block = take(cache)
            if block is not None:
                return block
        return None

    def _enqueue(self) -> None:
        for block in reversed(self.arrived):
            if block in self.ghost:
                del self.ghost[block]
                self.main.append(block)
            else:
                self.small.append(block)
        self.arrived.clear()

    def _from_small(self, cache: LeafCache) -> int | None:
        for _ in range(len(self.small)):
            block = self.small.popleft()
            if self.freq[block] > 0:
                self.main.append(block)
            elif cache.evictable(block):
                self.ghost[block] = None
                if len(self.ghost) > self.ghost_capacity:
                    self.ghost.popitem(last=False)
                return block
            else:
                self.small.append(block)
        return None

    def _from_main(self, cache: LeafCache) -> int | None:
        for _ in range(4 * len(self.main)):  # a count of 3 takes 3 rounds, then it goes
            block = self.main.popleft()
            if self.freq[block] > 0:
                self.freq[block] -= 1
            elif cache.evictable(block):
                return block
            self.main.append(block)
        return None


PolicyFactory = Callable[[Sequence[Chain], int], Policy]
"""Makes a policy for one run over `chains` with a cache of so many blocks."""

POLICIES: dict[str, PolicyFactory] = {
    "lru": lambda chains, capacity: LRU(),
    "lru-2": lambda chains, capacity: LRU2(),
    "s3-fifo": lambda chains, capacity: S3FIFO(capacity),
    "lookahead-8": lambda chains, capacity: Lookahead(chains, 8),
    "lookahead-64": lambda chains, capacity: Lookahead(chains, 64),
}
"""The online policies by name (`Lookahead` reads only its window of the queue); the offline
`Furthest` is the yardstick above them."""
