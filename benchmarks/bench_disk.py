"""Disk bandwidth (issue 3): what the filesystem under the disk tier can do.

Raw half, on one directory (a fresh directory under the repo's `.bench-disk/`, or under `--dir`):

- raw write: `--mib` MiB (default 1024) as 2 MiB chunks written with O_DIRECT `pwritev` into one
  preallocated `SlabFile` from `--workers` threads (default 4), then one `fdatasync`; the time
  includes the sync, not the preallocation;
- raw cold read: the page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`, which
  needs root), then the same chunks are read back with O_DIRECT `preadv` from the same threads;
- buffered write: the same bytes written without O_DIRECT into another preallocated file, then
  one `fdatasync`, for comparison.

Where the filesystem refuses O_DIRECT (see `probe_direct`), the raw rows run buffered and say so.
Each figure is the median of `--repeat` runs (default 3); MB/s are 1e6 bytes per second. Every
file is deleted at the end. `raw_bandwidth(directory, mib, workers, repeat)` is the reusable
entry point. Run: `python benchmarks/bench_disk.py [--quick] [--dir DIR] [--mib N] ...`.
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

from kvtier.tiers.disk.io import IOPool, SlabFile, aligned_buffer, probe_direct

MIB = 1 << 20
CHUNK = 2 * MIB
DEFAULT_BASE = Path(__file__).resolve().parent.parent / ".bench-disk"
ROWS = {
    "raw_write": "raw write (parallel pwritev + fdatasync)",
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


def _write_seconds(slab: SlabFile, pool: IOPool, source: memoryview, n_chunks: int) -> float:
    """Seconds to write `n_chunks` copies of `source` into `slab` in parallel, sync included."""
    jobs = _strided(n_chunks, pool.workers, lambda _w, c: slab.write(c * CHUNK, [source]))
    start = time.perf_counter()
    _raise_first(pool.run(jobs))
    slab.sync()
    return time.perf_counter() - start


def _read_seconds(slab: SlabFile, pool: IOPool, source: memoryview, n_chunks: int) -> float:
    """Seconds to read `n_chunks` chunks of `slab` in parallel, one buffer per worker; checks
    that the last chunk each worker read equals `source`."""
    buffers = [aligned_buffer(CHUNK) for _ in range(pool.workers)]

    def read(w: int, chunk: int) -> None:
        got = slab.read_into(chunk * CHUNK, buffers[w])
        assert got == CHUNK, f"short read of chunk {chunk}: {got} bytes"

    jobs = _strided(n_chunks, pool.workers, read)
    start = time.perf_counter()
    _raise_first(pool.run(jobs))
    seconds = time.perf_counter() - start
    used = buffers[: min(pool.workers, n_chunks)]
    assert all(b == source for b in used), "data read back differs from what was written"
    return seconds


def raw_runs(directory: Path, mib: int, workers: int, repeat: int) -> dict[str, list[float]]:
    """MB/s of every run of each `ROWS` measurement in `directory` (see the module docstring).
    Creates and deletes its files there; notes about the conditions go to stderr."""
    n_chunks = max(1, mib * MIB // CHUNK)
    size = n_chunks * CHUNK
    direct = probe_direct(directory)
    if not direct:
        print(f"note: {directory} refuses O_DIRECT; raw rows are buffered", file=sys.stderr)
    source = aligned_buffer(CHUNK)
    source[:] = os.urandom(CHUNK)
    runs: dict[str, list[float]] = {key: [] for key in ROWS}
    cold = True
    with IOPool(workers) as pool:
        for r in range(repeat):
            for key, is_direct in (("raw", direct), ("buffered", False)):
                path = directory / f"{key}-{r}.slab"
                try:
                    with SlabFile(path, size, direct=is_direct, create=True) as slab:
                        seconds = _write_seconds(slab, pool, source, n_chunks)
                        runs[f"{key}_write"].append(size / seconds / 1e6)
                        if key == "raw":
                            cold = drop_page_cache() and cold
                            seconds = _read_seconds(slab, pool, source, n_chunks)
                            runs["raw_cold_read"].append(size / seconds / 1e6)
                finally:
                    path.unlink(missing_ok=True)
    if not cold:
        print("note: page cache not dropped (needs root); reads may be warm", file=sys.stderr)
    return runs


def raw_bandwidth(directory: Path, mib: int, workers: int, repeat: int) -> dict[str, float]:
    """Median MB/s of each `ROWS` measurement: `raw_write`, `raw_cold_read`, `buffered_write`."""
    runs = raw_runs(directory, mib, workers, repeat)
    return {key: statistics.median(values) for key, values in runs.items()}


def print_table(runs: dict[str, list[float]]) -> None:
    print(f"{'measurement':<48}{'median MB/s':>12}{'min':>8}{'max':>8}")
    for key, label in ROWS.items():
        values = runs[key]
        med, low, high = statistics.median(values), min(values), max(values)
        print(f"{label:<48}{med:>12.0f}{low:>8.0f}{high:>8.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, help=f"parent of the work directory ({DEFAULT_BASE})")
    parser.add_argument("--mib", type=int, default=1024, help="MiB written per run (1024)")
    parser.add_argument("--workers", type=int, default=4, help="I/O threads (4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (3)")
    parser.add_argument("--quick", action="store_true", help="256 MiB per run")
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
        print_table(raw_runs(work, mib, args.workers, args.repeat))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None and not any(base.iterdir()):
            base.rmdir()


if __name__ == "__main__":
    main()
