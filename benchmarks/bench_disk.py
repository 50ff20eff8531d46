"""Disk bandwidth (issue 3): what the filesystem under the disk tier can do.

Raw half, on one directory (a fresh directory under the repo's `.bench-disk/`, or under `--dir`):

- raw write: `--mib` MiB (default 1024) as 2 MiB chunks written with O_DIRECT `pwritev` into one
  preallocated `SlabFile` from `--workers` threads (default 8, as the tier), then one
  `fdatasync`; the time includes the sync, not the preallocation. Twice: the first fill of the
  fresh file, then a rewrite of it (on ext4 the first write into preallocated extents also
  converts them);
- raw cold read: the page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`, which
  needs root), then the same chunks are read back with O_DIRECT `preadv` from the same threads;
- buffered write: the same bytes written without O_DIRECT into another preallocated file, then
  one `fdatasync`, for comparison.

Tier half, on the same directory: the disk tier (`DiskTier`) writes the same number of bytes as
2 MiB blocks (Llama-3.1-8B geometry: 32 layers, 8 KV heads, head_dim 128, bf16, 16 tokens) in
group commits of `--batch` blocks (default 64: one header + payload image per block, parallel
`pwritev`, one `fdatasync` per slab per batch), twice: the first fill of fresh slabs (each sync
then also journals ext4's conversion of preallocated extents to written ones) and the steady
state of a cache whose slots are rewritten. Then, with the page cache dropped, it reads them
back with `read_blocks` (parallel `preadv` of whole slots, header and payload checksums
verified) straight into the slots of a host pool. Blocks are written from, and read into,
page-aligned pool slots, as in the store. Its MB/s count payload bytes only. The last line is
the tier's share of raw bandwidth for writes and cold reads.

Where the filesystem refuses O_DIRECT (see `probe_direct`), the raw rows run buffered and say so.
Raw and tier runs alternate, one of each per round, so that both meet the same moods of a
shared disk. Each figure is the median of `--repeat` rounds (default 3); MB/s are 1e6 bytes
per second. Every file is deleted at the end. `raw_bandwidth(directory, mib, workers,
repeat)` is the reusable entry point.
Run: `python benchmarks/bench_disk.py [--quick] [--dir DIR] [--mib N] [--repeat N] [--batch N]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from kvtier.blocks import KVLayout
from kvtier.tiers import SlotPool
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.disk.io import SlabFile, aligned_buffer, probe_direct
from kvtier.tiers.disk.io_pool import IOPool

MIB = 1 << 20
CHUNK = 2 * MIB
SOURCE_CHUNKS = 64
"""Raw writes cycle over 64 distinct 2 MiB chunks (128 MiB), the size of one tier batch."""
DEFAULT_BASE = Path(__file__).resolve().parent.parent / ".bench-disk"
ROWS = {
    "raw_write": "raw write, first fill (parallel pwritev + fdatasync)",
    "raw_rewrite": "raw write, rewrite of the same file",
    "raw_cold_read": "raw cold read (parallel preadv)",
    "buffered_write": "buffered write (parallel pwritev + fdatasync)",
}


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache; False where that is not permitted."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _strided(
    n_chunks: int, workers: int, io: Callable[[int, int], None]
) -> list[Callable[[], None]]:
    """One job per worker: worker w does `io(w, chunk)` for chunks w, w + workers, ..."""

    def job(w: int) -> None:
        for chunk in range(w, n_chunks, workers):
            io(w, chunk)

    return [partial(job, w) for w in range(workers)]


def _raise_first(results: list[OSError | None]) -> None:
    for result in results:
        if isinstance(result, OSError):
            raise result


def _write_seconds(slab: SlabFile, pool: IOPool, sources: list[memoryview], n_chunks: int) -> float:
    """Seconds to write `n_chunks` chunks into `slab` in parallel, sync included; chunk c is
    `sources[c % len(sources)]`, so the data comes from memory, not from the CPU's cache, as
    the tier's does."""

    def write(_w: int, c: int) -> None:
        slab.write(c * CHUNK, [sources[c % len(sources)]])

    jobs = _strided(n_chunks, pool.workers, write)
    start = time.perf_counter()
    _raise_first(pool.run(jobs))
    slab.sync()
    return time.perf_counter() - start


def _read_seconds(slab: SlabFile, pool: IOPool, sources: list[memoryview], n_chunks: int) -> float:
    """Seconds to read `n_chunks` chunks of `slab` in parallel, one buffer per worker; checks
    that the last chunk each worker read is what was written there."""
    buffers = [aligned_buffer(CHUNK) for _ in range(pool.workers)]

    def read(w: int, chunk: int) -> None:
        got = slab.read_into(chunk * CHUNK, buffers[w])
        assert got == CHUNK, f"short read of chunk {chunk}: {got} bytes"

    jobs = _strided(n_chunks, pool.workers, read)
    start = time.perf_counter()
    _raise_first(pool.run(jobs))
    seconds = time.perf_counter() - start
    for w in range(min(pool.workers, n_chunks)):
        last = max(range(w, n_chunks, pool.workers))
        assert buffers[w] == sources[last % len(sources)], "data read back differs"
    return seconds


def raw_runs(directory: Path, mib: int, workers: int, repeat: int) -> dict[str, list[float]]:
    """MB/s of every run of each `ROWS` measurement in `directory` (see the module docstring).
    Creates and deletes its files there; notes about the conditions go to stderr."""
    n_chunks = max(1, mib * MIB // CHUNK)
    size = n_chunks * CHUNK
    direct = probe_direct(directory)
    if not direct:
        print(f"note: {directory} refuses O_DIRECT; raw rows are buffered", file=sys.stderr)
    sources = [aligned_buffer(CHUNK) for _ in range(min(n_chunks, SOURCE_CHUNKS))]
    for source in sources:
        source[:] = os.urandom(CHUNK)
    runs: dict[str, list[float]] = {key: [] for key in ROWS}
    cold = True
    with IOPool(workers) as pool:
        for r in range(repeat):
            for key, is_direct in (("raw", direct), ("buffered", False)):
                path = directory / f"{key}-{r}.slab"
                try:
                    with SlabFile(path, size, direct=is_direct, create=True) as slab:
                        seconds = _write_seconds(slab, pool, sources, n_chunks)
                        runs[f"{key}_write"].append(size / seconds / 1e6)
                        if key == "raw":
                            seconds = _write_seconds(slab, pool, sources, n_chunks)
                            runs["raw_rewrite"].append(size / seconds / 1e6)
                            cold = drop_page_cache() and cold
                            seconds = _read_seconds(slab, pool, sources, n_chunks)
                            runs["raw_cold_read"].append(size / seconds / 1e6)
                finally:
                    path.unlink(missing_ok=True)
    if not cold:
        print("note: page cache not dropped (needs root); reads may be warm", file=sys.stderr)
    return runs


def raw_bandwidth(directory: Path, mib: int, workers: int, repeat: int) -> dict[str, float]:
    """Median MB/s of each `ROWS` measurement: `raw_write`, `raw_rewrite`, `raw_cold_read`,
    `buffered_write`."""
    runs = raw_runs(directory, mib, workers, repeat)
    return {key: statistics.median(values) for key, values in runs.items()}


LLAMA_8B = KVLayout("Llama-3.1-8B", 32, 8, 128, "bfloat16", 16)
TIER_ROWS = {
    "tier_write": "disk tier write, first fill (commits of --batch)",
    "tier_rewrite": "disk tier write, steady state (slots rewritten)",
    "tier_cold_read": "disk tier cold read (verified)",
}


def tier_runs(
    directory: Path, mib: int, workers: int, repeat: int, batch: int
) -> dict[str, list[float]]:
    """MB/s of every run of each `TIER_ROWS` measurement (see the module docstring)."""
    layout = LLAMA_8B
    n_blocks = max(1, mib * MIB // layout.block_bytes)
    batch = min(batch, n_blocks)
    # the blocks live in a page-aligned pool buffer, as they do in the store's host tier
    pool = SlotPool("host", layout, batch, torch.device("cpu"))
    pool.buffer.copy_(torch.randn((batch, *layout.block_shape)).to(layout.dtype))
    blocks = [pool.buffer[i] for i in range(batch)]
    runs: dict[str, list[float]] = {key: [] for key in TIER_ROWS}
    for r in range(repeat):
        path = directory / f"tier-{r}"
        probe = DiskTier(layout, path, 1 << 40, workers=workers)  # geometry only
        slot_bytes = probe.slot_bytes
        probe.close()
        shutil.rmtree(path)
        tier = DiskTier(layout, path, n_blocks * slot_bytes, workers=workers)
        try:
            slots = tier.allocate(n_blocks)
            metas = [
                BlockMeta(i.to_bytes(16, "little"), b"\0" * 16, b"\1" * 16, "bench", b"\0" * 64)
                for i in range(n_blocks)
            ]
            for key in ("tier_write", "tier_rewrite"):
                start = time.perf_counter()
                for first in range(0, n_blocks, batch):
                    part = slots[first : first + batch]
                    ok = tier.write_blocks(
                        part, blocks[: len(part)], metas[first : first + len(part)]
                    )
                    assert all(ok), "a tier write failed"
                runs[key].append(
                    n_blocks * layout.block_bytes / (time.perf_counter() - start) / 1e6
                )
            readback = SlotPool("host", layout, batch, torch.device("cpu"))
            readback.buffer.zero_()  # resident, like a pool that is in use
            back = [readback.buffer[i] for i in range(batch)]
            drop_page_cache()
            start = time.perf_counter()
            for first in range(0, n_blocks, batch):
                part = slots[first : first + batch]
                ids = [m.block_id for m in metas[first : first + len(part)]]
                _, ok = tier.read_blocks(part, ids, out=back[: len(part)])
                assert all(ok), "a tier read failed verification"
            seconds = time.perf_counter() - start
            for got, want in zip(back[: len(part)], blocks, strict=False):
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            runs["tier_cold_read"].append(n_blocks * layout.block_bytes / seconds / 1e6)
        finally:
            tier.close()
            shutil.rmtree(path, ignore_errors=True)
    return runs


def print_table(runs: dict[str, list[float]]) -> None:
    print(f"{'measurement':<52}{'median MB/s':>12}{'min':>8}{'max':>8}")
    for key, label in {**ROWS, **TIER_ROWS}.items():
        if key not in runs:
            continue
        values = runs[key]
        med, low, high = statistics.median(values), min(values), max(values)
        print(f"{label:<52}{med:>12.0f}{low:>8.0f}{high:>8.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, help=f"parent of the work directory ({DEFAULT_BASE})")
    parser.add_argument("--mib", type=int, default=1024, help="MiB written per run (1024)")
    parser.add_argument("--workers", type=int, default=8, help="I/O threads (8, as the tier)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (3)")
    parser.add_argument("--quick", action="store_true", help="256 MiB per run")
    parser.add_argument("--batch", type=int, default=64, help="blocks per group commit (64)")
    args = parser.parse_args(argv)
    mib = 256 if args.quick else args.mib
    base = args.dir if args.dir is not None else DEFAULT_BASE
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=base))
    try:
        direct = probe_direct(work)
        print(
            f"disk bandwidth in {work}: {mib} MiB per run in {CHUNK // MIB} MiB chunks, "
            f"{args.workers} workers, O_DIRECT {'yes' if direct else 'no'}, "
            f"median of {args.repeat}"
        )
        # raw and tier alternate, one run each per round, so that both meet the same moods of a
        # shared disk; the medians are then taken over rounds
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for part in (
                raw_runs(work, mib, args.workers, 1),
                tier_runs(work, mib, args.workers, 1, args.batch),
            ):
                for key, values in part.items():
                    runs.setdefault(key, []).extend(values)
        print_table(runs)
        med = {key: statistics.median(values) for key, values in runs.items()}
        print(
            f"ratio tier/raw: write {med['tier_write'] / med['raw_write']:.2f} first fill (against "
            "raw first fill), "
            f"{med['tier_rewrite'] / med['raw_rewrite']:.2f} steady state (against raw rewrite); "
            f"cold read {med['tier_cold_read'] / med['raw_cold_read']:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None and not any(base.iterdir()):
            base.rmdir()


if __name__ == "__main__":
    main()
