"""`SlotAllocator`: the slot bookkeeping every tier shares (memory pools and the disk tier).

Slot ids are `0 .. num_slots - 1`. A free list used as a stack plus an `allocated` bitmap:

    free     = [3, 2, 1, 0]      top of the stack is the end; a fresh tier hands out 0, 1, 2, ...
    allocate(2) -> [0, 1]        free = [3, 2]
    free([1])                    free = [3, 2, 1]        (freed slots are reused last-in first-out)
    allocate(1) -> [1]

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
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pops 0, 1, 2, ...
        self._allocated = bytearray(num_slots)
        self._num_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_used

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free slots and return their ids; `CapacityError` (no change) if short."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} slots, expected n >= 0")
        if n > len(self._free):
            raise CapacityError(
                f"{self.name}: cannot allocate {n} slots, "
                f"only {len(self._free)} of {self.num_slots} free"
            )
        if n == 0:
            return []
        slots = self._free[-n:]
        del self._free[-n:]
        slots.reverse()  # the order in which popping one at a time would return them
        for slot in slots:
            self._allocated[slot] = 1
        self._num_used += n
        return slots

    def free(self, slots: Sequence[int]) -> None:
        """Return `slots`; all are validated first, so a bad call frees nothing."""
        self.validate(slots, "free")
        for slot in slots:
            self._allocated[slot] = 0
            self._free.append(slot)
        self._num_used -= len(slots)

    def claim(self, slots: Iterable[int]) -> None:
        """Mark free slots as allocated (recovery hands back the slots it keeps)."""
        keep = set(slots)
        for slot in keep:
            if not 0 <= slot < self.num_slots or self._allocated[slot]:
                raise InvariantError(f"{self.name}: cannot claim slot {slot}")
            self._allocated[slot] = 1
        self._free = [slot for slot in self._free if slot not in keep]
        self._num_used += len(keep)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and self._allocated[slot] == 1

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
        """Free list, bitmap and count agree; `InvariantError` with the numbers if not."""
        seen = bytearray(self.num_slots)
        for slot in self._free:
            if not 0 <= slot < self.num_slots:
                raise InvariantError(
                    f"{self.name}: free list holds slot {slot}, outside [0, {self.num_slots})"
                )
            if seen[slot]:
                raise InvariantError(
                    f"{self.name}: slot {slot} is {self._free.count(slot)} times "
                    f"in the free list of {len(self._free)}"
                )
            seen[slot] = 1
            if self._allocated[slot]:
                raise InvariantError(
                    f"{self.name}: slot {slot} is in the free list and marked allocated"
                )
        allocated = self._allocated.count(1)
        if len(self._free) + allocated != self.num_slots or allocated != self._num_used:
            raise InvariantError(
                f"{self.name}: {len(self._free)} free + {allocated} allocated in bitmap "
                f"!= {self.num_slots} slots, or bitmap {allocated} != num_used {self._num_used}"
            )
