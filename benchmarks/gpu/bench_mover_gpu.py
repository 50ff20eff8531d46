"""GPU mover (issue 4): pinned host <-> device block moves through `CudaExecutor`, on CUDA.

One script for one call on a CUDA machine (an H200), well under 5 minutes:

1. Bandwidth. A gpu pool and a pinned host pool of 2 MiB blocks (Llama-3.1-8B geometry: 32
   layers, 8 KV heads, head_dim 128, bf16, 16 tokens). `--mib` MiB (default 1024: 512 blocks)
   move host->device and device->host through `CudaExecutor`, once as contiguous slots (one run,
   one copy) and once as scattered slots (random permutations: one copy per block). Each is timed
   from `submit` to `done()` (spinning on `done()`, so no polling backoff is counted) and set
   against one `copy_(non_blocking=True)` of one pinned buffer of the same size on a dedicated
   stream (a single cudaMemcpyAsync), timed the same way, spinning on its event. Medians of
   `--repeat` (default 5), after one warm-up each. GB/s are 1e9 bytes per second.
2. Overlap. A bf16 matmul loop (8192^2) on a compute stream, sized to take about as long as the
   copies, against the scattered host->device and device->host moves together on the executor's
   streams: the time of each alone and of both together. `hidden` is the share of the shorter
   one hidden behind the longer (1: full overlap, 0: none); `slowdown` is both together over the
   longer alone (1: free).
3. The store end to end. A `KVStore` on this GPU (gpu 256 MiB, pinned host 512 MiB, a disk tier
   of 4 GiB in a temporary directory, the background mover on `CudaExecutor`) takes 16 prompts
   of 512 tokens (64 MiB each: they overflow gpu and host into disk; the store drains after each
   prompt, a paced producer, so that none is dropped by backpressure), then prefetches each
   without waiting and waits: time to ready (p50, p99), whether layer 0 was ready before the
   lease, and the leased pages compared bit for bit with what was stored.
4. Checks. Every destination is cleared before each timed move and compared bit for bit (int16
   views, on the GPU) after it, overlap runs included; a handle must report every block ok. Any
   mismatch is reported, the run goes on, and the exit status is 1.

Prints a table and, last, one line of ratios (executor / raw; hidden; slowdown); writes the
figures as JSON to `$OUT/bench_mover_gpu.json` when `$OUT` is set.
Run: `python benchmarks/gpu/bench_mover_gpu.py [--mib N] [--repeat N]`. Exit status: 0 ok,
1 on any mismatch, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvtier import KVStore, parse_config
from kvtier.blocks import KVLayout
from kvtier.tiers import SlotPool
from kvtier.transfer import CudaExecutor, Transfer, TransferHandle, contiguous_runs

LAYOUT = KVLayout("llama-3.1-8b", 32, 8, 128, "bfloat16", 16)  # 2 MiB blocks
MIB = 1 << 20
MATMUL_N = 8192


def spin(done: Callable[[], bool]) -> None:
    """Busy-wait, so that timings carry no sleep granularity (both sides wait the same way)."""
    while not done():
        pass


def event_on(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def random_bits(n_blocks: int, device: torch.device) -> torch.Tensor:
    shape = (n_blocks, *LAYOUT.block_shape)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device)


class Bench:
    def __init__(self, n: int, device: torch.device) -> None:
        self.n, self.device = n, device
        self.nbytes = n * LAYOUT.block_bytes
        self.gpu = SlotPool("gpu", LAYOUT, 2 * n, device)
        self.host = SlotPool("host", LAYOUT, 2 * n, torch.device("cpu"), pin_memory=True)
        self.executor = CudaExecutor(device)
        self.mismatches: list[str] = []
        self.raw_host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.raw_gpu = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.raw_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # references, kept on the GPU: host slots [0, n) and gpu slots [n, 2n) are the sources
        self.ref_up = random_bits(n, device)
        self.ref_down = random_bits(n, device)
        self.host.buffer[:n].view(torch.int16).copy_(self.ref_up)
        self.gpu.buffer[n:].view(torch.int16).copy_(self.ref_down)
        torch.cuda.synchronize()
        gen = torch.Generator().manual_seed(0)
        perm = [tuple(torch.randperm(n, generator=gen).tolist()) for _ in range(4)]
        contiguous = tuple(range(n))
        shifted = [tuple(s + n for s in p) for p in (contiguous, perm[2], perm[3])]
        self.cases: dict[str, Transfer] = {
            "h2d contiguous": Transfer(self.host, contiguous, self.gpu, contiguous),
            "h2d scattered": Transfer(self.host, perm[0], self.gpu, perm[1]),
            "d2h contiguous": Transfer(self.gpu, shifted[0], self.host, shifted[0]),
            "d2h scattered": Transfer(self.gpu, shifted[1], self.host, shifted[2]),
        }

    # -- checks ------------------------------------------------------------------------------

    def clear(self, transfer: Transfer) -> None:
        """Zero the destination half of the pools (not timed)."""
        n = self.n
        if transfer.dst is self.gpu:
            self.gpu.buffer[:n].zero_()
        else:
            self.host.buffer[n:].zero_()
        torch.cuda.synchronize()

    def verify(self, name: str, transfer: Transfer) -> None:
        n, device = self.n, self.device
        src = torch.tensor(transfer.src_slots, device=device)
        dst = torch.tensor(transfer.dst_slots, device=device)
        if transfer.dst is self.gpu:
            got = self.gpu.buffer.view(torch.int16)[dst]
            want = self.ref_up[src]
        else:
            got = self.host.buffer[n:].to(device).view(torch.int16)[dst - n]
            want = self.ref_down[src - n]
        if not torch.equal(got, want):
            bad = int((got != want).flatten(1).any(1).sum())
            self.mismatches.append(f"{name}: {bad} of {n} blocks differ")

    # -- timings -----------------------------------------------------------------------------

    def move(self, name: str, transfers: list[Transfer]) -> float:
        """Submit `transfers` together; seconds until every handle is done; then verify."""
        for transfer in transfers:
            self.clear(transfer)
        start = time.perf_counter()
        handles = [self.executor.submit(transfer) for transfer in transfers]
        for handle in handles:
            spin(handle.done)
        elapsed = time.perf_counter() - start
        self.check(name, handles)
        return elapsed

    def check(self, name: str, handles: list[TransferHandle]) -> None:
        """Drain the executor's completions; every block ok and every byte as sent."""
        self.executor.poll()
        for handle in handles:
            if handle.result() != [True] * self.n:
                self.mismatches.append(f"{name}: a handle reported a block not ok")
            self.verify(name, handle.transfer)

    def raw(self, direction: str) -> float:
        """One copy_ of one pinned buffer of the same size on a dedicated stream."""
        src, dst = (
            (self.raw_host, self.raw_gpu) if direction == "h2d" else (self.raw_gpu, self.raw_host)
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(self.raw_stream):
            dst.copy_(src, non_blocking=True)
        spin(event_on(self.raw_stream).query)
        return time.perf_counter() - start


def median_of(repeat: int, run: Callable[[], float]) -> float:
    run()  # warm-up
    return statistics.median(run() for _ in range(repeat))


def measure_bandwidth(bench: Bench, repeat: int) -> dict[str, dict[str, float]]:
    """Per case: executor and raw GB/s, and their ratio; prints the table."""
    gb = bench.nbytes / 1e9
    raw = {d: median_of(repeat, partial(bench.raw, d)) for d in ("h2d", "d2h")}
    figures: dict[str, dict[str, float]] = {}
    print(f"{'move':<16}{'runs':>6}{'executor GB/s':>15}{'raw GB/s':>10}{'ratio':>7}")
    for name, transfer in bench.cases.items():
        seconds = median_of(repeat, partial(bench.move, name, [transfer]))
        direction = name.split()[0]
        runs = len(contiguous_runs(transfer.src_slots, transfer.dst_slots))
        row = figures[name] = {
            "executor_gbps": gb / seconds,
            "raw_gbps": gb / raw[direction],
            "ratio": raw[direction] / seconds,
        }
        print(
            f"{name:<16}{runs:>6}{row['executor_gbps']:>15.1f}{row['raw_gbps']:>10.1f}"
            f"{row['ratio']:>7.2f}"
        )
    return figures


def measure_overlap(bench: Bench, repeat: int) -> dict[str, float]:
    """Matmuls on a compute stream alone, both scattered moves alone, and all together."""
    device = bench.device
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    x = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    both_ways = [bench.cases["h2d scattered"], bench.cases["d2h scattered"]]

    def compute(k: int) -> torch.cuda.Event:
        with torch.cuda.stream(stream):
            for _ in range(k):
                torch.matmul(x, x, out=y)
        return event_on(stream)

    def compute_alone(k: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        spin(compute(k).query)
        return time.perf_counter() - start

    def together(k: int) -> float:
        for transfer in both_ways:
            bench.clear(transfer)
        start = time.perf_counter()
        done = compute(k)  # the copies are submitted from the current stream, which is idle,
        handles = [bench.executor.submit(t) for t in both_ways]  # so nothing orders them after it
        for handle in handles:
            spin(handle.done)
        spin(done.query)
        elapsed = time.perf_counter() - start
        bench.check("overlap together", handles)
        return elapsed

    t_copy = median_of(repeat, partial(bench.move, "overlap copies", both_ways))
    k = max(1, round(t_copy / (median_of(repeat, partial(compute_alone, 10)) / 10)))
    t_compute = median_of(repeat, partial(compute_alone, k))
    t_both = median_of(repeat, partial(together, k))
    shorter, longer = sorted((t_compute, t_copy))
    print(
        f"overlap: {k} bf16 matmuls {MATMUL_N}^2 alone {t_compute * 1e3:.1f} ms; "
        f"h2d+d2h scattered alone {t_copy * 1e3:.1f} ms; both {t_both * 1e3:.1f} ms"
    )
    return {
        "matmuls": k,
        "compute_ms": t_compute * 1e3,
        "copies_ms": t_copy * 1e3,
        "both_ms": t_both * 1e3,
        "hidden": (t_compute + t_copy - t_both) / shorter,
        "slowdown": t_both / longer,
    }


def measure_store(
    device: torch.device, mismatches: list[str], prompts: int = 16, tokens_each: int = 512
) -> dict[str, Any]:
    """Part 3 (see the module doc). Runs on a CPU "gpu" pool too (the tests smoke it so)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-") as disk_dir:
        config = parse_config(
            {
                "model": {
                    "name": LAYOUT.model_name,
                    "num_layers": LAYOUT.num_layers,
                    "num_kv_heads": LAYOUT.num_kv_heads,
                    "head_dim": LAYOUT.head_dim,
                    "dtype": LAYOUT.dtype_name,
                },
                "block_tokens": LAYOUT.block_tokens,
                "tiers": {
                    "gpu": {"capacity": "256MiB", "device": str(device)},
                    "host": {"capacity": "512MiB", "pinned": "auto"},
                    "disk": {"capacity": "4GiB", "path": disk_dir},
                },
                "policy": {"write": "write_through", "disk_admission_hits": 0},
                "mover": {"background": True, "layer_groups": 4},
            }
        )
        store = KVStore(config)
        shape = (LAYOUT.num_layers, 2, tokens_each, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        kvs, seqs = [], []
        for p in range(prompts):
            tokens = [p * 100_000 + j for j in range(tokens_each)]
            kv = torch.randn(shape, device=device).to(LAYOUT.dtype)
            store.store(tokens, kv)
            # a paced producer: the mover writes this prompt down before the next one comes, so
            # nothing is dropped by backpressure (a store at memory speed outruns the disk)
            store.drain(120)
            seqs.append(tokens)
            kvs.append(kv)
        store.check()
        ready_ms: list[float] = []
        layer_first = short = 0
        for p, (tokens, kv) in enumerate(zip(seqs, kvs, strict=True)):
            start = time.perf_counter()
            lease = store.prefetch(tokens, wait=False)
            if lease.wait_layer(0, timeout=60) and not lease.ready():
                layer_first += 1
            if not lease.wait(60):
                mismatches.append(f"store: prompt {p} not ready in 60 s")
                continue
            ready_ms.append((time.perf_counter() - start) * 1e3)
            n = lease.num_tokens
            pages = store.gpu_pool.buffer[list(lease.block_table)]
            blocks = n // LAYOUT.block_tokens
            want = kv[:, :, :n].reshape(
                LAYOUT.num_layers,
                2,
                blocks,
                LAYOUT.block_tokens,
                LAYOUT.num_kv_heads,
                LAYOUT.head_dim,
            )
            want = want.permute(2, 0, 1, 3, 4, 5)
            short += n != tokens_each  # dropped by backpressure: reported, not a wrong byte
            if not torch.equal(pages.view(torch.int16), want.view(torch.int16)):
                mismatches.append(f"store: prompt {p}: the {n} leased tokens' pages differ")
            store.release(lease)
            store.check()
        status = store.status()
        store.close()
    ready_ms.sort()
    return {
        "prompts": prompts,
        "ready_ms_p50": statistics.median(ready_ms) if ready_ms else float("nan"),
        "ready_ms_p99": ready_ms[min(len(ready_ms) - 1, int(0.99 * len(ready_ms)))]
        if ready_ms
        else float("nan"),
        "layer0_before_ready": layer_first,
        "short_leases": short,
        "paths": status["paths"],
        "mover": {k: v for k, v in status["mover"].items() if k != "prefetch_to_ready_s"},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_mover_gpu: CUDA is not available (torch.cuda.is_available() is false); "
            "this benchmark needs a CUDA GPU. Nothing was measured."
        )
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    bench = Bench(args.mib * MIB // LAYOUT.block_bytes, device)
    print(
        f"{torch.cuda.get_device_name(device)}; {bench.n} blocks of "
        f"{LAYOUT.block_bytes // MIB} MiB ({args.mib} MiB) per move; medians of {args.repeat}; "
        "GB/s = 1e9 B/s"
    )
    bandwidth = measure_bandwidth(bench, args.repeat)
    overlap = measure_overlap(bench, args.repeat)
    bench.executor.close()
    store = measure_store(device, bench.mismatches)
    print(
        f"store: {store['prompts']} prompts of 512 tokens through gpu/host/disk; prefetch to "
        f"ready p50 {store['ready_ms_p50']:.2f} ms, p99 {store['ready_ms_p99']:.2f} ms; layer 0 "
        f"ready before the lease {store['layer0_before_ready']} times; "
        f"{store['short_leases']} prompts leased short (dropped by backpressure)"
    )
    for path, moved in store["paths"].items():
        gbps = moved["recent_bytes_per_s"] / 1e9
        print(f"  {path:<12}{moved['bytes'] / 1e9:8.2f} GB, {gbps:6.2f} GB/s while copying")

    for mismatch in bench.mismatches:
        print(f"MISMATCH {mismatch}")
    ratios = " ".join(
        f"{name.replace(' ', '_')}={row['ratio']:.2f}" for name, row in bandwidth.items()
    )
    print(
        f"ratios (executor/raw): {ratios} overlap_hidden={overlap['hidden']:.2f} "
        f"overlap_slowdown={overlap['slowdown']:.2f} mismatches={len(bench.mismatches)}"
    )
    out = os.environ.get("OUT")
    if out:
        report = {
            "device": torch.cuda.get_device_name(device),
            "mib": args.mib,
            "repeat": args.repeat,
            "bandwidth": bandwidth,
            "overlap": overlap,
            "store": store,
            "mismatches": bench.mismatches,
        }
        (Path(out) / "bench_mover_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    return 1 if bench.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
