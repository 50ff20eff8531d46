"""Slots: a memory tier's pool of equal slots (the bookkeeping is `slots.SlotAllocator`).

`SlotPool`: a tier's memory as `num_slots` equal slots of one block each.

The buffer is block-major and contiguous, so one slot is one block and moves as one copy:

    buffer = [num_slots, num_layers, 2, block_tokens, num_kv_heads, head_dim]   (layout.dtype)
              ^ slot id

Bookkeeping is a `SlotAllocator` (`slots.py`): a stack of freed slots over the fresh ones,
and an allocated bitmap; a fresh pool hands out 0, 1, 2, ... and freed slots are reused
last-in first-out.

Contract:
- `allocate` and `free` are O(1) per slot and check everything before they change anything: an
  allocation beyond `num_free` raises `CapacityError`, a bad `free` raises `InvariantError`, and
  in both cases the pool is exactly as it was.
- `write` and `read` touch only allocated slots; `write` takes exactly
  `[len(slots), *layout.block_shape]` of `layout.dtype` (else `InvalidKVError`, nothing written).
- Accounting is exact: `used_bytes == num_used * slot_bytes <= capacity_bytes`, and `check()`
  verifies it against the free list and the bitmap (DESIGN.md invariant 5). A slot is one block
  (`slot_bytes == block_bytes`) but in a pool that keeps its blocks quantized (`QuantPool`,
  `tiers/quantized.py`: a slot is the codec's payload).
- The pool never decides what to evict; that is the index's business.
- A buffer the machine cannot allocate (out of memory or address space) is a `ConfigError`
  naming `tiers.<name>.capacity`, raised before anything is kept.
- After `close()` the buffer is dropped and every method but `close` raises `ClosedError`.
- A pool in POSIX shared memory (`shared_name`, `tiers/shm.py`) unlinks its segment at `close`,
  or failing that when it is collected or the interpreter exits (a SIGKILL leaves it behind for
  the next `kvtier serve` to sweep); only in the process that created it, never in a forked
  child.

Subclasses choose the device and the memory behind the buffer (`_allocate_buffer`).
"""

from __future__ import annotations

import array
import contextlib
import errno
import math
import mmap
import os
import weakref
from collections.abc import Sequence
from typing import TypeVar

import torch

from kvtier.blocks import KVLayout
from kvtier.errors import ClosedError, ConfigError, InvalidKVError, InvariantError
from kvtier.kernels.block_copy import copy_blocks_slices
from kvtier.kernels.staged import as_words
from kvtier.tiers.shm import SHM_DIR, create_shared
from kvtier.tiers.slots import SlotAllocator

_Pool = TypeVar("_Pool", bound="SlotPool")

_NO_ROOM = (errno.ENOMEM, errno.EFBIG, errno.ENOSPC)
"""What a buffer too large for the machine fails with: a capacity error of the config."""


def _huge_pages(mapping: mmap.mmap) -> None:
    """Ask the kernel to back `mapping` with 2 MiB transparent huge pages (MADV_HUGEPAGE).

    A block copy walks megabytes of a pool: in 4 KiB pages it takes a TLB entry per page, and
    evicts the entries of everything else, so the Python that follows a copy runs with cold
    TLBs (the cost of a 16 MiB load besides its copy, issue 19; in a VM each miss is a
    two-level page walk). Huge pages take 512 times fewer entries: loads and stores of 16 MiB
    ran 0.01-0.1 closer to a raw copy (`benchmarks/RESULTS.md`). A fresh pool hands out slot
    0 first, so memory is touched densely, and the 2 MiB grain commits at most one huge page
    beyond what was written. Advice only: where THP is off (`/sys/kernel/mm/transparent_hugepage/
    enabled` is `never`, the operator's switch) or /dev/shm is mounted without `huge=`, pages
    stay 4 KiB, and a kernel without THP (EINVAL) changes nothing."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None:
        with contextlib.suppress(OSError):
            mapping.madvise(advice)


def _unlink_segment(name: str, creator: int) -> None:
    """Unlink /dev/shm/`name`, in process `creator` only: a forked child that inherited the
    pool (and its finalizer) exits without taking the segment from its parent."""
    if os.getpid() != creator:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


class SlotPool:
    """`num_slots` block-sized slots on one device, with O(1) allocate/free and exact accounting."""

    MIN_SLOTS = 1  # a tier of no slots is the absent host tier only (`NoHostPool`)

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
        if type(num_slots) is not int or num_slots < self.MIN_SLOTS:
            expected = "a positive integer" if self.MIN_SLOTS else "an integer >= 0"
            raise ConfigError(f"tiers.{name}.num_slots", num_slots, expected)
        self.name = name
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.slot_shape, self.slot_dtype = self._slot_format()
        self.slot_bytes = math.prod(self.slot_shape) * self.slot_dtype.itemsize
        self._mapping: mmap.mmap | None = None  # the memory behind a CPU buffer
        try:
            self._buffer: torch.Tensor | None = self._allocate_buffer()
        except (OSError, OverflowError, RuntimeError) as exc:  # RuntimeError: torch's allocators
            if isinstance(exc, OSError) and exc.errno not in _NO_ROOM:
                raise
            nbytes = num_slots * self.slot_bytes
            raise ConfigError(
                f"tiers.{name}.capacity", nbytes, f"a capacity this machine can allocate ({exc})"
            ) from None
        self._block_shape, self._dtype = self.slot_shape, self.slot_dtype  # read by every write
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

    def _slot_format(self) -> tuple[tuple[int, ...], torch.dtype]:
        """What one slot holds: a block (`layout.block_shape` of `layout.dtype`); a pool that
        keeps blocks encoded overrides it (`QuantPool`: a payload of bytes)."""
        return tuple(self.layout.block_shape), self.layout.dtype

    def _allocate_buffer(self) -> torch.Tensor:
        """The pool's memory, `[num_slots, *slot_shape]`, contiguous; override for other media.

        Called once from `__init__`, after `name`, `layout`, `num_slots`, `device` and
        `pin_memory` are set. Capacity that is never written costs nothing, except in shared
        memory, whose pages are reserved at once (`create_shared`: no SIGBUS). Plain CPU memory
        comes from an anonymous mmap, so that every slot whose size is a multiple of 4 KiB is
        page-aligned and the disk tier can write it with O_DIRECT without a copy (torch's own
        CPU allocator aligns to 64 bytes only); CUDA and pinned memory are page-aligned already.
        The mapping is private (copy-on-write after a fork, like torch's own memory), not the
        MAP_SHARED of Python's default, which a forked child would write into its parent's
        slots through. Both kinds of mapping ask for transparent huge pages (`_huge_pages`).
        """
        nbytes = self.slot_bytes * self.num_slots
        shape = (self.num_slots, *self.slot_shape)
        if self.shared_name is not None:
            self._mapping = create_shared(self.shared_name, nbytes)
            _huge_pages(self._mapping)
            # unlinked at close, or when the pool is collected or the interpreter exits
            self._unlink = weakref.finalize(self, _unlink_segment, self.shared_name, os.getpid())
            flat = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes)
            if self.pin_memory:  # page-locked in place, for asynchronous copies to the GPU
                torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0)  # type: ignore[no-untyped-call]
            return flat.view(self.slot_dtype).view(shape)
        if self.device.type == "cpu" and not self.pin_memory:
            self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
            _huge_pages(self._mapping)
            flat = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes)
            return flat.view(self.slot_dtype).view(shape)
        return torch.empty(
            shape, dtype=self.slot_dtype, device=self.device, pin_memory=self.pin_memory
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
        return self.num_slots * self.slot_bytes

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_used(self) -> int:
        return self._slots.num_used

    @property
    def used_bytes(self) -> int:
        return self._slots.num_used * self.slot_bytes

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

        `blocks` may live on another device, and in any strides (a view of a caller's
        layer-major KV): one pass, no contiguous copy first. Slots that run up one by one (what
        a fresh pool hands out) take one slice copy, checked in C; others, on a CPU pool, one
        slice copy per run of consecutive slots (an indexed copy from a strided source ran at
        half the speed of a flat copy), and on a CUDA pool one indexed copy (one launch).
        """
        self._ensure_open()
        expected_shape = (len(slots), *self._block_shape)
        if blocks.dtype != self._dtype:
            raise InvalidKVError(
                f"pool {self.name!r}: blocks have dtype {blocks.dtype}, expected {self._dtype}"
            )
        if tuple(blocks.shape) != expected_shape:
            raise InvalidKVError(
                f"pool {self.name!r}: blocks have shape {list(blocks.shape)}, "
                f"expected {list(expected_shape)}"
            )
        if slots:
            start, stop = slots[0], slots[0] + len(slots)
            if (
                slots[-1] == stop - 1
                and self._slots.is_allocated_run(start, stop)
                and list(slots) == list(range(start, stop))
            ):
                into, words = self.buffer[start:stop], blocks
                if blocks.device == self.device and self.device.type == "cuda":
                    into, words = as_words(into, blocks)  # a strided copy moves words
                into.copy_(words)
                return
        if self.device.type == "cpu":
            self._validate_allocated(slots, "write to")
            copy_blocks_slices(blocks, self.buffer, range(len(slots)), slots)
            return
        index = self._index(slots, "write to")
        buffer, words = as_words(self.buffer, blocks.to(self.device))
        buffer.index_copy_(0, index, words)

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
        if self.used_bytes != allocated * self.slot_bytes:
            raise InvariantError(
                f"pool {self.name!r}: used_bytes {self.used_bytes} != {allocated} allocated "
                f"* {self.slot_bytes} slot bytes"
            )
        if self.used_bytes > self.capacity_bytes:
            raise InvariantError(
                f"pool {self.name!r}: used_bytes {self.used_bytes} > capacity {self.capacity_bytes}"
            )

    def close(self) -> None:
        """Drop the buffer and its memory (and unlink its shared memory); idempotent. Every
        other method then raises `ClosedError`. The memory goes back once no view of it is left
        (a tensor a caller still holds keeps it; before, the mapping stayed until the pool
        object was collected). A process that mapped the shared memory keeps its mapping."""
        self._buffer = None
        self._mapping = None
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
        if not slots:
            return torch.empty(0, dtype=torch.long, device=self.device)
        # through an int64 array: a third of the time torch.tensor takes for a list of ints
        return torch.frombuffer(array.array("q", slots), dtype=torch.long).to(self.device)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, device={self.device}, "
            f"slots={self.num_used}/{self.num_slots}, block_bytes={self.layout.block_bytes})"
        )
