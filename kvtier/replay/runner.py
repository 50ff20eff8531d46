"""Replay a request trace against a real `KVStore`: real pools, a real disk tier, the mover.

Per request, in trace order (sleeping to the trace's clock only when `speed` is given):

    hit = store.lookup(tokens)                  timed: lookup latency
    if hit.host_tokens or hit.disk_tokens:      the cached prefix is partly below gpu
        lease = store.prefetch(tokens)          timed: prefetch-to-ready latency
        store.release(lease)
    store.store(tokens, kv)                     the request's blocks not cached yet

Tokens served per tier are read from the lookup, before the prefetch moves anything; what the
lookup does not cover is recomputed. The KV is one zero token `expand`ed to the longest request
(`zero_kv`: a store only reads it, so one token of memory serves a request of 2**20 tokens of
64 MiB blocks), sliced: its content does not matter for hit rates, but the store copies it like
any other.

Drops. A store that cannot place blocks drops them (`StoreResult.dropped_tokens`): always the
request's last ones (what is cached, then what is pending on disk, come first), and all of its
new blocks when no memory tier can take them at once (`writes.py`), however many would fit.
`Drops` keeps the keys of the blocks whose latest store was dropped, so that the recomputed
tokens split into those recomputed because their store was dropped and the misses (never
stored, or evicted).

Sizes. The model is scaled down to 1 layer, 1 KV head, float16 and `head_dim` chosen so that
512 tokens are `block_bytes`; a store block is `block_tokens` (dividing 512 and the trace's
block, `trace_block_tokens`: 512 in Mooncake's traces) of those tokens. Tier sizes are fractions
of the trace's unique blocks: a memory tier of fraction f holds round(f * unique) trace blocks'
store blocks (at least one); the disk tier gets as many slots (each slot is a
header region plus the payload, `tiers/disk/format.py`). Host 0 means no host tier
(`tiers.host: null`; disk must be 0 too: `Sizing`), disk 0 means no disk tier.
`capacity_blocks` is the sum of the tiers a sizing asks for (gpu alone for a gpu-only run): the
size of the one-cache simulations it is compared with.

Pacing. With `speed`, request i is due `(t_i - t_0) / speed` seconds after the first request
starts (the store is open by then); the replay sleeps until it is due, or starts it late when
the previous requests ran past it, and reports how far behind it fell (`Pacing`): a request's
lag is measured when it starts, after any sleep, so a sleep that ended late counts too. A schedule
longer than `MAX_PACED_S` is refused before the store opens.

Threads. The replay runs with one torch intra-op thread (restored afterwards): its copies are
of a few KiB, and on 2 cores the default pool doubled the replay's time for the same figures.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvtier.blocks import BlockHasher, KVLayout
from kvtier.config import KVTierConfig, parse_config
from kvtier.errors import CapacityError, InvalidArgumentError, shown
from kvtier.replay.memory import check_memory
from kvtier.replay.report import TIERS, Latency, Pacing, ReplayResult, Sizing
from kvtier.replay.trace import (
    TRACE_BLOCK_TOKENS,
    Ceiling,
    TraceRequest,
    trace_block_tokens,
)
from kvtier.store import KVStore
from kvtier.tiers.disk.format import header_region_size, slot_size

_BYTES_PER_HEAD_DIM = 2 * TRACE_BLOCK_TOKENS * 2  # K and V, 512 tokens, float16

LATE_S = 0.01
"""A paced request that starts more than this after it was due counts as late."""

MAX_PACED_S = 7 * 86_400
"""The longest schedule a paced replay keeps (a week): longer is a tiny `speed` or a gap in
the trace, refused before the store opens rather than slept through."""

MAX_BLOCK_BYTES = 64 * 2**20
"""The largest `block_bytes`: a 512-token block of Llama-3.1-8B, the real size at the top."""


@dataclass(frozen=True)
class ReplayOptions:
    """How a trace is replayed; the defaults replay fast and deterministically.

    `background: False` runs the mover's copies in the calling thread (`mover.background`):
    the same code as the background mover, without thread timing, so a replay as fast as
    possible neither outruns nor waits for the disk and two runs give the same figures.
    `speed`: None replays without sleeping; x > 0 keeps the trace's clock, x times faster.
    `directory`: the existing, writable directory where the disk tier's temporary directory is
    made (the system's default when None; checked by making and removing one); it is removed
    after the run."""

    block_tokens: int = TRACE_BLOCK_TOKENS
    block_bytes: int = 4096
    trace_block_tokens: int = TRACE_BLOCK_TOKENS  # the tokens a trace id names
    background: bool = False
    write: str = "write_through"
    speed: float | None = None
    directory: str | None = None
    check: bool = True

    def __post_init__(self) -> None:
        bt = self.block_tokens
        trace_bt = trace_block_tokens(self.trace_block_tokens, "trace_block_tokens")
        if type(bt) is not int or bt < 1 or TRACE_BLOCK_TOKENS % bt or trace_bt % bt:
            raise InvalidArgumentError(
                f"block_tokens: got {shown(bt)}, expected a divisor of {TRACE_BLOCK_TOKENS} and of "
                f"the trace's block ({trace_bt})"
            )
        if (
            type(self.block_bytes) is not int
            or not _BYTES_PER_HEAD_DIM <= self.block_bytes <= MAX_BLOCK_BYTES
            or self.block_bytes % _BYTES_PER_HEAD_DIM
        ):
            raise InvalidArgumentError(
                f"block_bytes: got {shown(self.block_bytes)}, expected a positive multiple of "
                f"{_BYTES_PER_HEAD_DIM} (K and V of 512 float16 tokens per unit of head_dim) "
                f"up to {MAX_BLOCK_BYTES}"
            )
        if self.speed is not None and not self.speed > 0:
            raise InvalidArgumentError(f"speed: got {shown(self.speed)}, expected a number > 0")
        if self.directory is not None:
            _check_directory(self.directory)

    def check_trace(self, requests: Sequence[TraceRequest]) -> None:
        """`InvalidArgumentError` unless `requests` are of `trace_block_tokens`-token ids."""
        if requests and requests[0].block_tokens != self.trace_block_tokens:
            raise InvalidArgumentError(
                f"trace_block_tokens: got {shown(self.trace_block_tokens)}, expected the trace's "
                f"{requests[0].block_tokens} (the tokens its ids name)"
            )

    @property
    def blocks_per_trace_block(self) -> int:
        """Store blocks a trace id becomes."""
        return self.trace_block_tokens // self.block_tokens


def _check_directory(directory: str) -> None:
    """`InvalidArgumentError` unless `directory` is an existing directory where a temporary
    directory can be made (one is made and removed: /proc, a read-only mount fail here)."""
    expected = "an existing directory where a temporary directory can be made (--dir)"
    if not os.path.isdir(directory):
        raise InvalidArgumentError(f"directory: got {shown(directory)}, expected {expected}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix="kvtier-replay-", dir=directory))
    except OSError as exc:
        raise InvalidArgumentError(
            f"directory: got {shown(directory)}, expected {expected} ({exc.strerror})"
        ) from None


def tier_blocks(fraction: float, unique_blocks: int, options: ReplayOptions) -> int:
    """The store blocks of a tier of `fraction` of `unique_blocks` trace blocks (at least one)."""
    return max(1, round(fraction * unique_blocks * options.blocks_per_trace_block))


def capacity_blocks(sizing: Sizing, unique_blocks: int, options: ReplayOptions) -> int:
    """The store blocks of the tiers `sizing` asks for: gpu, and host and disk unless 0."""
    asked = [f for f in (sizing.gpu, sizing.host, sizing.disk) if f > 0]
    return sum(tier_blocks(f, unique_blocks, options) for f in asked)


def replay_config(
    sizing: Sizing, unique_blocks: int, options: ReplayOptions, disk_path: str
) -> KVTierConfig:
    """The store config of one replay: `sizing` (fractions of `unique_blocks` trace blocks)
    in bytes of the scaled blocks, the disk tier (if any) under `disk_path`."""
    bt = options.block_tokens
    head_dim = options.block_bytes // _BYTES_PER_HEAD_DIM
    store_block_bytes = options.block_bytes // (TRACE_BLOCK_TOKENS // bt)  # bytes per 512

    def blocks(fraction: float) -> int:
        return tier_blocks(fraction, unique_blocks, options)

    tiers: dict[str, object] = {
        "gpu": {"capacity": blocks(sizing.gpu) * store_block_bytes},
        "host": {"capacity": blocks(sizing.host) * store_block_bytes} if sizing.host else None,
        "disk": None,
    }
    if sizing.disk > 0:
        digest = BlockHasher(KVTierConfig().hashing.algorithm).digest_size
        slot = slot_size(header_region_size(bt, digest), store_block_bytes)
        tiers["disk"] = {"capacity": blocks(sizing.disk) * slot, "path": disk_path, "fsync": "none"}
    return parse_config(
        {
            "model": {
                "name": "replay",
                "num_layers": 1,
                "num_kv_heads": 1,
                "head_dim": head_dim,
                "dtype": "float16",
            },
            "block_tokens": bt,
            "tiers": tiers,
            "policy": {"write": options.write, "disk_admission_hits": 0},
            "mover": {"background": options.background},
        },
        "<replay>",
    )


class _Clock:
    """The trace's clock `speed` times faster, from the first request's start (module doc);
    without a speed it never waits and measures nothing."""

    def __init__(self, speed: float | None, first_ms: int, last_ms: int) -> None:
        if speed is not None and not (last_ms - first_ms) / 1e3 / speed <= MAX_PACED_S:
            raise InvalidArgumentError(
                f"speed: got {shown(speed)}, which stretches the trace's {last_ms - first_ms} ms "
                f"to {(last_ms - first_ms) / 1e3 / speed:.3g} s; expected a speed that keeps the "
                f"schedule within {MAX_PACED_S} s"
            )
        self.speed, self.first_ms = speed, first_ms
        self.origin: float | None = None
        self.due_s = self.max_lag_s = 0.0
        self.late = self.requests = 0

    def wait(self, request: TraceRequest) -> None:
        """Sleep until `request` is due, then note how late it starts (after the sleep: one
        that overslept starts late too)."""
        if self.speed is None:
            return
        now = time.perf_counter()
        if self.origin is None:
            self.origin = now
        self.due_s = (request.timestamp_ms - self.first_ms) / 1e3 / self.speed
        lag = now - self.origin - self.due_s
        if lag < 0:
            time.sleep(-lag)
            # measured again: a sleep ends late when the process is held up (a busy CPU),
            # and the request then starts late all the same
            lag = time.perf_counter() - self.origin - self.due_s
        self.requests += 1
        self.max_lag_s = max(self.max_lag_s, lag)
        if lag > LATE_S:
            self.late += 1

    def pacing(self) -> Pacing | None:
        """How the requests kept to the clock, read when the last one is done."""
        if self.speed is None or self.origin is None:
            return None
        ran_s = time.perf_counter() - self.origin
        return Pacing(
            self.speed, self.requests, self.due_s, ran_s, self.max_lag_s, self.late, LATE_S
        )


class Drops:
    """The blocks whose latest store was dropped (module doc), by key: trace id `h`, block `j`
    of its `k` store blocks, is `h * k + j` (as `simulate.chains`). O(1) per request while no
    store has dropped anything, else O(blocks recomputed)."""

    def __init__(self, block_tokens: int, trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self.per_id = trace_block_tokens // block_tokens
        self.dropped: set[int] = set()
        self.recomputed_tokens = 0  # recomputed because their latest store was dropped

    def recompute(self, request: TraceRequest, hit_tokens: int) -> None:
        """The tokens of `request` past `hit_tokens` are recomputed: count those dropped."""
        if self.dropped:
            keys = self._keys(request, hit_tokens, request.num_tokens)
            self.recomputed_tokens += self.block_tokens * sum(k in self.dropped for k in keys)

    def store(self, request: TraceRequest, hit_tokens: int, dropped_tokens: int) -> None:
        """`request` was stored after a lookup that hit `hit_tokens`; the store dropped its
        last `dropped_tokens` tokens, and cached (or has pending) every block before them."""
        kept = request.num_tokens - dropped_tokens
        if self.dropped and kept > hit_tokens:
            self.dropped.difference_update(self._keys(request, hit_tokens, kept))
        if dropped_tokens:
            self.dropped.update(self._keys(request, kept, request.num_tokens))

    def _keys(self, request: TraceRequest, start: int, stop: int) -> list[int]:
        """The keys of the store blocks of `request` from token `start` to `stop`."""
        k, ids = self.per_id, request.hash_ids
        first, last = start // self.block_tokens, stop // self.block_tokens
        return [ids[b // k] * k + b % k for b in range(first, last)]


def zero_kv(layout: KVLayout, tokens: int) -> torch.Tensor:
    """Zero KV of `tokens` tokens in `layout` ("layers"), for `store` to read: one token's
    memory, `expand`ed (stride 0 along the tokens), however long the request or big the block."""
    shape = (layout.num_layers, 2, tokens, layout.num_kv_heads, layout.head_dim)
    one = torch.zeros((*shape[:2], 1, *shape[3:]), dtype=layout.dtype)
    return one.expand(shape)


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def replay(
    requests: Sequence[TraceRequest],
    ceiling: Ceiling,
    sizing: Sizing,
    options: ReplayOptions,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `requests` against a fresh store sized by `sizing`; `progress(n)` is told after
    every request. The store (and its disk directory) is gone when this returns."""
    options.check_trace(requests)
    lookup_s: list[float] = []
    prefetch_s: list[float] = []
    refused = dropped = 0
    longest = max(r.num_tokens for r in requests)
    clock = _Clock(options.speed, requests[0].timestamp_ms, requests[-1].timestamp_ms)
    with (
        _one_torch_thread(),
        tempfile.TemporaryDirectory(prefix="kvtier-replay-", dir=options.directory) as tmp,
    ):
        config = replay_config(sizing, ceiling.unique_blocks, options, tmp)
        check_memory(config)  # its memory tiers together, before they are mapped
        tiers = [t for t in TIERS if getattr(config.tiers, t) is not None]
        served = dict.fromkeys((*tiers, "recomputed"), 0)
        drops = Drops(options.block_tokens, options.trace_block_tokens)
        layout = config.layout
        kv = zero_kv(layout, longest)
        started = time.perf_counter()
        with KVStore(config) as store:
            for request in requests:
                clock.wait(request)
                tokens = request.tokens()
                t0 = time.perf_counter()
                hit = store.lookup(tokens)
                lookup_s.append(time.perf_counter() - t0)
                for tier in tiers:
                    served[tier] += getattr(hit, f"{tier}_tokens")
                served["recomputed"] += len(tokens) - hit.num_tokens
                drops.recompute(request, hit.num_tokens)
                if hit.host_tokens or hit.disk_tokens:
                    t0 = time.perf_counter()
                    try:
                        lease = store.prefetch(tokens)
                    except CapacityError:
                        refused += 1
                    else:
                        prefetch_s.append(time.perf_counter() - t0)
                        store.release(lease)
                stored = store.store(tokens, kv[:, :, : len(tokens)])
                drops.store(request, hit.num_tokens, stored.dropped_tokens)
                dropped += stored.dropped_tokens
                if progress is not None:
                    progress(1)
            pacing = clock.pacing()
            store.drain()
            if options.check:
                store.check()
            status = store.status()
        wall_s = time.perf_counter() - started
    return ReplayResult(
        sizing=sizing,
        mover="background" if options.background else "inline",
        write=options.write,
        block_tokens=options.block_tokens,
        capacity_bytes={t: s["capacity_bytes"] for t, s in status["tiers"].items()},
        capacity_blocks={t: s["slots"] for t, s in status["tiers"].items()},
        requests=len(requests),
        tokens=sum(served.values()),
        served=served,
        ceiling_tokens=ceiling.prefix_tokens,
        dropped_tokens=dropped,
        recomputed_after_drop=drops.recomputed_tokens,
        prefetches=len(prefetch_s),
        prefetch_refused=refused,
        backpressure_drops=status["mover"]["backpressure_drops"],
        lookup=Latency.of(lookup_s),
        prefetch=Latency.of(prefetch_s),
        path_bytes={path: moved["bytes"] for path, moved in status["paths"].items()},
        evictions={t: s["evictions"] for t, s in status["tiers"].items()},
        demotions={t: s["demotions"] for t, s in status["tiers"].items()},
        wall_s=wall_s,
        pacing=pacing,
    )
