"""Transfers: copies of whole blocks from slots of one pool to slots of another.

A `Transfer` is planned as an object (source tier and slots -> destination tier and slots, and
the blocks it carries), run by an executor, and only then reported to the index (DESIGN
invariant 1: a copy becomes visible when it is complete). `run` returns, per block, whether its
copy is complete: memory copies always are; a disk write is complete once durable, and a disk
read once its checksum verified. `InlineExecutor` runs a transfer to completion in the caller's
thread, which is what the synchronous store needs. It also satisfies the `Executor` protocol
(`shared.py`): `submit` runs the transfer at once and returns a handle that is already done.
`ThreadExecutor` (`threads.py`) runs the same `run` on worker threads, and `CudaExecutor`
(`cuda.py`) runs memory copies on CUDA streams.

A transfer may carry a range of layers (`layers=(first, stop)`): only those layers of each block
move, so a prefetch can land layer group by layer group and an engine can start on layer 0
while later layers arrive. Disk copies always carry whole blocks (a checksum covers a block).

Every executor counts what it moved in a `Ledger` (bytes per path and the recent copies for
bandwidth), which the store shares between its inline and its background executor so that
status reads one set of figures. A ledger is locked: worker threads write it, status reads it.

Memory copies of whole blocks go through the executor's `BlockCopier` (`planner.py`): one slice
copy per run of slots consecutive on both sides, one gather and one scatter, or, within a GPU
or between it and pinned host memory, one CUDA kernel launch (`kernels/block_copy.py`),
whichever its first copies of that kind measured fastest. A layer range moves as one strided
slice copy per run.
Disk copies go through the disk tier's parallel, group-committed I/O path. A copy with a
quantized host tier on one side encodes or decodes on the way (`encoded.py`).
No slot is copied unchecked: a memory copy's strategy checks its slots (or runs) against both
buffers, and a disk or codec copy, which indexes slots one by one, checks every slot against
its tier's `num_slots` (and its destinations for repeats) first: `InvalidArgumentError`, nothing
copied. A slice or a negative index would not fail by itself (`block_copy.check_runs`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ClosedError
from kvtier.kernels.block_copy import contiguous_runs
from kvtier.kernels.slots import check_runs, check_slots
from kvtier.tiers import SlotPool
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.quantized import QuantPool
from kvtier.transfer.encoded import disk_to_host, host_to_disk, pool_to_pool
from kvtier.transfer.planner import BlockCopier
from kvtier.transfer.shared import Runner, TransferHandle

RECENT_TRANSFERS = 256
"""Copies remembered per path for `recent_bandwidth`."""


@dataclass(frozen=True)
class Transfer:
    src: Tier
    src_slots: tuple[int, ...]
    dst: Tier
    dst_slots: tuple[int, ...]
    blocks: tuple[BlockMeta, ...] = ()  # what a disk copy records; needed when disk is involved
    layers: tuple[int, int] | None = None  # (first, stop): only these layers; None: whole blocks

    def __post_init__(self) -> None:
        assert len(self.src_slots) == len(self.dst_slots), "one destination slot per block"
        disk = isinstance(self.src, DiskTier) or isinstance(self.dst, DiskTier)
        assert not disk or len(self.blocks) == len(self.src_slots), "disk copies need block metas"
        assert not disk or self.layers is None, "disk copies carry whole blocks"
        if self.layers is not None:
            first, stop = self.layers
            assert 0 <= first < stop <= self.src.layout.num_layers, f"bad layers {self.layers}"

    @property
    def path(self) -> tuple[str, str]:
        return (self.src.name, self.dst.name)

    @property
    def nbytes(self) -> int:
        """Bytes this transfer moves (of its layers, when it carries a range)."""
        layout = self.src.layout
        whole = len(self.src_slots) * layout.block_bytes
        if self.layers is None:
            return whole
        first, stop = self.layers
        return whole * (stop - first) // layout.num_layers


class Ledger:
    """Bytes moved per path, and the latest copies per path for `recent_bandwidth`; locked, so
    that copying threads record while status reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        # per path: (end time, bytes, seconds) of the latest copies
        self._recent: dict[tuple[str, str], deque[tuple[float, int, float]]] = defaultdict(
            lambda: deque(maxlen=RECENT_TRANSFERS)
        )

    def record(self, path: tuple[str, str], nbytes: int, started: float) -> None:
        """Count `nbytes` moved on `path` by a copy that began at `started` (monotonic)."""
        now = time.monotonic()
        with self._lock:
            self._bytes[path] += nbytes
            self._recent[path].append((now, nbytes, now - started))

    @property
    def bytes_moved(self) -> dict[tuple[str, str], int]:
        """Bytes of completed copies per path (a snapshot)."""
        with self._lock:
            return dict(self._bytes)

    def recent_bandwidth(self, *paths: tuple[str, str], window_s: float = 60.0) -> float:
        """Bytes per second of copying on `paths` together, over the copies that ended in the
        last `window_s` seconds: their bytes over the time at least one of them ran (copies that
        overlap, on several workers or paths, count their common time once; idle time not at
        all). 0.0 when there were none. With several paths (a disk's reads and writes: is the
        device busy?), only copies since the oldest one that each path whose memory is full
        still remembers count, so that every path is seen over the same span."""
        horizon = time.monotonic() - window_s
        with self._lock:
            kept = [copies for path in paths if (copies := self._recent.get(path)) is not None]
            if len(paths) > 1:
                for copies in kept:
                    if len(copies) == copies.maxlen:
                        horizon = max(horizon, copies[0][0])
            recent = [(e - s, e, n) for copies in kept for e, n, s in copies if e >= horizon]
        busy, reach = 0.0, -math.inf  # time covered so far, and where the covered time ends
        for start, end, _ in sorted(recent):
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return sum(n for _, _, n in recent) / busy if busy > 0 else 0.0


class InlineExecutor:
    """Runs transfers to completion in the calling thread and counts bytes per path in its
    ledger (its own, or one shared with other executors)."""

    def __init__(self, ledger: Ledger | None = None, copier: BlockCopier | None = None) -> None:
        """`copier`: how memory copies of whole blocks move (its planner's `choices` say which
        strategy each kind of copy uses); a fresh one when None."""
        self.ledger = ledger if ledger is not None else Ledger()
        self.copier = copier if copier is not None else BlockCopier()
        self._completed: list[TransferHandle] = []  # submitted, not yet polled
        self._closed = False

    def submit(self, transfer: Transfer) -> TransferHandle:
        """Run `transfer` now, as `run`, and return its handle, already done (the next `poll()`
        returns it). An exception of the copy is kept in the handle: `result()` raises it."""
        if self._closed:
            raise ClosedError("the inline executor is closed; submit before close()")
        handle = TransferHandle(transfer)
        ok: list[bool] | None = None
        error: Exception | None = None
        try:
            ok = self.run(transfer)
        except Exception as exc:
            error = exc
        handle.settle(ok, error)
        self._completed.append(handle)
        handle.run_callbacks()
        return handle

    polled = False  # every handle is done when `submit` returns

    def poll(self) -> list[TransferHandle]:
        """The handles submitted since the last poll, each once, in submission order."""
        completed, self._completed = self._completed, []
        return completed

    def queued(self) -> int:
        """Nothing is ever in flight: a transfer is complete when `submit` returns."""
        return 0

    def mark_engine(self) -> None:
        """Nothing to order: copies run in the calling thread, after what it wrote."""

    def in_call_runner(self, inline: Runner) -> Runner:
        return inline

    def close(self) -> None:
        """Refuse later `submit`s (nothing is ever in flight). `run` is not affected."""
        self._closed = True

    def run(self, transfer: Transfer) -> list[bool]:
        """Copy every block; per block, whether its copy is complete (see the module doc)."""
        if not transfer.src_slots:
            return []
        started = time.monotonic()
        src_tier, dst_tier = transfer.src, transfer.dst
        src_slots, dst_slots = transfer.src_slots, transfer.dst_slots
        if not _plain(src_tier, dst_tier):  # slots indexed one by one: each checked first
            check_slots(src_slots, dst_slots, src_tier.num_slots, dst_tier.num_slots)
        if isinstance(dst_tier, DiskTier) and isinstance(src_tier, QuantPool):
            ok = host_to_disk(src_tier, dst_tier, src_slots, dst_slots, transfer.blocks)
        elif isinstance(src_tier, DiskTier) and isinstance(dst_tier, QuantPool):
            ids = [meta.block_id for meta in transfer.blocks]
            ok = disk_to_host(src_tier, dst_tier, src_slots, dst_slots, ids)
        elif isinstance(dst_tier, DiskTier):
            assert isinstance(src_tier, SlotPool)
            if src_tier.device.type == "cpu":
                views = [src_tier.buffer[slot] for slot in transfer.src_slots]  # written in place
            else:  # a CUDA pool (persist): through host memory, on the caller's stream
                views = list(src_tier.read(list(transfer.src_slots)).cpu())
            ok = dst_tier.write_blocks(transfer.dst_slots, views, transfer.blocks)
        elif isinstance(src_tier, DiskTier):
            assert isinstance(dst_tier, SlotPool)
            ids = [meta.block_id for meta in transfer.blocks]
            if dst_tier.device.type == "cpu":  # straight into the destination slots
                slots_out = [dst_tier.buffer[slot] for slot in transfer.dst_slots]
                _, ok = src_tier.read_blocks(transfer.src_slots, ids, out=slots_out)
            else:  # a CUDA pool: through host memory
                data, ok = src_tier.read_blocks(transfer.src_slots, ids)
                good = [i for i, done in enumerate(ok) if done]
                if good:
                    dst_tier.write([transfer.dst_slots[i] for i in good], _rows(data, good))
        else:
            assert isinstance(src_tier, SlotPool) and isinstance(dst_tier, SlotPool)
            if isinstance(src_tier, QuantPool) or isinstance(dst_tier, QuantPool):
                ok = pool_to_pool(src_tier, dst_tier, src_slots, dst_slots, transfer.layers)
            else:
                self._copy_memory(src_tier, dst_tier, transfer)
                ok = [True] * len(transfer.src_slots)
        self.ledger.record(transfer.path, transfer.nbytes * ok.count(True) // len(ok), started)
        return ok

    @property
    def bytes_moved(self) -> dict[tuple[str, str], int]:
        return self.ledger.bytes_moved

    def record(self, path: tuple[str, str], nbytes: int, started: float) -> None:
        self.ledger.record(path, nbytes, started)

    def recent_bandwidth(self, *paths: tuple[str, str], window_s: float = 60.0) -> float:
        return self.ledger.recent_bandwidth(*paths, window_s=window_s)

    def _copy_memory(self, src_pool: SlotPool, dst_pool: SlotPool, transfer: Transfer) -> None:
        src, dst = src_pool.buffer, dst_pool.buffer
        if transfer.layers is None:
            self.copier.copy(src, dst, transfer.src_slots, transfer.dst_slots)
            return
        first, stop = transfer.layers  # a layer range: one strided slice copy per run
        runs = contiguous_runs(transfer.src_slots, transfer.dst_slots)
        check_runs(runs, len(src), len(dst))
        for s, d, n in runs:
            dst[d : d + n, first:stop].copy_(src[s : s + n, first:stop])


def _plain(src: Tier, dst: Tier) -> bool:
    """Whether a copy between these tiers is a memory copy of blocks (the copier's, whose
    strategies check their slots), not one that indexes slots one by one (disk, codecs)."""
    return not any(isinstance(tier, DiskTier | QuantPool) for tier in (src, dst))


def _rows(data: torch.Tensor | Sequence[torch.Tensor], rows: list[int]) -> torch.Tensor:
    return torch.stack([data[i] for i in rows])
