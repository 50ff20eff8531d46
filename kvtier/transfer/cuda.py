"""`CudaExecutor`: block copies between a CUDA pool and host memory on two copy streams.

    engine stream  ──●──────────────────────────────►   ● ready: recorded on the engine stream
                      ╲ wait_event(ready)                 at submit
    d2h stream     ────●══copy══copy══○───────────►    ○ done: recorded behind the last copy;
    h2d stream     ───────────●══copy══○──────────►      event.query() says it has completed

One stream per direction (device->host, host->device), so a prefetch never queues behind a
demotion. A copy submitted from another thread than the engine's (the mover's) cannot see the
engine's stream; the store therefore calls `mark_engine()` from the engine's thread after it
writes pool slots and when a lease is released, and every later copy also waits for that mark.
Each submit is ordered after everything already enqueued on the engine's stream (the
one given, or else the submitting thread's current stream), so a copy out of the gpu pool sees
what the engine wrote and a copy into it cannot overtake the engine's last reads of the slots'
previous blocks. Whole blocks move as slice copies merged by `contiguous_runs` (issued with
`non_blocking=True`) or, where CuPy is installed and the host pool is pinned, as one launch of
the block-copy kernel (`kernels/block_copy.py`): the executor's `planner` times both on the
first copies of each kind (CUDA events around the copies, read once they have completed) and
keeps the faster. A layer range always moves as slice copies. Copies overlap with host code
only when the host pool is pinned (with pageable memory CUDA copies synchronously, which is
correct but slow). Completion is observed
by `event.query()` in `done()` and `poll()`, never by a synchronize. The events of one stream
complete in order, so each stream's handles are reaped from the front of its queue. `wait()` on
a handle polls with backoff.

Host <-> disk transfers (and host <-> host) are delegated to an internal `ThreadExecutor`.
A disk copy straight to or from a CUDA pool is refused (`InvalidArgumentError`): the tiers
stage disk blocks through host memory, and a thread's copy into device memory would return
before the device has the data.

Pool buffers are owned by their pools, so no `record_stream` is needed; the executor does not
keep slots allocated (shared.py: that is the caller's part). An exception raised while the
copies are enqueued is kept and reported by `result()` once the copies already enqueued have
completed, so that a failed transfer is never done while a copy of it can still land. An
asynchronous CUDA error (a sticky, fatal one) is raised by the `event.query()` that meets it.
Importable without CUDA; construction raises `ConfigError` there. (torch's `Stream` and `Event`
carry no type hints, hence the `no-untyped-call` ignores.)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ClosedError, ConfigError, InvalidArgumentError, InvalidKVError
from kvtier.kernels.block_copy import (
    CopyStrategy,
    applies_anywhere,
    copy_blocks_kernel,
    find_runs,
    kernel_applies,
)
from kvtier.kernels.slots import Run, check_runs, check_slots
from kvtier.tiers import SlotPool
from kvtier.tiers.base import Tier
from kvtier.tiers.quantized import QuantPool
from kvtier.transfer.copy import Ledger, Transfer
from kvtier.transfer.encoded import pool_to_pool
from kvtier.transfer.planner import CopyKey, CopyPlanner, copy_key
from kvtier.transfer.shared import POLL_MAX_S, Runner, TransferHandle
from kvtier.transfer.threads import ThreadExecutor

_ROUTES: dict[tuple[str, str], str] = {
    ("cuda", "cpu"): "d2h",
    ("cpu", "cuda"): "h2d",
    ("cpu", "cpu"): "threads",
    ("cpu", "disk"): "threads",
    ("disk", "cpu"): "threads",
}
"""(source medium, destination medium) -> copy stream, or the thread executor."""


def _slices_on_stream(
    src: torch.Tensor, dst: torch.Tensor, src_slots: Sequence[int], dst_slots: Sequence[int]
) -> None:
    """One `copy_(non_blocking=True)` per run, enqueued on the current stream."""
    _runs_on_stream(src, dst, find_runs(src_slots, dst_slots))


def _runs_on_stream(src: torch.Tensor, dst: torch.Tensor, runs: Sequence[Run]) -> None:
    check_runs(runs, len(src), len(dst))  # a slice past the end is shorter, not an error
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)


_STREAM_STRATEGIES = (
    CopyStrategy("slices", _slices_on_stream, applies_anywhere, _runs_on_stream),
    CopyStrategy("kernel", copy_blocks_kernel, kernel_applies),
)
"""What the planner chooses from for whole blocks; both only enqueue on the current stream."""


@dataclass(frozen=True)
class _Sample:
    """A copy the planner measures: its key and strategy, and an event recorded before it."""

    key: CopyKey
    strategy: str
    blocks: int
    start: torch.cuda.Event


@dataclass(frozen=True)
class _InFlight:
    handle: TransferHandle
    done: torch.cuda.Event
    error: Exception | None  # raised while enqueueing; reported once `done` has completed
    started: float  # monotonic time of the submit, for the ledger's bandwidth
    sample: _Sample | None  # timed from `sample.start` to `done`, when the planner measures


def _medium(tier: Tier) -> str:
    return tier.device.type if isinstance(tier, SlotPool) else "disk"


class CudaExecutor:
    """Runs gpu<->host copies on one CUDA stream per direction; see the module doc."""

    polled = True  # completion is observed by querying events: the mover polls while busy

    def __init__(
        self,
        device: torch.device | str = "cuda",
        engine_stream: torch.cuda.Stream | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        """Copy streams on `device`. Copies are ordered after `engine_stream`, or, when None,
        after the current stream of the thread that calls `submit` (pass the engine's stream
        when a mover thread submits). `ledger`: where bytes moved are counted."""
        if not torch.cuda.is_available():
            raise ConfigError(
                "transfer.device",
                str(device),
                "a 'cuda' device (torch.cuda.is_available() is false)",
            )
        device = torch.device(device)
        if device.type != "cuda":
            raise ConfigError("transfer.device", str(device), "a 'cuda' device")
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        self._streams = {
            "d2h": torch.cuda.Stream(self.device),  # type: ignore[no-untyped-call]
            "h2d": torch.cuda.Stream(self.device),  # type: ignore[no-untyped-call]
        }
        self._engine_stream = engine_stream
        self.ledger = ledger if ledger is not None else Ledger()
        self.planner = CopyPlanner(_STREAM_STRATEGIES)  # its `choices`: slices or kernel, per key
        self._threads = ThreadExecutor(ledger=self.ledger)
        # `_submit_lock` orders enqueueing (and guards `_closed`); `_lock` guards the queues of
        # events and `_completed`, and is never held while copies are enqueued, so
        # `done()` and `poll()` do not wait behind a long submit. Order: submit, then lock.
        self._submit_lock = threading.Lock()
        self._lock = threading.Lock()
        self._in_flight: dict[str, deque[_InFlight]] = {key: deque() for key in self._streams}
        self._completed: list[TransferHandle] = []
        self._engine_mark: torch.cuda.Event | None = None  # the latest `mark_engine()`
        self._closed = False

    def mark_engine(self) -> None:
        """Record where the calling thread's stream (or the engine stream) is now: every copy
        submitted later, from any thread, waits for the work enqueued there so far."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._engine_stream or torch.cuda.current_stream(self.device))
        self._engine_mark = event

    @property
    def bytes_moved(self) -> dict[tuple[str, str], int]:
        """Bytes of completed copies per path, streams and threads together (a snapshot)."""
        return self.ledger.bytes_moved

    def in_call_runner(self, inline: Runner) -> Runner:
        """Itself: a copy made inside a store call must wait for the engine's marks too."""
        return self

    def queued(self) -> int:
        """Transfers submitted and not yet complete (queue depth), streams and threads."""
        with self._lock:
            on_streams = sum(len(queue) for queue in self._in_flight.values())
        return on_streams + self._threads.queued()

    def submit(self, transfer: Transfer) -> TransferHandle:
        """Enqueue the copies of `transfer` behind the current stream and return its handle."""
        route = _ROUTES.get((_medium(transfer.src), _medium(transfer.dst)))
        if route is None:
            raise InvalidArgumentError(
                f"CudaExecutor: no route for {transfer.path} "
                f"({_medium(transfer.src)} -> {_medium(transfer.dst)}); expected cuda <-> cpu "
                "pools, or cpu pool <-> disk"
            )
        if route == "threads":
            with self._submit_lock:
                self._ensure_open()
            return self._threads.submit(transfer)
        src, dst = transfer.src, transfer.dst
        assert isinstance(src, SlotPool) and isinstance(dst, SlotPool)
        gpu = src if route == "d2h" else dst
        if gpu.buffer.device != self.device:  # the buffer's device has its index
            raise InvalidArgumentError(
                f"CudaExecutor on {self.device}: pool {gpu.name!r} is on {gpu.device}"
            )
        handle = TransferHandle(transfer, probe=self._reap)
        stream = self._streams[route]
        with self._submit_lock:  # one submit at a time: each queue is in its stream's order
            self._ensure_open()
            started = time.monotonic()
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            engine = self._engine_stream or torch.cuda.current_stream(self.device)
            ready.record(engine)
            stream.wait_event(ready)
            mark = self._engine_mark
            if mark is not None:  # the engine's writes and reads, seen from another thread
                stream.wait_event(mark)
            error: Exception | None = None
            sample: _Sample | None = None
            with torch.cuda.stream(stream):
                try:
                    sample = self._enqueue(transfer, src.buffer, dst.buffer, stream)
                except Exception as exc:
                    error = exc
                timed = sample is not None
                done = torch.cuda.Event(enable_timing=timed)  # type: ignore[no-untyped-call]
                done.record(stream)
            with self._lock:
                self._in_flight[route].append(_InFlight(handle, done, error, started, sample))
        return handle

    def _enqueue(
        self, transfer: Transfer, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream
    ) -> _Sample | None:
        """Enqueue the copies of `transfer` on `stream`, the current one: a layer range as
        slice copies per run, whole blocks by the planner's pick; returns the sample to record
        when the planner measures this copy."""
        if isinstance(transfer.src, QuantPool) or isinstance(transfer.dst, QuantPool):
            # encoded on the gpu and fetched (a sync), or decoded there by the Triton kernel on
            # this stream (`encoded.py`); a block the codec cannot keep fails the transfer
            assert isinstance(transfer.src, SlotPool) and isinstance(transfer.dst, SlotPool)
            slots = (transfer.src_slots, transfer.dst_slots)
            check_slots(*slots, transfer.src.num_slots, transfer.dst.num_slots)
            if not all(pool_to_pool(transfer.src, transfer.dst, *slots, transfer.layers)):
                raise InvalidKVError(f"{transfer.path}: a block the host's codec cannot keep")
            return None
        runs = find_runs(transfer.src_slots, transfer.dst_slots)
        if transfer.layers is not None:
            first, stop = transfer.layers
            check_runs(runs, len(src), len(dst))
            for s, d, n in runs:
                dst[d : d + n, first:stop].copy_(src[s : s + n, first:stop], non_blocking=True)
            return None
        blocks = len(transfer.src_slots)
        key = copy_key(src, dst, len(runs), blocks)
        pick = self.planner.pick(key)
        sample = None
        if pick.measure:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(stream)
            sample = _Sample(key, pick.strategy.name, blocks, start)
        pick.strategy.copy_found(src, dst, transfer.src_slots, transfer.dst_slots, runs)
        return sample

    def run(self, transfer: Transfer) -> list[bool]:
        """Submit and wait: for copies a caller needs done now (the store's room-making), which
        must still be ordered after the engine's marks."""
        handle = self.submit(transfer)
        handle.wait()
        return handle.result()

    def poll(self) -> list[TransferHandle]:
        """Handles completed since the last poll: the thread executor's, then the streams'."""
        delegated = self._threads.poll()
        self._reap()
        with self._lock:
            completed, self._completed = self._completed, []
        return delegated + completed

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Refuse new transfers; wait up to `timeout_s` for those in flight to complete."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._threads.close(timeout_s)
        while self._pending() and (deadline is None or time.monotonic() < deadline):
            time.sleep(POLL_MAX_S)
            self._reap()

    def _pending(self) -> bool:
        with self._lock:
            return any(self._in_flight.values())

    def _reap(self) -> None:
        """Settle the handles whose completion event has fired, then run their callbacks (the
        first exception of a callback is raised to the caller: of `done`, `wait` or `poll`)."""
        settled: list[TransferHandle] = []
        with self._lock:
            for queue in self._in_flight.values():
                while queue and queue[0].done.query():  # type: ignore[no-untyped-call]
                    item = queue.popleft()
                    transfer = item.handle.transfer
                    if item.error is None:
                        item.handle.settle([True] * len(transfer.src_slots), None)
                        self.ledger.record(transfer.path, transfer.nbytes, item.started)
                        if item.sample is not None:
                            sample = item.sample
                            seconds = sample.start.elapsed_time(item.done) / 1e3
                            self.planner.record(sample.key, sample.strategy, seconds, sample.blocks)
                    else:
                        item.handle.settle(None, item.error)
                    self._completed.append(item.handle)
                    settled.append(item.handle)
        first: Exception | None = None
        for handle in settled:  # every handle's callbacks run, even if one of them raises
            try:
                handle.run_callbacks()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first

    def _ensure_open(self) -> None:
        if self._closed:
            raise ClosedError("the CUDA executor is closed; submit before close()")
