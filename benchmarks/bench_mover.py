"""Moving blocks between pools (issue 4), on this machine's CPU pools.

(a) 1 GiB of 2 MiB blocks (Llama-3.1-8B geometry) moved host -> "gpu" and back through the
    transfer executors (`InlineExecutor` and `ThreadExecutor`, one transfer of all blocks, and
    64-block transfers), with contiguous and with scattered slots, against one raw `copy_` of
    the same bytes between two plain buffers, in the same run. Medians of `--repeat` runs, after
    `WARMUP` untimed ones (in which the copy planners measure and choose).
(b) A mixed load on a `KVStore` with a disk tier: one producer thread storing new 2000-token
    prompts that share 1000-token prefixes while `--consumers` threads prefetch (without
    waiting, then `lease.wait()`) and release prompts already stored, for `--seconds`, once
    with the mover inline and once in the background (the baseline in the same run); prints
    p50/p99 time from the prefetch call to a ready lease, p50/p99 of store(), and the bandwidth
    achieved per path.
The last line is the ratio of (a)'s executor bandwidth to raw.
Run: `python benchmarks/bench_mover.py [--quick]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from kvtier import KVStore, parse_config
from kvtier.blocks import KVLayout
from kvtier.errors import CapacityError
from kvtier.tiers import SlotPool
from kvtier.transfer import InlineExecutor, ThreadExecutor, Transfer

LAYOUT = KVLayout("Llama-3.1-8B", 32, 8, 128, "bfloat16", 16)
MIB = 1 << 20


WARMUP = 3
"""Untimed runs first: the executors' copy planners time their candidate strategies on the first
copies of each kind (3 samples each) before they settle on the fastest."""


def median_gbps(nbytes: int, run: Callable[[], None], repeat: int) -> float:
    for _ in range(WARMUP):
        run()
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds) / 1e9


def part_a(mib: int, repeat: int) -> float:
    n = mib * MIB // LAYOUT.block_bytes
    host = SlotPool("host", LAYOUT, n, torch.device("cpu"))
    gpu = SlotPool("gpu", LAYOUT, n, torch.device("cpu"))
    host.buffer.copy_(torch.randn((n, *LAYOUT.block_shape)).to(LAYOUT.dtype))
    gpu.buffer.zero_()  # both resident, as pools in use are
    src, dst = host.allocate(n), gpu.allocate(n)
    nbytes = n * LAYOUT.block_bytes
    raw_a = torch.empty(nbytes, dtype=torch.uint8)
    raw_b = torch.empty(nbytes, dtype=torch.uint8)
    raw_a.fill_(1)
    raw_b.fill_(2)

    def raw_copy() -> None:
        raw_b.copy_(raw_a)

    raw = median_gbps(nbytes, raw_copy, repeat)
    scattered = list(range(n))
    random.Random(0).shuffle(scattered)
    rows: dict[str, float] = {}
    inline, threads = InlineExecutor(), ThreadExecutor()

    def one(executor_run: Callable[[Transfer], object], to: list[int], chunk: int) -> None:
        for first in range(0, n, chunk):
            executor_run(
                Transfer(
                    host, tuple(src[first : first + chunk]), gpu, tuple(to[first : first + chunk])
                )
            )

    def threaded(to: list[int], chunk: int) -> None:
        handles = [
            threads.submit(Transfer(host, tuple(src[f : f + chunk]), gpu, tuple(to[f : f + chunk])))
            for f in range(0, n, chunk)
        ]
        assert all(h.wait(60) for h in handles)

    for label, to in (("contiguous", dst), ("scattered", [dst[i] for i in scattered])):

        def whole(to: list[int] = to) -> None:
            one(inline.run, to, n)

        def batches(to: list[int] = to) -> None:
            one(inline.run, to, 64)

        def on_threads(to: list[int] = to) -> None:
            threaded(to, 64)

        rows[f"inline, one transfer, {label}"] = median_gbps(nbytes, whole, repeat)
        rows[f"inline, 64-block transfers, {label}"] = median_gbps(nbytes, batches, repeat)
        rows[f"threads, 64-block transfers, {label}"] = median_gbps(nbytes, on_threads, repeat)
        for i in (0, n // 2, n - 1):  # what arrived is what was sent, slot for slot
            got, sent = gpu.buffer[to[i]].view(torch.int16), host.buffer[src[i]].view(torch.int16)
            assert torch.equal(got, sent), f"{label}: block {i} arrived wrong"
    threads.close()
    print(
        f"(a) {mib} MiB of {LAYOUT.block_bytes // MIB} MiB blocks, host -> gpu pool (CPU), "
        f"medians of {repeat}"
    )
    print(f"    {'raw copy_ of one buffer':<44}{raw:8.2f} GB/s")
    for label, gbps in rows.items():
        print(f"    {label:<44}{gbps:8.2f} GB/s   {gbps / raw:5.2f} of raw")
    return min(rows[k] for k in rows if "scattered" not in k) / raw


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def part_b(seconds: float, consumers: int, background: bool) -> dict[str, float]:
    """One run of the mixed load; the mover inline or in the background."""
    block_bytes = LAYOUT.block_bytes // 16  # 128 KiB blocks keep the pools small here
    small = {
        "name": "mixed",
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 8,
        "dtype": "bfloat16",
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-mover-") as disk_dir:
        store = KVStore(
            parse_config(
                {
                    "model": small,
                    "block_tokens": 16,
                    "tiers": {
                        "gpu": {
                            "capacity": 512 * block_bytes,
                            "high_watermark": 0.9,
                            "low_watermark": 0.7,
                        },
                        "host": {
                            "capacity": 1024 * block_bytes,
                            "high_watermark": 0.8,
                            "low_watermark": 0.6,
                        },
                        "disk": {"capacity": "2GiB", "path": disk_dir},
                    },
                    "policy": {"write": "write_back", "disk_admission_hits": 0},
                    "mover": {"background": background},
                }
            )
        )
        figures = mixed_load(store, seconds, consumers)
        store.close()
    return figures


def mixed_load(store: KVStore, seconds: float, consumers: int) -> dict[str, float]:
    prefixes = [[p * 10_000 + j for j in range(1000)] for p in range(8)]
    stored: list[list[int]] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    ready_ms: list[float] = []
    store_ms: list[float] = []
    kv = torch.randn((32, 2, 2000, 8, 8)).to(torch.bfloat16)

    def producer() -> None:
        i = 0
        while time.monotonic() < stop:
            tokens = prefixes[i % 8] + [1_000_000 + i * 1000 + j for j in range(1000)]
            start = time.perf_counter()
            store.store(tokens, kv)
            store_ms.append((time.perf_counter() - start) * 1e3)
            with lock:
                stored.append(tokens)
            i += 1

    def consumer(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            with lock:
                tokens = rng.choice(stored) if stored else None
            if tokens is None:
                time.sleep(0.001)
                continue
            start = time.perf_counter()
            try:
                lease = store.prefetch(tokens, wait=False)
            except CapacityError:
                continue
            if lease.wait(30):
                ready_ms.append((time.perf_counter() - start) * 1e3)
            store.release(lease)

    threads = [threading.Thread(target=producer)]
    threads += [threading.Thread(target=consumer, args=(s,)) for s in range(consumers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.drain()
    store.check()
    status = store.status()
    mode = "background" if status["mover"]["background"] else "inline"
    print(
        f"    {mode:<10} {len(stored):5d} prompts stored, {len(ready_ms):5d} prefetches; "
        f"time to ready p50 {statistics.median(ready_ms):6.2f} ms, p99 "
        f"{percentile(ready_ms, 0.99):7.2f} ms; store() p50 {statistics.median(store_ms):6.2f} "
        f"ms, p99 {percentile(store_ms, 0.99):7.2f} ms"
    )
    ops = status["ops"]
    print(
        f"      tokens stored {ops['stored_tokens']:9d}, dropped {ops['dropped_tokens']:9d} "
        f"(backpressure drops of host leaves: {status['mover']['backpressure_drops']})"
    )
    for path, moved in status["paths"].items():
        print(
            f"      {path:<12}{moved['bytes'] / 1e6:10.1f} MB moved, "
            f"{moved['recent_bytes_per_s'] / 1e9:6.2f} GB/s while copying"
        )
    return {
        "ready_p50": statistics.median(ready_ms),
        "ready_p99": percentile(ready_ms, 0.99),
        "store_p99": percentile(store_ms, 0.99),
        "stored": ops["stored_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="256 MiB, 3 s of mixed load")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--consumers", type=int, default=3)
    args = parser.parse_args()
    ratio = part_a(256 if args.quick else 1024, args.repeat)
    seconds = 3.0 if args.quick else args.seconds
    print(
        f"(b) {seconds:.0f} s per mode, 1 producer, {args.consumers} consumers; gpu 64 MiB, host "
        "128 MiB, disk: the producer overflows both; prefetch(wait=False) then lease.wait()"
    )
    inline = part_b(seconds, args.consumers, background=False)
    background = part_b(seconds, args.consumers, background=True)
    print(
        f"    store() p99, background / inline: "
        f"{background['store_p99'] / inline['store_p99']:.2f}; tokens stored "
        f"{background['stored'] / max(inline['stored'], 1):.2f}x; time to ready p50 "
        f"{background['ready_p50'] / inline['ready_p50']:.2f}x"
    )
    print(f"ratio, executor (contiguous slots) / raw copy: {ratio:.2f}")


if __name__ == "__main__":
    main()
