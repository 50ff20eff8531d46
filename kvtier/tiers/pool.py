"""Slots: the bookkeeping every tier shares, and a memory tier's pool of equal slots.

`SlotAllocator`: the slot bookkeeping every tier shares (memory pools and the disk tier).

Slot ids are `0 .. num_slots - 1`. A free list used as a stack plus an `allocated` bitmap:

    free     = [3, 2, 1, 0]      top of the stack is the end; a fresh tier hands out 0, 1, 2, ...
    allocate(2) -> [0, 1]        free = [3, 2]
    free([1])                    free = [3, 2, 1]        (freed slots are reused last-in first-out)
    allocate(1) -> [1]

Contract: `allocate` and `free` are O(1) per slot and check everything before they change
anything: an allocation beyond `num_free` raises `CapacityError`, a bad `free` (out of range,
not allocated, repeated) raises `InvariantError` naming the slot, and in both cases nothing
changed. `check()` verifies free list, bitmap and count against each other.

`SlotPool`: a tier's memory as `num_slots` equal slots of one block each.

The buffer is block-major and contiguous, so one slot is one block and moves as one copy:

    buffer = [num_slots, num_layers, 2, block_tokens, num_kv_heads, head_dim]   (layout.dtype)
              ^ slot id

Bookkeeping is a `SlotAllocator` (below): a free-list stack and an allocated bitmap; a fresh
pool hands out 0, 1, 2, ... and freed slots are reused last-in first-out.

Contract:
- `allocate` and `free` are O(1) per slot and check everything before they change anything: an
  allocation beyond `num_free` raises `CapacityError`, a bad `free` raises `InvariantError`, and
  in both cases the pool is exactly as it was.
- `write` and `read` touch only allocated slots; `write` takes exactly
  `[len(slots), *layout.block_shape]` of `layout.dtype` (else `InvalidKVError`, nothing written).
- Accounting is exact: `used_bytes == num_used * block_bytes <= capacity_bytes`, and `check()`
  verifies it against the free list and the bitmap (DESIGN.md invariant 5).
- The pool never decides what to evict; that is the index's business.
- After `close()` the buffer is dropped and every method but `close` raises `ClosedError`.
- A pool in POSIX shared memory (`shared_name`, `tiers/shm.py`) unlinks its segment at `close`,
  or failing that when it is collected or the interpreter exits (a SIGKILL leaves it behind for
  the next `kvtier serve` to sweep).

Subclasses choose the device and the memory behind the buffer (`_allocate_buffer`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import weakref
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch

from kvtier.blocks import KVLayout
from kvtier.errors import CapacityError, ClosedError, ConfigError, InvalidKVError, InvariantError
from kvtier.tiers.shm import SHM_DIR, create_shared


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


_Pool = TypeVar("_Pool", bound="SlotPool")


def _unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


class SlotPool:
    """`num_slots` block-sized slots on one device, with O(1) allocate/free and exact accounting."""

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        num_slots: int,
        device: torch.device,
        pin_memory: bool = False,
        shared_name: str | None = None,
    ) -> None:
        """`shared_name`: place a CPU buffer in POSIX shared memory under /dev/shm with this
        name (created with mode 0600, unlinked at `close`), so that another process of the same
        user can map it (`map_shared`): the sidecar's zero-copy data plane."""
        if shared_name is not None and device.type != "cpu":
            raise ConfigError(f"tiers.{name}.shared", shared_name, "a pool in CPU memory")
        self.shared_name = shared_name
        if type(num_slots) is not int or num_slots < 1:
            raise ConfigError(f"tiers.{name}.num_slots", num_slots, "a positive integer")
        self.name = name
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self._buffer: torch.Tensor | None = self._allocate_buffer()
        # Pushed in reverse so that the stack pops 0, 1, 2, ...
        self._slots = SlotAllocator(f"pool {name!r}", num_slots)

    @classmethod
    def with_capacity(
        cls: type[_Pool],
        name: str,
        layout: KVLayout,
        capacity_bytes: int,
        device: torch.device,
        pin_memory: bool = False,
        shared_name: str | None = None,
    ) -> _Pool:
        """A pool of `capacity_bytes // layout.block_bytes` slots; the remainder is not used."""
        num_slots = capacity_bytes // layout.block_bytes
        if num_slots < 1:
            raise ConfigError(
                f"tiers.{name}.capacity",
                capacity_bytes,
                f"at least one block of {layout.block_bytes} bytes",
            )
        return cls(name, layout, num_slots, device, pin_memory, shared_name)

    def _allocate_buffer(self) -> torch.Tensor:
        """The pool's memory, `layout.pool_shape(num_slots)`, contiguous; override for other media.

        Called once from `__init__`, after `name`, `layout`, `num_slots`, `device` and
        `pin_memory` are set. Capacity that is never written costs nothing. Plain CPU memory
        comes from an anonymous mmap, so that every slot whose size is a multiple of 4 KiB is
        page-aligned and the disk tier can write it with O_DIRECT without a copy (torch's own
        CPU allocator aligns to 64 bytes only); CUDA and pinned memory are page-aligned already.
        """
        nbytes = self.layout.block_bytes * self.num_slots
        if self.shared_name is not None:
            self._mapping = create_shared(self.shared_name, nbytes)
            # unlinked at close, or when the pool is collected or the interpreter exits
            self._unlink = weakref.finalize(self, _unlink_segment, self.shared_name)
            flat = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes)
            if self.pin_memory:  # page-locked in place, for asynchronous copies to the GPU
                torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0)  # type: ignore[no-untyped-call]
            return flat.view(self.layout.dtype).view(self.layout.pool_shape(self.num_slots))
        if self.device.type == "cpu" and not self.pin_memory:
            self._mapping = mmap.mmap(-1, nbytes)
            flat = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes)
            return flat.view(self.layout.dtype).view(self.layout.pool_shape(self.num_slots))
        return torch.empty(
            self.layout.pool_shape(self.num_slots),
            dtype=self.layout.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
        )

    # -- accounting -------------------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            raise ClosedError(f"pool {self.name!r} is closed")
        return self._buffer

    @property
    def closed(self) -> bool:
        return self._buffer is None

    @property
    def location(self) -> str:
        return str(self.device)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.block_bytes

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_used(self) -> int:
        return self._slots.num_used

    @property
    def used_bytes(self) -> int:
        return self._slots.num_used * self.layout.block_bytes

    # -- slots ------------------------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        self._ensure_open()
        return self._slots.can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free slots and return their ids; raises `CapacityError` (no change) if short."""
        self._ensure_open()
        return self._slots.allocate(n)

    def free(self, slots: Sequence[int]) -> None:
        """Return `slots` to the pool; all are validated first, so a bad call frees nothing."""
        self._ensure_open()
        self._slots.free(slots)

    def is_allocated(self, slot: int) -> bool:
        self._ensure_open()
        return self._slots.is_allocated(slot)

    # -- data -------------------------------------------------------------------------------

    def write(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Copy `blocks[i]` into slot `slots[i]`, in one copy; checks everything before writing.

        `blocks` may live on another device; it is moved to the pool's device first.
        """
        self._ensure_open()
        expected_shape = (len(slots), *self.layout.block_shape)
        if blocks.dtype != self.layout.dtype:
            raise InvalidKVError(
                f"pool {self.name!r}: blocks have dtype {blocks.dtype}, "
                f"expected {self.layout.dtype}"
            )
        if tuple(blocks.shape) != expected_shape:
            raise InvalidKVError(
                f"pool {self.name!r}: blocks have shape {list(blocks.shape)}, "
                f"expected {list(expected_shape)}"
            )
        index = self._index(slots, "write to")
        self.buffer.index_copy_(0, index, blocks.to(self.device))

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        """A new tensor `[len(slots), *block_shape]` on the pool's device, copied from `slots`.

        Slots must be allocated and distinct (`InvariantError` otherwise).
        """
        index = self._index(slots, "read")
        return self.buffer.index_select(0, index)

    def block(self, slot: int) -> torch.Tensor:
        """A view of one allocated slot, `block_shape`, no copy; valid until the slot is freed."""
        self._validate_allocated([slot], "view")
        return self.buffer[slot]

    # -- integrity --------------------------------------------------------------------------

    def check(self) -> None:
        """Verify that free list, bitmap and byte accounting agree; `InvariantError` if not."""
        self._ensure_open()
        self._slots.check()
        allocated = self._slots.num_used
        if self.used_bytes != allocated * self.layout.block_bytes:
            raise InvariantError(
                f"pool {self.name!r}: used_bytes {self.used_bytes} != {allocated} allocated "
                f"* {self.layout.block_bytes} block bytes"
            )
        if self.used_bytes > self.capacity_bytes:
            raise InvariantError(
                f"pool {self.name!r}: used_bytes {self.used_bytes} > capacity {self.capacity_bytes}"
            )

    def close(self) -> None:
        """Drop the buffer (and unlink its shared memory); idempotent. Every other method then
        raises `ClosedError`. A process that mapped the shared memory keeps its mapping."""
        self._buffer = None
        if self.shared_name is not None:
            self._unlink()

    # -- helpers ----------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._buffer is None:
            raise ClosedError(f"pool {self.name!r} is closed")

    def _validate_allocated(self, slots: Sequence[int], action: str) -> None:
        """Raise `InvariantError` naming the first slot that is out of range, free or repeated."""
        self._ensure_open()
        self._slots.validate(slots, action)

    def _index(self, slots: Sequence[int], action: str) -> torch.Tensor:
        self._validate_allocated(slots, action)
        return torch.tensor(list(slots), dtype=torch.long, device=self.device)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, device={self.device}, "
            f"slots={self.num_used}/{self.num_slots}, block_bytes={self.layout.block_bytes})"
        )
