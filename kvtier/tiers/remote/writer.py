"""Writes to the remote tier behind the caller: one thread, a bounded backlog, drops counted.

`submit(seed, ids, start, blocks)` queues blocks start.. of a path and returns at once; the
thread writes them with `RemoteTier.write`. A submission is queued as far as the backlog's room
under `max_pending_bytes` goes, its leading blocks (a reader needs a prefix: a tail without its
head is worth nothing), the rest dropped and counted (`dropped_blocks`); an idle writer takes
at least one block, so a store larger than the bound (or a bound below one block) still shares
its head. The writer copies into host memory the blocks it takes, and only those: what it
holds is what `pending_bytes` says (never a view pinning a larger copy; of the path's ids, only
the ones its write reads, at most two a block and one more: `PathIds`). A slow or dead cluster
costs a store a counter, never a wait. `drain` waits until the backlog is written (or its
timeout); `close` stops the thread and drops what is left.
Thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch

from kvtier.text import ERROR_CHARS, printable
from kvtier.tiers.remote.tier import RemoteTier


class PathIds(Sequence[bytes]):
    """The ids a write of blocks start..stop-1 of a path reads, by position: each block's, its
    parent's, its group's first (`entry.path_keys`); its length is the path's up to `stop`. A
    job keeps this, not the path: the ids before its blocks (57 bytes each, not in
    `pending_bytes`), up to a group of 4,096 of them for each job of one block, held a backlog
    of 40 one-block jobs at 9 MiB beside 5 KiB of blocks (module doc: it holds what it says).
    Only those positions are read (`tier.RemoteTier.write`)."""

    def __init__(self, ids: Sequence[bytes], start: int, stop: int, group_blocks: int) -> None:
        read = set(range(max(0, start - 1), stop))
        read.update(p - p % group_blocks for p in range(start, stop))
        self._ids = {p: ids[p] for p in read}
        self._length = stop

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, at: int) -> bytes: ...

    @overload
    def __getitem__(self, at: slice) -> Sequence[bytes]: ...

    def __getitem__(self, at: int | slice) -> bytes | Sequence[bytes]:
        assert isinstance(at, int) and at in self._ids, f"position {at}: not one a write reads"
        return self._ids[at]


@dataclass(frozen=True)
class _Job:
    seed: bytes
    ids: Sequence[bytes]
    start: int
    blocks: list[torch.Tensor]
    nbytes: int


class RemoteWriter:
    def __init__(self, tier: RemoteTier, max_pending_bytes: int) -> None:
        self.tier = tier
        self.max_pending_bytes = max_pending_bytes
        self._jobs: deque[_Job] = deque()
        self._pending = 0  # bytes queued or being written
        self._cond = threading.Condition()
        self._closed = False
        self.stats = dict.fromkeys(("queued_blocks", "written_blocks", "failed_blocks"), 0)
        self.stats["dropped_blocks"] = 0
        self.last_error = ""  # why the last write that failed failed (the cluster's error)
        self._thread = threading.Thread(target=self._run, name="kvtier-remote-writer", daemon=True)
        self._thread.start()

    def submit(self, seed: bytes, ids: Sequence[bytes], start: int, blocks: torch.Tensor) -> bool:
        """Queue blocks start.. of the path `ids` (`blocks`, `[n, *block_shape]`, on any device:
        copied, the caller keeps them), as many leading ones as the backlog has room for
        (module doc); whether all were queued (the rest dropped, counted; all of them once the
        writer is closed)."""
        size = math.prod(blocks.shape[1:]) * blocks.element_size()
        with self._cond:
            room = max(0, self.max_pending_bytes - self._pending)
            taken = min(len(blocks), room // size) if size else len(blocks)
            if self._closed:
                taken = 0
            elif not taken and not self._pending:
                taken = min(1, len(blocks))  # an idle writer takes one block whatever its size
            self.stats["dropped_blocks"] += len(blocks) - taken
            if taken:
                kept = blocks[:taken].detach().to("cpu", copy=True)  # its own: what it counts
                path = PathIds(ids, start, start + taken, self.tier.group_blocks)
                self._jobs.append(_Job(seed, path, start, list(kept.unbind(0)), taken * size))
                self._pending += taken * size
                self.stats["queued_blocks"] += taken
                self._cond.notify_all()
        return taken == len(blocks)

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._pending

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block was written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return not self._pending

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self.stats["dropped_blocks"] += sum(len(job.blocks) for job in self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def check(self) -> None:
        with self._cond:
            assert self._pending >= 0 and all(v >= 0 for v in self.stats.values()), self.stats
            assert self._pending >= sum(job.nbytes for job in self._jobs)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
            try:
                done = self.tier.write(job.seed, job.ids, job.start, job.blocks)
            except Exception as e:  # a bug, not the cluster (which never raises): say it, go on
                self.last_error = printable(f"{type(e).__name__}: {e}", ERROR_CHARS)
                done = [False] * len(job.blocks)
            else:
                if not all(done):  # the cluster's reason: its last error (no exception here)
                    why = self.tier.cluster.last_error or "the cluster did not take them"
                    failed = f"{len(done) - sum(done)} blocks not written: {why}"
                    self.last_error = printable(failed, ERROR_CHARS)
            with self._cond:
                self._pending -= job.nbytes
                self.stats["written_blocks"] += sum(done)
                self.stats["failed_blocks"] += len(done) - sum(done)
                self._cond.notify_all()
