"""`SlotAllocator`: the slot bookkeeping every tier shares (memory pools and the disk tier).

Slot ids are `0 .. num_slots - 1`. The free slots are a stack of freed ones over the fresh
ones never handed out (`fresh .. num_slots - 1`, handed out in order), plus an `allocated`
bitmap; together they act as one free list whose top is the freed stack's end:

    freed = [], fresh = 0        num_slots 4: free list [3, 2, 1, 0]
    allocate(2) -> [0, 1]        freed = [], fresh = 2          (a fresh tier: 0, 1, 2, ...)
    free([1])                    freed = [1], fresh = 2         (reused last-in first-out)
    allocate(2) -> [1, 2]        freed = [], fresh = 3

A fresh run is one slice of the bitmap, so a new tier's allocations cost no loop per slot.

Contract: `allocate` and `free` are O(1) per slot and check everything before they change
anything: an allocation beyond `num_free` raises `CapacityError`, a bad `free` (out of range,
not allocated, repeated) raises `InvariantError` naming the slot, and in both cases nothing
changed. `check()` verifies free list, bitmap and count against each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.errors import CapacityError, InvariantError


class SlotAllocator:
    def __init__(self, name: str, num_slots: int) -> None:
        self.name = name
        self.num_slots = num_slots
        self._freed: list[int] = []  # the stack's top is the end
        self._fresh = 0  # slots fresh .. num_slots - 1 were never handed out
        self._allocated = bytearray(num_slots)
        self._num_used = 0

    @property
    def num_free(self) -> int:
        return len(self._freed) + self.num_slots - self._fresh

    @property
    def num_used(self) -> int:
        return self._num_used

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` free slots and return their ids; `CapacityError` (no change) if short."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} slots, expected n >= 0")
        if n > self.num_free:
            raise CapacityError(
                f"{self.name}: cannot allocate {n} slots, "
                f"only {self.num_free} of {self.num_slots} free"
            )
        reused = min(n, len(self._freed))
        slots = self._freed[len(self._freed) - reused :]
        del self._freed[len(self._freed) - reused :]
        slots.reverse()  # the order in which popping one at a time would return them
        for slot in slots:
            self._allocated[slot] = 1
        if reused < n:
            start, stop = self._fresh, self._fresh + n - reused
            slots += range(start, stop)
            self._allocated[start:stop] = b"\x01" * (stop - start)
            self._fresh = stop
        self._num_used += n
        return slots

    def free(self, slots: Sequence[int]) -> None:
        """Return `slots`; all are validated first, so a bad call frees nothing. A run of
        consecutive slots in any order (what eviction frees: a node's tail, last block first)
        is checked and cleared in C, with no loop per slot."""
        n = len(slots)
        lo, hi = (min(slots), max(slots) + 1) if n > 1 else (0, 0)
        if (
            hi - lo == n  # n distinct slots spanning n ids are exactly lo .. hi - 1
            and 0 <= lo < hi <= self.num_slots
            and self._allocated.find(0, lo, hi) < 0
            and len(set(slots)) == n
        ):
            self._allocated[lo:hi] = bytes(n)
        else:
            self.validate(slots, "free")
            for slot in slots:
                self._allocated[slot] = 0
        self._freed.extend(slots)
        self._num_used -= n

    def claim(self, slots: Iterable[int]) -> None:
        """Mark free slots as allocated (recovery hands back the slots it keeps)."""
        keep = set(slots)
        for slot in keep:
            if not 0 <= slot < self.num_slots or self._allocated[slot]:
                raise InvariantError(f"{self.name}: cannot claim slot {slot}")
        for slot in keep:
            self._allocated[slot] = 1
        # the fresh slots below the highest claimed one join the bottom of the stack, in the
        # order the free list would have handed them out
        above = max(keep, default=-1) + 1
        if above > self._fresh:
            skipped = range(above - 1, self._fresh - 1, -1)
            self._freed[:0] = [slot for slot in skipped if slot not in keep]
            self._fresh = above
        self._freed = [slot for slot in self._freed if slot not in keep]
        self._num_used += len(keep)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and self._allocated[slot] == 1

    def is_allocated_run(self, start: int, stop: int) -> bool:
        """Whether every slot of `start .. stop - 1` is in range and allocated (in C)."""
        return 0 <= start < stop <= self.num_slots and self._allocated.find(0, start, stop) < 0

    def validate(self, slots: Sequence[int], action: str) -> None:
        """`InvariantError` naming the first slot that is out of range, free or repeated."""
        seen: set[int] = set()
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise InvariantError(
                    f"{self.name}: cannot {action} slot {slot}, outside [0, {self.num_slots})"
                )
            if not self._allocated[slot]:
                raise InvariantError(
                    f"{self.name}: cannot {action} slot {slot}, it is not allocated"
                )
            if slot in seen:
                raise InvariantError(
                    f"{self.name}: cannot {action} slot {slot}, it is repeated in the call"
                )
            seen.add(slot)

    def check(self) -> None:
        """Freed stack, fresh slots, bitmap and count agree; `InvariantError` with the numbers
        if not."""
        seen = bytearray(self.num_slots)
        for slot in self._freed:
            if not 0 <= slot < self._fresh:
                raise InvariantError(
                    f"{self.name}: free list holds slot {slot}, outside [0, {self._fresh}) "
                    f"(slots from {self._fresh} on are fresh)"
                )
            if seen[slot]:
                raise InvariantError(
                    f"{self.name}: slot {slot} is {self._freed.count(slot)} times "
                    f"in the free list of {self.num_free}"
                )
            seen[slot] = 1
            if self._allocated[slot]:
                raise InvariantError(
                    f"{self.name}: slot {slot} is in the free list and marked allocated"
                )
        fresh_taken = self._allocated.find(1, self._fresh)
        if fresh_taken >= 0:
            raise InvariantError(
                f"{self.name}: slot {fresh_taken} is fresh (never handed out) and marked allocated"
            )
        allocated = self._allocated.count(1)
        if self.num_free + allocated != self.num_slots or allocated != self._num_used:
            raise InvariantError(
                f"{self.name}: {self.num_free} free + {allocated} allocated in bitmap "
                f"!= {self.num_slots} slots, or bitmap {allocated} != num_used {self._num_used}"
            )
