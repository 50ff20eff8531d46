"""Block copies between a CUDA pool and a strided view of host memory, through a device stage.

    d2h:  pool slots ──gather (HBM)──► stage [L, 2, m, T, H, D] ──one memcpy per piece──► host
    h2d:  host ──one memcpy per piece──► stage ──scatter (HBM)──► pool slots

Why: a load into a caller's layer-major host tensor (`caller_kv.py`: `[layers, 2, tokens,
heads, dim]`) copies each run of slots into a strided view of it. `Tensor.copy_` from CUDA into
a non-contiguous host tensor copies into a contiguous host temporary, then moves the elements on
the CPU, one thread: on the H200 that load ran at 1.2 GB/s against 55 for one memcpy of the same
bytes (`benchmarks/RESULTS.md`). The host view is not one piece of memory, but it is a few
large ones: with its dimensions ordered by stride, a run of blocks consecutive on the host side
is `L * 2` pieces of `m * T * H * D` contiguous elements (one per layer and K|V). So the blocks
are arranged in that order in a device stage, by one pass at HBM speed, and each piece moves
with one `cudaMemcpyAsync` (`copy_(non_blocking=True)`) straight between the stage and the
host memory; h2d is the same, backwards.

Contract:
- `applies(src, dst)`: one side CUDA, the other host memory whose buffer is not contiguous
  and whose blocks are each at most `L * 2` pieces (`few_pieces`: the case above); otherwise
  the callers copy run by run with `copy_` (a view of every other element would have been a
  memcpy per element).
- `copy_runs(src, dst, runs)` copies each `(src_start, dst_start, length)` run of blocks of
  `src` to `dst` (both `[slots, *block_shape]`, runs checked by the caller), and returns with
  the copies complete, as `Tensor.copy_` into or out of host memory does. Runs consecutive on the
  host side are joined (their device slots need not be); a stage holds at most `STAGE_BYTES`
  (one block at least); on CUDA two stages are used in turn, the device's pass over one chunk
  (on the current stream) overlapping the memcpys of the other (on a side stream), and a stage
  is reused only once the work on its last chunk finished (CUDA events).
- Where the stage cannot be allocated (the engine holds the device's memory), the copy runs
  run by run with `copy_`, as before: slower, never wrong.
- `as_words(a, b)`: two tensors of one dtype viewed as the widest integer words both allow,
  for strided copies on the device (torch moves one element per step: a bf16 transposing copy
  ran at 0.44 of a contiguous one on the H200, as int64 words at 0.88); the stage's own
  passes use it, and so do `block_copy.copy_runs` and `SlotPool.write` between CUDA buffers.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence

import torch

STAGE_BYTES = 64 << 20
"""The most device memory one copy stages at a time."""

Run = tuple[int, int, int]


WORDS = (torch.int64, torch.int32)
"""The integer types a strided copy moves its elements as, widest first (`as_words`)."""


def as_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`a` and `b` (one dtype) as views of the widest of `WORDS` that both allow (a last
    dimension of stride 1 whose bytes, and every other stride's, the word divides), else as
    they are. Torch's strided copy moves one element per thread step: on the H200 a 256 MiB
    layer-major -> block-major copy of bf16 took 0.336 ms, of the same bytes as int64 0.154 ms,
    against 0.136 for a contiguous copy. Slices along dim 0 of the views are the views of the
    slices."""
    if a.dtype != b.dtype:
        return a, b
    for word in WORDS:
        if word.itemsize <= a.element_size():
            break
        try:
            return a.view(word), b.view(word)
        except RuntimeError:  # a stride or the last dimension the word does not divide
            continue
    return a, b


def applies(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """A CUDA side and a non-contiguous host side of few pieces (module doc)."""
    if src.is_cuda == dst.is_cuda:
        return False
    host = dst if src.is_cuda else src
    return not host.is_contiguous() and few_pieces(host)


def few_pieces(host: torch.Tensor) -> bool:
    """Whether `host` (`[slots, L, 2, ...]`) is at most `L * 2` pieces of contiguous memory a
    block, as the layouts this is for (module doc). A view of every other element (`out[...,
    ::2]`) is one piece an element: a memcpy each, 4M of them for 8 MiB of KV, where `copy_`
    moves them in one strided pass on the CPU (1.2 GB/s on the H200)."""
    if len(host) == 0 or host.dim() < 3:
        return False
    ordered = host.permute(_stride_order(host))
    return math.prod(ordered.shape[: _lead(ordered)]) <= len(host) * host.shape[1] * host.shape[2]


def _stride_order(host: torch.Tensor) -> list[int]:
    """`host`'s dimensions, largest stride first."""
    return sorted(range(host.dim()), key=lambda i: (-host.stride()[i], i))


def _lead(ordered: torch.Tensor) -> int:
    """How many leading dimensions of `ordered` index its contiguous pieces."""
    return next(k for k in range(ordered.dim() + 1) if ordered[(0,) * k].is_contiguous())


def copy_runs(
    src: torch.Tensor,
    dst: torch.Tensor,
    runs: Sequence[Run],
    host_is_dst: bool | None = None,
    stage_bytes: int = STAGE_BYTES,
) -> None:
    """Copy `runs` of blocks from `src` to `dst` through a device stage (module doc).
    `host_is_dst`: whether `dst` is the host side (default: whether `src` is the CUDA one);
    with both sides on the CPU the stage is on the CPU too (the tests of the arrangement)."""
    to_host = src.is_cuda if host_is_dst is None else host_is_dst
    device = src.device if to_host else dst.device
    block_bytes = src[0].numel() * src.element_size() if len(src) else 1
    chunk = max(1, stage_bytes // block_bytes)
    total = sum(n for _, _, n in runs)
    chunks = []  # (the host side's blocks, the device side's slots)
    for host_start, device_slots in _host_runs(runs, host_is_dst=to_host):
        for at in range(0, len(device_slots), chunk):
            h, slots = host_start + at, device_slots[at : at + chunk]
            chunks.append(((dst if to_host else src)[h : h + len(slots)], slots))
    try:
        stages = [
            torch.empty((min(chunk, total), *src.shape[1:]), dtype=src.dtype, device=device)
            for _ in range(min(2, len(chunks)))
        ]
    except torch.OutOfMemoryError:
        for s, d, n in runs:
            dst[d : d + n].copy_(src[s : s + n])
        return
    pool = src if to_host else dst
    if device.type != "cuda":
        for host, slots in chunks:
            _down(pool, host, slots, stages[0]) if to_host else _up(host, pool, slots, stages[0])
        return
    _overlapped(pool, chunks, stages, to_host)


def _overlapped(
    pool: torch.Tensor,
    chunks: list[tuple[torch.Tensor, list[int]]],
    stages: list[torch.Tensor],
    to_host: bool,
) -> None:
    """The chunks on CUDA, two stages in turn: the device's pass over one chunk (gather or
    scatter, on the current stream) overlaps the memcpys of the other (on a side stream), each
    stage reused only once the last work on it finished (events); returns when all is done."""
    main = torch.cuda.current_stream(pool.device)
    side = _side_stream(pool.device)
    side.wait_stream(main)  # after what the engine enqueued before this call
    released: list[torch.cuda.Event | None] = [None, None]
    for k, (host, slots) in enumerate(chunks):
        stage, last = stages[k % len(stages)], released[k % 2]
        filled = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        if to_host:
            if last is not None:
                main.wait_event(last)  # the memcpys out of this stage are done
            _copy(_as_blocks(host, stage), _gathered(pool, slots))
            filled.record(main)
            with torch.cuda.stream(side):
                side.wait_event(filled)
                for host_piece, stage_piece in _pieces(host, stage):
                    host_piece.copy_(stage_piece, non_blocking=True)
                done.record(side)
        else:
            with torch.cuda.stream(side):
                if last is not None:
                    side.wait_event(last)  # the scatter out of this stage is done
                for host_piece, stage_piece in _pieces(host, stage):
                    stage_piece.copy_(host_piece, non_blocking=True)
                filled.record(side)
            main.wait_event(filled)
            _scatter(_as_blocks(host, stage), pool, slots)
            done.record(main)
        released[k % 2] = done
    main.wait_stream(side)
    main.synchronize()  # as `copy_` into or out of host memory: complete on return


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The memcpys' stream on `device`, one per process and device."""
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _host_runs(runs: Sequence[Run], host_is_dst: bool) -> Iterator[tuple[int, list[int]]]:
    """(first host slot, device slots) of each stretch of runs consecutive on the host side."""
    start, slots = -1, []  # type: tuple[int, list[int]]
    for s, d, n in runs:
        host, dev = (d, s) if host_is_dst else (s, d)
        if slots and host == start + len(slots):
            slots.extend(range(dev, dev + n))
            continue
        if slots:
            yield start, slots
        start, slots = host, list(range(dev, dev + n))
    if slots:
        yield start, slots


Ordered = tuple[torch.Tensor, torch.Tensor, list[int]]


def _ordered(host: torch.Tensor, stage: torch.Tensor) -> Ordered:
    """`host` (`[m, *block]`) with its dimensions in stride order, the stage's first `m`
    blocks as contiguous memory of that shape, and the order."""
    perm = _stride_order(host)
    ordered = host.permute(perm)
    return ordered, stage.view(-1)[: host.numel()].view(ordered.shape), perm


def _pieces(host: torch.Tensor, stage: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(host piece, stage piece) pairs, each host piece one contiguous stretch of memory, the
    stage's pieces its own contiguous memory in the same order (`_ordered`)."""
    ordered, staged, _ = _ordered(host, stage)
    for index in itertools.product(*(range(size) for size in ordered.shape[: _lead(ordered)])):
        yield ordered[index], staged[index]


def _as_blocks(host: torch.Tensor, stage: torch.Tensor) -> torch.Tensor:
    """The stage's first `len(host)` blocks as `[m, *block]`, in `host`'s stride order."""
    _, staged, perm = _ordered(host, stage)
    return staged.permute([perm.index(i) for i in range(host.dim())])


def _down(pool: torch.Tensor, host: torch.Tensor, slots: list[int], stage: torch.Tensor) -> None:
    """pool[slots] -> host (`[len(slots), *block]`), through the stage."""
    _copy(_as_blocks(host, stage), _gathered(pool, slots))
    for host_piece, stage_piece in _pieces(host, stage):
        host_piece.copy_(stage_piece, non_blocking=True)


def _up(host: torch.Tensor, pool: torch.Tensor, slots: list[int], stage: torch.Tensor) -> None:
    """host (`[len(slots), *block]`) -> pool[slots], through the stage."""
    for host_piece, stage_piece in _pieces(host, stage):
        stage_piece.copy_(host_piece, non_blocking=True)
    _scatter(_as_blocks(host, stage), pool, slots)


def _scatter(blocks: torch.Tensor, pool: torch.Tensor, slots: list[int]) -> None:
    """blocks -> pool[slots]: one copy when the slots are one run, else an index copy; words
    either way (`as_words`)."""
    first = _run_start(slots)
    if first is not None:
        _copy(pool[first : first + len(slots)], blocks)
        return
    wide_pool, wide_blocks = as_words(pool, blocks)
    wide_pool.index_copy_(0, _index(slots, pool.device), wide_blocks)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, a strided copy on one device, moving words (`as_words`)."""
    wide_dst, wide_src = as_words(dst, src)
    wide_dst.copy_(wide_src)


def _gathered(pool: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """pool[slots] as a view when they are one run, else gathered on the device."""
    first = _run_start(slots)
    if first is not None:
        return pool[first : first + len(slots)]
    return pool.index_select(0, _index(slots, pool.device))


def _run_start(slots: list[int]) -> int | None:
    """The first slot when `slots` go up by one from it, else None."""
    first = slots[0]
    return first if slots == list(range(first, first + len(slots))) else None


def _index(slots: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
