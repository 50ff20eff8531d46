"""Which block-copy strategy to use, chosen by measuring the first real copies.

    copy k of a key ──► pick(key) ──► while measuring: the candidate picked least so far
                                      (slices, gather, kernel, slices, gather, ...), timed
                                 └──► then: the fastest, for good
    record(key, strategy, seconds, blocks) ── once every candidate has `samples` samples, the
                                              lowest median seconds per block is chosen

A key is what the cost of a copy depends on: the two memories (`block_copy.medium`: a CUDA
device, pinned or pageable host memory), the block size, and the numbers of runs and of blocks,
each rounded up to a power of two (runs of slots consecutive on both sides: one slice copy each).
The candidates of a key are the strategies of `kernels/block_copy.py` that apply to its memories:
the torch ones everywhere, the CUDA kernel where CuPy and a pinned or device side allow it. A key
with one candidate needs no measurement. A key of one run has one candidate, `slices`: a single
`copy_` of consecutive slots is what every other strategy approximates, and trying `gather` on
it cost a second pass (a 1 GiB commit took 1-2 s instead of 0.15-0.2 s while measured).

A strategy that raises on a copy (torch without a kernel for its buffers' dtype or device, a
`RuntimeError` or `TypeError`) is refused for that key (`refuse`): never picked for it again,
while the copy goes on with the next candidate, so the caller sees an error only when none is
left (`InvalidArgumentError`). A kvtier error (a bad slot, which every strategy checks alike) is
the caller's, and passes through.

`CopyPlanner` keeps the samples and the choices, behind a lock, so that one thread can pick
while another records (`CudaExecutor` records when a copy's events have completed).
`BlockCopier` is the synchronous user (`InlineExecutor`): it times each measured copy with its
clock (`time.perf_counter`), waiting for the CUDA devices involved before and after, so that a
sample is the whole copy and nothing queued before it; copies it does not measure never wait
beyond what the strategy itself does. Tests drive both with fake strategies and clocks.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvtier.errors import InvalidArgumentError, KVTierError
from kvtier.kernels.block_copy import STRATEGIES, CopyStrategy, find_runs, medium
from kvtier.kernels.slots import Run

SAMPLES = 3
"""Timed copies per candidate before a key's choice; the median discounts one outlier (a first
touch of fresh pages, a compile)."""


def bucket(n: int) -> int:
    """`n` rounded up to a power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, n - 1).bit_length()


class CopyKey(NamedTuple):
    """What a copy's cost depends on; `runs` and `blocks` are `bucket`s, as upper bounds. A
    tuple, made and hashed once per copy in C: `copy_key` took 12.9 us here with a frozen
    dataclass, 9.0 us as a tuple with `medium` and `block_bytes` also cheaper."""

    src: str  # block_copy.medium of the source buffer
    dst: str
    block_bytes: int
    runs: int
    blocks: int

    def __str__(self) -> str:
        return f"{self.src}->{self.dst} {self.block_bytes}B runs<={self.runs} blocks<={self.blocks}"


def copy_key(src: torch.Tensor, dst: torch.Tensor, runs: int, blocks: int) -> CopyKey:
    """The key of copying `blocks` whole blocks in `runs` runs from pool buffer `src` to `dst`."""
    block_bytes = math.prod(src.shape[1:]) * src.element_size()
    return CopyKey(medium(src), medium(dst), block_bytes, bucket(runs), bucket(blocks))


@dataclass(frozen=True)
class Pick:
    """The strategy for one copy, and whether the planner wants its time (`record`)."""

    strategy: CopyStrategy
    measure: bool


@dataclass
class _Trial:
    """One key's measurement: its candidates, picks handed out, and samples per candidate."""

    candidates: tuple[CopyStrategy, ...]
    picked: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)  # seconds per block


class CopyPlanner:
    """Per `CopyKey`, the fastest of the applicable strategies, measured on the first copies."""

    def __init__(
        self, strategies: Sequence[CopyStrategy] = STRATEGIES, samples: int = SAMPLES
    ) -> None:
        assert samples >= 1, f"samples {samples}"
        self._strategies = tuple(strategies)
        self._samples = samples
        self._lock = threading.Lock()
        self._trials: dict[CopyKey, _Trial] = {}
        self._chosen: dict[CopyKey, CopyStrategy] = {}
        self._refused: dict[CopyKey, set[str]] = {}

    def pick(self, key: CopyKey) -> Pick:
        """The strategy for the next copy of `key`: the chosen one once measured; until then
        the candidate picked least often so far (ties: in table order), to be timed."""
        with self._lock:
            chosen = self._chosen.get(key)
            if chosen is not None:
                return Pick(chosen, measure=False)
            trial = self._trials.get(key)
            if trial is None:
                candidates = self._candidates(key)
                assert candidates, f"no copy strategy applies to {key}"
                if len(candidates) == 1:
                    self._chosen[key] = candidates[0]
                    return Pick(candidates[0], measure=False)
                trial = self._trials[key] = _Trial(candidates)
            strategy = min(trial.candidates, key=lambda s: trial.picked.get(s.name, 0))
            trial.picked[strategy.name] = trial.picked.get(strategy.name, 0) + 1
            return Pick(strategy, measure=True)

    def record(self, key: CopyKey, strategy: str, seconds: float, blocks: int) -> None:
        """A measured copy of `key`: `strategy` moved `blocks` blocks in `seconds`. Once every
        candidate has its samples, the lowest median per block is chosen (ties: table order) and
        the samples are dropped; a sample that arrives after the choice is ignored."""
        with self._lock:
            trial = self._trials.get(key)
            if trial is None:  # chosen already: a copy picked while the last samples came in
                return
            trial.samples.setdefault(strategy, []).append(seconds / blocks)
            self._settle(key, trial)

    def refuse(self, key: CopyKey, strategy: str) -> bool:
        """`strategy` raised on a copy of `key` (module doc): it is never picked for `key`
        again; its samples are dropped and, if the others have theirs, the choice is made
        among them. Returns whether another strategy is left to copy `key`."""
        with self._lock:
            self._refused.setdefault(key, set()).add(strategy)
            chosen = self._chosen.get(key)
            if chosen is not None and chosen.name == strategy:
                del self._chosen[key]
            trial = self._trials.get(key)
            if trial is not None:
                trial.candidates = tuple(s for s in trial.candidates if s.name != strategy)
                trial.samples.pop(strategy, None)
                if trial.candidates:
                    self._settle(key, trial)
                else:
                    del self._trials[key]
            return bool(self._candidates(key))

    def _candidates(self, key: CopyKey) -> tuple[CopyStrategy, ...]:
        """The strategies that apply to `key`'s memories and have not been refused for it;
        `slices` alone for one run (module doc) where it is among them."""
        refused = self._refused.get(key, set())
        candidates = tuple(
            s for s in self._strategies if s.applies(key.src, key.dst) and s.name not in refused
        )
        if key.runs == 1:  # one run is one copy_: nothing beats it, nothing to try
            return tuple(s for s in candidates if s.name == "slices") or candidates
        return candidates

    def _settle(self, key: CopyKey, trial: _Trial) -> None:
        """Choose for `key` once every candidate of `trial` has its samples (the lowest median
        per block, ties in table order); the lock is held."""
        medians: dict[str, float] = {}
        for candidate in trial.candidates:
            samples = trial.samples.get(candidate.name, [])
            if len(samples) < self._samples:
                return
            medians[candidate.name] = statistics.median(samples)
        self._chosen[key] = min(trial.candidates, key=lambda s: medians[s.name])
        del self._trials[key]

    @property
    def choices(self) -> dict[CopyKey, str]:
        """The name of the strategy chosen per key so far (a snapshot); a key being measured,
        or not yet copied, is absent."""
        with self._lock:
            return {key: strategy.name for key, strategy in self._chosen.items()}


class BlockCopier:
    """Copies whole blocks between pool buffers with its planner's pick, timing the copies the
    planner measures. One per thread: it is not locked (its planner is)."""

    def __init__(
        self,
        planner: CopyPlanner | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.planner = planner if planner is not None else CopyPlanner()
        self._clock = clock

    def copy(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_slots: Sequence[int],
        dst_slots: Sequence[int],
    ) -> str:
        """Copy block `src_slots[i]` of `src` into slot `dst_slots[i]` of `dst` for every i,
        complete as `Tensor.copy_` leaves a copy (block_copy's module doc); returns the name of
        the strategy used. Nothing else of `dst` is written. At least one block. A strategy
        that raises is refused and the next one copies (module doc); `InvalidArgumentError`
        when none is left. Slots a strategy refuses (not integers, out of range, a repeated
        destination) are `InvalidArgumentError` from each alike, and retire none of them."""
        runs = find_runs(src_slots, dst_slots)  # as many, integers: not a strategy's TypeError
        assert len(src_slots), "a copy of no blocks"  # (len: an array of slots has no truth)
        key = copy_key(src, dst, len(runs), len(src_slots))
        while True:
            pick = self.planner.pick(key)
            try:
                self._copy(pick, key, src, dst, src_slots, dst_slots, runs)
                return pick.strategy.name
            except KVTierError:
                raise
            except (RuntimeError, TypeError) as e:  # torch has no kernel for these buffers
                if not self.planner.refuse(key, pick.strategy.name):
                    raise InvalidArgumentError(
                        f"block copy: no strategy copies {src.dtype} blocks from {key.src} to "
                        f"{key.dst} ({pick.strategy.name}, the last, raised {e!r:.120}); "
                        "expected buffers torch can copy"
                    ) from e

    def _copy(
        self,
        pick: Pick,
        key: CopyKey,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_slots: Sequence[int],
        dst_slots: Sequence[int],
        runs: Sequence[Run],
    ) -> None:
        """One copy with `pick`'s strategy, timed and recorded if the planner measures it."""
        strategy = pick.strategy
        if not pick.measure:
            strategy.copy_found(src, dst, src_slots, dst_slots, runs)
            return
        _wait_for_devices(src, dst)
        started = self._clock()
        strategy.copy_found(src, dst, src_slots, dst_slots, runs)
        _wait_for_devices(src, dst)
        self.planner.record(key, strategy.name, self._clock() - started, len(src_slots))


def _wait_for_devices(*buffers: torch.Tensor) -> None:
    """Wait until every CUDA device among `buffers` has run all it was given."""
    for device in {b.device for b in buffers if b.device.type == "cuda"}:
        torch.cuda.synchronize(device)
