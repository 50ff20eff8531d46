"""Blocks as the disk tier reads and writes them: each one's bytes, and whether O_DIRECT takes them.

    byte_views(blocks) -> BlockBytes(views, aligned)

    one storage (a pool buffer, a gathered batch)
    +---------------------+---------------------+-----+---------------------+
    | slot 0              | slot 1              | ... | slot n-1            |
    +---------------------+---------------------+-----+---------------------+
    ^ base                ^ block.data_ptr()                     one numpy view of it all;
                                                                 a block is a slice of it

Why: the tier's per-block work is small for small blocks, and turning each block tensor into a
NumPy array (`.contiguous().view(uint8).reshape(-1).numpy()`, four torch calls) cost more than
building, packing and checksumming its header. A batch whose blocks lie in one CPU storage (the
views of a pool's slots that the mover hands in, or one `[n, *block_shape]` tensor) costs one
NumPy view for the whole batch and a slice per block.

Contract:
- `views[i]` is a flat, writable memoryview of bytes over block i's memory (a read into it
  lands in the block), valid while the blocks are alive. A block that is not contiguous is
  viewed through a contiguous copy of it (as before, so a read into it does not reach it).
- `aligned[i]` is `direct_ready(block i)`: its address and size are multiples of `ALIGN`, so
  O_DIRECT can take its memory as it is. For a `[n, *block_shape]` tensor that is its base
  address and the row stride both: a 2 KiB row at an aligned base is not aligned (its length
  is not a multiple of `ALIGN`), nor is the next row's address (a quantized host pool decodes
  into such tensors, and O_DIRECT refused their blocks' writes).
- A CUDA block raises as `Tensor.numpy()` does; nothing here copies across devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvtier.tiers.disk.io import ALIGN


class BlockBytes(NamedTuple):
    """The bytes of a batch's blocks, and whether each can go to O_DIRECT as it is."""

    views: list[memoryview]
    aligned: list[bool]


def direct_ready(tensor: torch.Tensor) -> bool:
    """Whether a tensor's memory can be handed to O_DIRECT as it is."""
    return tensor.data_ptr() % ALIGN == 0 and tensor.numel() * tensor.element_size() % ALIGN == 0


def byte_views(blocks: torch.Tensor | Sequence[torch.Tensor]) -> BlockBytes:
    """Each block's bytes and alignment (see the module doc): a `[n, *block_shape]` tensor, or
    n block tensors (e.g. views of pool slots)."""
    if len(blocks) == 0:
        return BlockBytes([], [])
    if isinstance(blocks, torch.Tensor):
        whole = blocks.contiguous()
        row = whole[0].nbytes
        flat = _flat(whole)
        base = whole.data_ptr()
        views = [flat[i * row : (i + 1) * row] for i in range(len(whole))]
        if row % ALIGN:  # a row's length, so every other row's address, is off the grid
            return BlockBytes(views, [False] * len(whole))
        return BlockBytes(views, [(base + i * row) % ALIGN == 0 for i in range(len(whole))])
    first = blocks[0]
    if not first.is_cpu:
        return _one_by_one(blocks)
    storage = first.untyped_storage()
    base, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    flat = _flat(torch.empty(0, dtype=torch.uint8).set_(storage))
    views, aligned = [], []
    for block in blocks:
        start, nbytes = block.data_ptr(), block.nbytes
        if block.is_cpu and base <= start and start + nbytes <= end and block.is_contiguous():
            views.append(flat[start - base : start - base + nbytes])  # memory of that storage
            aligned.append(start % ALIGN == 0 and nbytes % ALIGN == 0)
        else:
            view, ready = _one(block)
            views.append(view)
            aligned.append(ready)
    return BlockBytes(views, aligned)


def _one_by_one(blocks: Sequence[torch.Tensor]) -> BlockBytes:
    pairs = [_one(block) for block in blocks]
    return BlockBytes([view for view, _ in pairs], [ready for _, ready in pairs])


def _one(block: torch.Tensor) -> tuple[memoryview, bool]:
    flat = block.contiguous().view(torch.uint8).reshape(-1)
    return flat.numpy().data, direct_ready(flat)


def _flat(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as one flat memoryview."""
    return tensor.view(torch.uint8).reshape(-1).numpy().data
