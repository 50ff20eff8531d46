"""Moving blocks between pools (issue 4), on this machine's CPU pools.

(a) 1 GiB of 2 MiB blocks (Llama-3.1-8B geometry) moved host -> "gpu" and back through the
    transfer executors (`InlineExecutor` and `ThreadExecutor`, one transfer of all blocks, and
    64-block transfers), with contiguous and with scattered slots, against one raw `copy_` of
    the same bytes between two plain buffers, in the same run. Medians of `--repeat` runs.
(b) A mixed load on a `KVStore`: one producer thread storing new 2000-token prompts that share
    1000-token prefixes while `--consumers` threads prefetch (and release) prompts already
    stored, for `--seconds`; prints p50/p99 time from prefetch call to a ready lease (today the
    store promotes synchronously, so ready means returned) and the bandwidth achieved per path.
The last line is the ratio of (a)'s executor bandwidth to raw.
Run: `python benchmarks/bench_mover.py [--quick]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable

import torch

from kvtier import KVStore, parse_config
from kvtier.layout import KVLayout
from kvtier.tiers import SlotPool
from kvtier.transfer import InlineExecutor, ThreadExecutor, Transfer

LAYOUT = KVLayout("Llama-3.1-8B", 32, 8, 128, "bfloat16", 16)
MIB = 1 << 20


def median_gbps(nbytes: int, run: Callable[[], None], repeat: int) -> float:
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


def part_b(seconds: float, consumers: int) -> None:
    block_bytes = LAYOUT.block_bytes // 16  # 128 KiB blocks keep the pools small here
    small = {
        "name": "mixed",
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 8,
        "dtype": "bfloat16",
    }
    store = KVStore(
        parse_config(
            {
                "model": small,
                "block_tokens": 16,
                "tiers": {
                    "gpu": {"capacity": 512 * block_bytes},
                    "host": {"capacity": 2048 * block_bytes},
                },
                "policy": {"write": "write_back"},
            }
        )
    )
    prefixes = [[p * 10_000 + j for j in range(1000)] for p in range(8)]
    stored: list[list[int]] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    ready_ms: list[float] = []

    def producer() -> None:
        i = 0
        while time.monotonic() < stop:
            tokens = prefixes[i % 8] + [1_000_000 + i * 1000 + j for j in range(1000)]
            store.store(tokens, torch.zeros((32, 2, 2000, 8, 8), dtype=torch.bfloat16))
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
            lease = store.prefetch(tokens)
            ready_ms.append((time.perf_counter() - start) * 1e3)
            store.release(lease)

    threads = [threading.Thread(target=producer)]
    threads += [threading.Thread(target=consumer, args=(s,)) for s in range(consumers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.check()
    ready_ms.sort()
    p99 = ready_ms[int(len(ready_ms) * 0.99)] if ready_ms else float("nan")
    print(
        f"(b) {seconds:.0f} s, 1 producer, {consumers} consumers: {len(stored)} prompts stored, "
        f"{len(ready_ms)} prefetches; time to ready p50 {statistics.median(ready_ms):.2f} ms, "
        f"p99 {p99:.2f} ms"
    )
    for path, figures in store.status()["paths"].items():
        print(
            f"    {path:<12}{figures['bytes'] / 1e6:10.1f} MB moved, "
            f"{figures['recent_bytes_per_s'] / 1e9:6.2f} GB/s while copying"
        )
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="256 MiB, 3 s of mixed load")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--consumers", type=int, default=3)
    args = parser.parse_args()
    ratio = part_a(256 if args.quick else 1024, args.repeat)
    part_b(3.0 if args.quick else args.seconds, args.consumers)
    print(f"ratio, executor (contiguous slots) / raw copy: {ratio:.2f}")


if __name__ == "__main__":
    main()
