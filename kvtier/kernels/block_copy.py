"""Copying a list of whole blocks from slots of one pool buffer to slots of another.

    src buffer [slots, *block_shape]            dst buffer [slots, *block_shape]
    slot src_slots[i]  ───── block i ─────►     slot dst_slots[i]          for i < n

A pool buffer is block-major and contiguous (`tiers/pool.py`), so block i is the `block_bytes`
bytes at `base + slot * block_bytes`. Three strategies copy them, each a `CopyStrategy`:

- `slices`: one `copy_` per run of slots consecutive on both sides (`contiguous_runs`), so blocks
  allocated together move as one large copy, and scattered ones as one copy each; between a
  CUDA buffer and a strided host view (a caller's layer-major tensor) through a device stage
  instead, one memcpy per contiguous piece of host memory (`staged.py`).
- `gather`: `index_select` of the source slots into one temporary on the source device, moved to
  the destination device, then `index_copy_`: every byte is copied twice, in a few launches
  (the kernel's plain-torch reference). It moves the values' bits as integers of the same width
  (`as_bits`): any dtype bit for bit, fp8 included (torch's CPU `index_copy_` has none).
- `kernel`: `BLOCK_COPY_CUDA`, one launch for all n blocks, through CuPy. Grid (n, chunks):
  `blockIdx.x` is the block, `blockIdx.y` a chunk of it, and the threads of all chunks stride
  over the block in units of 16 bytes (`int4`) when `block_bytes` and both base addresses are
  multiples of 16, else of the widest of 8, 4, 2, 1 bytes that divides all three. One side may
  be pinned host memory, which the GPU reads and writes through unified addressing (a pointer
  into pinned memory is valid on the device); pageable host memory, and two CUDA buffers on
  different devices, are refused (`InvalidArgumentError`).

Every strategy checks its slots before it copies anything, and refuses the same ones
(`InvalidArgumentError`): one destination per source (`check_counts`), every slot an integer
in range, no destination named twice; `slices` by its runs (`check_runs`: a slice past the end
is a shorter view, a negative start another slot, a bool slot 1, a repeat a second write),
`gather` and `kernel` slot by slot (`check_slots`).

Every strategy returns with its copy as complete as `Tensor.copy_` leaves one: done when host
memory takes part, enqueued on the current stream between two CUDA buffers. `copy_blocks_kernel`
itself only enqueues (as `copy_(non_blocking=True)`): the `kernel` strategy adds the wait.
CuPy is imported only for a kernel copy or `kernel_available()`: this module and its torch
strategies run without CUDA or CuPy. Which strategy is fastest depends on the memories, the
block size and the scatter: `transfer/planner.py` measures them.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidArgumentError
from kvtier.kernels import staged
from kvtier.kernels.slots import Run, check_counts, check_runs, check_slots, int_arrays, slot_number

BLOCK_COPY_CUDA = r"""
template <typename T>
__device__ void copy_blocks(unsigned long long src, unsigned long long dst,
                            const long long* src_slots, const long long* dst_slots,
                            long long block_units) {
    const T* from = reinterpret_cast<const T*>(src) + src_slots[blockIdx.x] * block_units;
    T* to = reinterpret_cast<T*>(dst) + dst_slots[blockIdx.x] * block_units;
    const long long stride = (long long)gridDim.y * blockDim.x;
    for (long long u = (long long)blockIdx.y * blockDim.x + threadIdx.x; u < block_units;
         u += stride) {
        to[u] = from[u];
    }
}

#define KVTIER_COPY_BLOCKS(BYTES, T)                                                      \
    extern "C" __global__ void kvtier_copy_blocks_##BYTES(                               \
        unsigned long long src, unsigned long long dst, unsigned long long src_slots,   \
        unsigned long long dst_slots, long long block_units) {                          \
        copy_blocks<T>(src, dst, reinterpret_cast<const long long*>(src_slots),         \
                       reinterpret_cast<const long long*>(dst_slots), block_units);     \
    }

KVTIER_COPY_BLOCKS(16, int4)
KVTIER_COPY_BLOCKS(8, long long)
KVTIER_COPY_BLOCKS(4, int)
KVTIER_COPY_BLOCKS(2, short)
KVTIER_COPY_BLOCKS(1, char)
"""
"""CUDA C: `kvtier_copy_blocks_<unit>(src, dst, src_slots, dst_slots, block_units)` copies block
`src_slots[blockIdx.x]` to block `dst_slots[blockIdx.x]`, `block_units` units of `unit` bytes
each; addresses are passed as integers, slot ids as device arrays of int64."""

KERNEL_UNITS = (16, 8, 4, 2, 1)
"""Access widths in bytes, one kernel each, widest first."""

THREADS = 256
UNITS_PER_THREAD = 4  # per chunk: enough chunks that every block is spread over many SMs
MAX_CHUNKS = 65535  # gridDim.y's limit; beyond it the threads stride further

LONG = 64
"""Slot lists at least this long find their runs with NumPy (a pass in C) rather than a loop."""


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """(src_start, dst_start, length) runs where both sides advance by one slot together."""
    if len(src) and _one_run(src) and _one_run(dst) and len(src) == len(dst):
        return [(src[0], dst[0], len(src))]  # the common case: blocks stored together
    if len(src) >= LONG and (arrays := int_arrays(src, dst)) is not None:
        froms, tos = arrays
        breaks = np.flatnonzero((np.diff(froms) != 1) | (np.diff(tos) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [len(froms)])))
        firsts = zip(froms[starts].tolist(), tos[starts].tolist(), lengths.tolist(), strict=True)
        return list(firsts)
    runs: list[Run] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            start_s, start_d, length = runs[-1]
            runs[-1] = (start_s, start_d, length + 1)
        else:
            runs.append((s, d, 1))
    return runs


def find_runs(src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[Run]:
    """`contiguous_runs` of slot lists checked to be as many (`check_counts`) and, where
    finding the runs fails on a slot (a string, None), to be integers (`slot_number`):
    `InvalidArgumentError` naming it, not a `TypeError` (which a planner takes for a strategy
    torch cannot run). Their range is `check_runs`'s, in the copy."""
    check_counts(src_slots, dst_slots)
    try:
        return contiguous_runs(src_slots, dst_slots)
    except TypeError:
        for name, slots in (("source", src_slots), ("destination", dst_slots)):
            for slot in slots:
                slot_number(slot, name)
        raise


def _one_run(slots: Sequence[int]) -> bool:
    """Whether `slots` (not empty) go up by one from the first: two comparisons in C, not a
    loop (a list of 256 slots: about 3 us against 40-100 for the general case). Slots that
    are not Python ints are left to the loop (`range` takes no float)."""
    first, n = slots[0], len(slots)
    if type(first) is not int:
        return False
    if slots[-1] - first != n - 1:
        return False
    if isinstance(slots, range):
        return slots.step == 1 or n == 1
    return list(slots) == list(range(first, first + n))


def medium(buffer: torch.Tensor) -> str:
    """Where a buffer lives, as the strategies tell memories apart: its CUDA device ('cuda:0'),
    'pinned' (page-locked host memory, addressable by a GPU) or 'cpu' (pageable)."""
    device = buffer.device  # a new torch.device each time it is read
    if device.type == "cuda":
        return str(device)
    return "pinned" if buffer.is_pinned() else device.type


# -- the three strategies ---------------------------------------------------------------------


def copy_blocks_slices(
    src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> None:
    """One `copy_` per run of slots consecutive on both sides."""
    copy_runs(src, dst, find_runs(src_slots, dst_slots))


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[Run]) -> None:
    """`copy_blocks_slices` of runs already found (`contiguous_runs`); every run checked
    against both buffers first (`check_runs`), so nothing is copied on a bad slot."""
    check_runs(runs, len(src), len(dst))
    if staged.applies(src, dst):  # a strided host view: memcpys of its pieces, not the CPU's
        staged.copy_runs(src, dst, runs)
        return
    if src.is_cuda and dst.is_cuda:  # a strided copy on the device moves words, not bf16s
        src, dst = staged.as_words(src, dst)
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n])


def copy_blocks_gather(
    src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> None:
    """One gather into a temporary, moved to `dst`'s device, and one scatter; the slots
    checked first (`check_slots`: on CUDA an index out of range is a device-side assert, and
    a repeated destination a nondeterministic write)."""
    check_slots(src_slots, dst_slots, len(src), len(dst))
    src_index = torch.tensor(list(src_slots), dtype=torch.long, device=src.device)
    dst_index = torch.tensor(list(dst_slots), dtype=torch.long, device=dst.device)
    picked = as_bits(src).index_select(0, src_index).to(dst.device)
    as_bits(dst).index_copy_(0, dst_index, picked)


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype of each element width in bytes: what `as_bits` views a buffer as."""


def as_bits(buffer: torch.Tensor) -> torch.Tensor:
    """`buffer` viewed (sharing its memory, any strides) as integers of its element's width: a
    copy of them is a copy of its bits, in every dtype (torch's CPU indexing kernels leave out
    float8)."""
    bits = BITS.get(buffer.element_size())
    return buffer if bits is None else buffer.view(bits)


def copy_blocks_kernel(
    src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> None:
    """Enqueue one launch that copies block `src_slots[i]` of `src` to block `dst_slots[i]` of
    `dst`, on the current stream of the CUDA side's device, and return before it completes.

    The caller orders later use after that stream: a host destination is not written, and a
    host source may still be read, until the stream has passed the launch. Checks everything
    first and launches nothing on a bad argument (`InvalidArgumentError`): both buffers
    contiguous with equal block sizes, one slot per block on each side, every slot in range, no
    slot both read and written in memory the two share (the launch's blocks race), at least one
    side CUDA, a host side pinned, two CUDA sides on one device, CuPy importable.
    """
    device = _check_kernel_args(src, dst, src_slots, dst_slots)
    cupy = _cupy()
    if cupy is None:
        raise InvalidArgumentError(
            "copy_blocks_kernel: CuPy is not importable; expected kvtier's 'gpu' extra installed "
            "(check kernel_available() before asking for a kernel copy)"
        )
    n = len(src_slots)
    if n == 0:
        return
    block_bytes = src[0].numel() * src.element_size()
    aligned = block_bytes | src.data_ptr() | dst.data_ptr()  # powers of two: divide all three
    unit = next(u for u in KERNEL_UNITS if aligned % u == 0)
    block_units = block_bytes // unit
    chunks = min(MAX_CHUNKS, -(-block_units // (THREADS * UNITS_PER_THREAD)))
    # Through pinned memory, so that the upload is enqueued rather than waited for (a pageable
    # upload would block this thread until the stream got there). The device copy is allocated
    # on the current stream and used there only, so the caching allocator cannot hand it to
    # anyone else before the launch has run; the pinned one is held until the upload has.
    ids = torch.tensor([list(src_slots), list(dst_slots)], dtype=torch.int64).pin_memory()
    slots = ids.to(device, non_blocking=True)
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        _kernel(unit)(
            (n, chunks),
            (THREADS,),
            (src.data_ptr(), dst.data_ptr(), slots[0].data_ptr(), slots[1].data_ptr(), block_units),
        )


def _copy_blocks_kernel_complete(
    src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> None:
    """`copy_blocks_kernel`, then a wait for it when host memory takes part (as `copy_`)."""
    copy_blocks_kernel(src, dst, src_slots, dst_slots)
    if src.device.type != "cuda" or dst.device.type != "cuda":
        cuda = src.device if src.device.type == "cuda" else dst.device
        torch.cuda.current_stream(cuda).synchronize()


# -- the table --------------------------------------------------------------------------------

CopyFn = Callable[[torch.Tensor, torch.Tensor, Sequence[int], Sequence[int]], None]


@dataclass(frozen=True)
class CopyStrategy:
    """A way to copy blocks between buffers; `applies(src_medium, dst_medium)` says whether it
    can run between those memories (`medium`)."""

    name: str
    copy: CopyFn
    applies: Callable[[str, str], bool]
    copy_runs: Callable[[torch.Tensor, torch.Tensor, Sequence[Run]], None] | None = None
    """The same copy from the runs of its slots, for a caller that has found them already."""

    def copy_found(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_slots: Sequence[int],
        dst_slots: Sequence[int],
        runs: Sequence[Run],
    ) -> None:
        """`copy`, given the `runs` of the slots found already: handed over where the strategy
        takes them (`copy_runs`), so that they are not found twice."""
        if self.copy_runs is not None:
            self.copy_runs(src, dst, runs)
        else:
            self.copy(src, dst, src_slots, dst_slots)


def kernel_available() -> bool:
    """Whether `copy_blocks_kernel` can run here: CUDA is available and CuPy imports."""
    return torch.cuda.is_available() and _cupy() is not None


def kernel_applies(src_medium: str, dst_medium: str) -> bool:
    """Whether the kernel can copy between these memories here: CuPy and CUDA present, a CUDA
    side, no pageable host side, and no two different devices."""
    return _kernel_reaches(src_medium, dst_medium) and kernel_available()


def applies_anywhere(src_medium: str, dst_medium: str) -> bool:
    """The `applies` of a strategy that runs between any two memories."""
    return True


STRATEGIES: tuple[CopyStrategy, ...] = (
    CopyStrategy("slices", copy_blocks_slices, applies_anywhere, copy_runs),
    CopyStrategy("gather", copy_blocks_gather, applies_anywhere),
    CopyStrategy("kernel", _copy_blocks_kernel_complete, kernel_applies),
)
"""Every strategy, in the order the planner tries them."""


# -- helpers ----------------------------------------------------------------------------------


def _check_kernel_args(
    src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> torch.device:
    """The CUDA device the launch runs on, after every check of `copy_blocks_kernel`."""
    for name, buffer in (("src", src), ("dst", dst)):
        if buffer.dim() < 2 or len(buffer) == 0 or not buffer.is_contiguous():
            raise InvalidArgumentError(
                f"copy_blocks_kernel: {name} has shape {list(buffer.shape)} and strides "
                f"{list(buffer.stride())}; expected a contiguous pool buffer [slots, *block]"
            )
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise InvalidArgumentError(
            f"copy_blocks_kernel: blocks {list(src.shape[1:])} of {src.dtype} in src, "
            f"{list(dst.shape[1:])} of {dst.dtype} in dst; expected the same block shape and dtype"
        )
    if len(src_slots) != len(dst_slots):
        raise InvalidArgumentError(
            f"copy_blocks_kernel: {len(src_slots)} source slots, {len(dst_slots)} destination "
            "slots; expected one destination slot per block"
        )
    check_slots(src_slots, dst_slots, len(src), len(dst))
    start, stop = src.data_ptr(), src.data_ptr() + src.nbytes  # one launch: blocks in any order
    if src.device == dst.device and start < dst.data_ptr() + dst.nbytes and dst.data_ptr() < stop:
        read = {int(slot) for slot in src_slots}  # (checked integers)
        if dst.data_ptr() != start or any(int(slot) in read for slot in dst_slots):
            raise InvalidArgumentError(
                "copy_blocks_kernel: src and dst share memory and a slot is read and written "
                "(by two blocks of the launch, in any order); expected buffers apart or slots "
                "read and slots written apart"
            )
    if not _kernel_reaches(medium(src), medium(dst)):
        raise InvalidArgumentError(
            f"copy_blocks_kernel: from {medium(src)} to {medium(dst)}; expected a CUDA buffer "
            "and, on the other side, one on the same device or in pinned host memory"
        )
    return src.device if src.device.type == "cuda" else dst.device


def _kernel_reaches(src_medium: str, dst_medium: str) -> bool:
    """One CUDA device, and no pageable host memory, between the two sides."""
    media = {src_medium, dst_medium}
    return len({m for m in media if m.startswith("cuda")}) == 1 and "cpu" not in media


@functools.cache
def _cupy() -> ModuleType | None:
    """CuPy, imported on first use; None where it is not installed."""
    try:
        return importlib.import_module("cupy")
    except ImportError:
        return None


@functools.cache
def _kernel(unit: int) -> Any:
    """The `cupy.RawKernel` of one access width (compiled per device on its first launch)."""
    cupy = _cupy()
    assert cupy is not None, "asked for a kernel without CuPy"
    return cupy.RawKernel(BLOCK_COPY_CUDA, f"kvtier_copy_blocks_{unit}")
