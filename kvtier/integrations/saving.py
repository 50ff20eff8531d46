"""The vLLM connector's saves on its worker side (`vllm.py`): inline, or in order on a thread of
their own so that a step does not wait for kvtier.

Contract:
- `run(jobs, wait)`: with `wait`, each job is saved before `run` returns; otherwise jobs are
  queued to one thread, which saves them in the order given (a finished request's `release`
  job after its prompt's save). On a GPU the thread first waits, on a stream of its own, for
  the work queued on the caller's stream when `run` was called (the step's forward, which
  wrote the blocks).
- A job's blocks must keep their KV until it is done, which is the scheduler's side to ensure:
  a running request keeps its blocks; a finished one's are held until its `release` job is
  reported (`take_sent`); a preempted one's are freed at once, so a step whose plan names
  preemptions calls `flush` before its forward may write them.
- `store_job` is the store itself, from vLLM's paged KV (`load_job`, a load into it): the KV
  past the prefix kvtier was seen to hold (`job.start`) is copied out and stored below it; if
  that prefix has left kvtier since (the store reports less cached than `start`), all of it is:
  so every block of a job must hold its tokens' KV, below `start` too (the connector cuts a
  save before the first block a load of its step did not fill: `plans.cut_before`).
- `save` (the connector's: `store_job`, then counts) is never let raise here: a failure is logged
  by it. Every `release` job is reported in `take_sent` once done, saved or not, and is never
  dropped; others are skipped (counted in `skipped`) while `backlog` jobs are queued, so a
  sidecar slower than the engine costs later misses, not a queue that grows without bound.
  A job is not saved (its blocks, a `release` job's too; counted in `skipped`) while `ready()`
  is False (the connector's: a call to the sidecar went unanswered just now), so the jobs
  queued behind one that waited for a hung sidecar are not each let wait as long.
- `drop()` (the engine's weights changed: `resets.py`): the queued jobs are not saved (their
  `release` jobs still reported), and it returns once the one running, if any, is done.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvtier.client import Client
from kvtier.integrations import paged
from kvtier.integrations.plans import LoadJob, SaveJob

BACKLOG = 64  # queued jobs past which a prompt's save is skipped


class Saves:
    def __init__(
        self,
        save: Callable[[SaveJob], None],
        ready: Callable[[], bool] = lambda: True,
        backlog: int = BACKLOG,
    ) -> None:
        self.save, self.ready, self.backlog = save, ready, backlog
        self.skipped = 0
        self.thread: ThreadPoolExecutor | None = None  # made on the first queued job
        self._queued: deque[Future[None]] = deque()
        self._sent: set[str] = set()
        self._lock = threading.Lock()
        self._stream: Any = None  # the thread's CUDA stream, made with the thread
        self.epoch = 0  # jobs queued in an earlier epoch are not saved (`drop`)

    def run(self, jobs: Iterable[SaveJob], wait: bool, device: torch.device) -> None:
        if wait:
            for job in jobs:
                self._one(job, None)
            return
        while self._queued and self._queued[0].done():
            self._queued.popleft()
        ready = None
        for job in jobs:
            if not job.release and len(self._queued) >= self.backlog:
                self._skip()
                continue
            if self.thread is None:
                self.thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
                if device.type == "cuda":
                    self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if ready is None and self._stream is not None:
                ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ready.record()  # after this step's forward, on the caller's stream
            self._queued.append(self.thread.submit(self._one, job, ready, self.epoch))

    def flush(self) -> None:
        """Return once every queued job is done."""
        while self._queued:
            self._queued.popleft().exception()  # waits; `save` logs its own failures

    def drop(self) -> None:
        """Save none of the queued jobs; return once the running one is done."""
        self.epoch += 1
        self.flush()

    def take_sent(self) -> set[str]:
        """The `release` jobs done since the last call, by request id."""
        with self._lock:
            sent, self._sent = self._sent, set()
        return sent

    def close(self) -> None:
        self.flush()
        if self.thread is not None:
            self.thread.shutdown(wait=True)

    def _skip(self) -> None:
        with self._lock:  # counted by the caller's thread and by the saves' thread
            self.skipped += 1

    def _one(self, job: SaveJob, ready: Any, epoch: int | None = None) -> None:
        try:
            if epoch is not None and epoch != self.epoch:
                pass  # dropped: the KV it holds is the old weights'
            elif job.blocks and not self.ready():
                self._skip()  # the sidecar did not answer just now: no wait of its own
            elif ready is None:
                self.save(job)
            else:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready)
                    self.save(job)  # its copy to the host synchronizes this stream
        finally:
            if job.release:
                with self._lock:
                    self._sent.add(job.req_id)


def store_job(client: Client, layers: list[torch.Tensor], job: SaveJob, bs: int) -> tuple[int, int]:
    """Store `job` from vLLM's paged `layers` (blocks of `bs` tokens) through `client` (module
    doc); (tokens whose KV was copied, tokens newly stored)."""
    if not job.blocks:  # a release only: the request's earlier saves are done
        return 0, 0
    tokens, start = list(job.tokens), job.start
    stored = client.store(
        tokens, paged.gather(layers, job.blocks[start // bs :]).cpu(), start=start
    )
    if start and stored.cached_tokens < start:  # the prefix left kvtier since: send it all
        start, stored = 0, client.store(tokens, paged.gather(layers, job.blocks).cpu())
    return len(tokens) - start, stored.stored_tokens


def load_job(client: Client, layers: list[torch.Tensor], job: LoadJob, bs: int) -> int:
    """Load `job` into vLLM's paged `layers` (blocks of `bs` tokens) through `client`: only the
    tokens vLLM lacks (its own prefix cache holds those before `job.start`); how many of
    `job.blocks`, from the first, it filled (the rest: kvtier holds less than planned)."""
    got = client.load(list(job.tokens), start=job.start)
    filled = max(0, min(len(job.blocks), (got.num_tokens - job.start) // bs))
    if filled:
        paged.scatter(layers, job.blocks[:filled], got.kv[:, :, : filled * bs])
    return filled
