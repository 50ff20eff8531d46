"""Transfers: copies of whole blocks from slots of one pool to slots of another.

A `Transfer` is planned as an object (source pool and slots -> destination pool and slots), run
by an executor, and only then reported to the index (DESIGN invariant 1: a copy becomes visible
when it is complete). `InlineExecutor` runs a transfer to completion in the caller's thread,
which is what the synchronous store needs; the async mover adds executors on CUDA streams and
worker threads behind the same `run` (issue 4), and the disk tier its own I/O path (issue 3).

Copies are merged: consecutive slots on both sides become one slice copy, so blocks that were
allocated together move as one large copy; scattered slots fall back to one gather and one
scatter (`index_select` + `index_copy_`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kvtier.tiers import SlotPool

_MAX_RUNS = 8
"""Above this many contiguous runs, one gather + one scatter beats many slice copies."""


@dataclass(frozen=True)
class Transfer:
    src: SlotPool
    src_slots: tuple[int, ...]
    dst: SlotPool
    dst_slots: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.src_slots) == len(self.dst_slots), "one destination slot per block"
        assert self.src.layout == self.dst.layout, "pools of different layouts"

    @property
    def nbytes(self) -> int:
        return len(self.src_slots) * self.src.layout.block_bytes

    @property
    def path(self) -> tuple[str, str]:
        return (self.src.name, self.dst.name)


def contiguous_runs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both sides advance by one slot together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            start_s, start_d, length = runs[-1]
            runs[-1] = (start_s, start_d, length + 1)
        else:
            runs.append((s, d, 1))
    return runs


class InlineExecutor:
    """Runs transfers to completion in the calling thread and counts bytes per path."""

    def __init__(self) -> None:
        self.bytes_moved: dict[tuple[str, str], int] = defaultdict(int)
        self.transfers = 0

    def run(self, transfer: Transfer) -> None:
        if not transfer.src_slots:
            return
        src, dst = transfer.src.buffer, transfer.dst.buffer
        runs = contiguous_runs(transfer.src_slots, transfer.dst_slots)
        if len(runs) <= _MAX_RUNS:
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n])
        else:
            src_index = torch.tensor(transfer.src_slots, dtype=torch.long, device=src.device)
            dst_index = torch.tensor(transfer.dst_slots, dtype=torch.long, device=dst.device)
            dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(dst.device))
        self.bytes_moved[transfer.path] += transfer.nbytes
        self.transfers += 1
