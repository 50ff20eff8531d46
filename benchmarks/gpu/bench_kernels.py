"""GPU kernels (issue 5): the block-copy kernel and paged decode attention, on CUDA.

One script for one call on a CUDA machine (an H200), well under 5 minutes:

1. Block copy. A gpu pool and a pinned host pool of 2 MiB blocks (Llama-3.1-8B: 32 layers, 8
   KV heads, head_dim 128, bf16, 16 tokens) and of 64 KiB blocks (the same, one layer). `--mib`
   MiB (default 512) move host->device and device->host between scattered slots (random
   permutations), three ways: one launch of the CuPy kernel (`copy_blocks_kernel`), one
   `copy_(non_blocking=True)` per block, and, as the ceiling, one `copy_(non_blocking=True)` of
   one pinned buffer of the same size (a single cudaMemcpyAsync). Each is timed with CUDA events
   on a dedicated stream around everything it enqueues (the kernel's slot-id upload included),
   median of `--repeat` (default 5) after one warm-up. GB/s are 1e9 bytes per second. Without
   CuPy the kernel's rows say so and the rest runs.
2. Paged decode attention. Llama-3.1-8B attention geometry (32 query heads, 8 KV heads,
   head_dim 128, bf16, 16-token blocks; a pool of 2 layers, layer 1 read), batch 1/16/64 x
   context 1k/4k/16k (a combination that would need over `MAX_POOL_GIB` of pool is skipped),
   block tables of random distinct slots. `paged_decode` (Triton) is checked against
   `paged_decode_reference` (plain torch, fp32) on ragged lengths (each sequence 0-15 tokens
   short of the context) and on full ones, then timed on full ones. K/V bytes read per second
   (the layer's K and V of every cached token, once) are set against this GPU's DRAM bandwidth
   measured here: one `copy_` between two 4 GiB device buffers, counting bytes read and written.
   The baseline gathers the pool into contiguous K/V (`buffer[block_table]`) and runs
   `scaled_dot_product_attention(..., enable_gqa=True)`, timed the same way (gather included)
   and checked against the reference too.
3. Checks. Every copy's destination is poisoned before each timed run and compared bit for bit
   (int16 views, on the GPU) after it; attention outputs must be within 2e-2 of the reference,
   as max |out - ref| / max |ref|. A mismatch is reported, the run goes on, the exit status is 1.

Prints the tables and, last, one line of ratios; writes the figures as JSON to
`$OUT/bench_kernels.json` when `$OUT` is set.
Run: `python benchmarks/gpu/bench_kernels.py [--mib N] [--repeat N]`. Exit status: 0 ok, 1 on
any mismatch, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvtier.blocks import KVLayout
from kvtier.kernels.block_copy import copy_blocks_kernel, kernel_available
from kvtier.tiers import SlotPool

MIB = 1 << 20
GIB = 1 << 30
COPY_LAYOUTS = {
    "2 MiB": KVLayout("llama-3.1-8b", 32, 8, 128, "bfloat16", 16),
    "64 KiB": KVLayout("llama-3.1-8b-layer", 1, 8, 128, "bfloat16", 16),
}
ATTENTION_LAYOUT = KVLayout("llama-3.1-8b-2layers", 2, 8, 128, "bfloat16", 16)  # 128 KiB blocks
Q_HEADS = 32
LAYER = 1
BATCHES = (1, 16, 64)
CONTEXTS = (1024, 4096, 16384)
MAX_POOL_GIB = 48  # with the gather baseline's copy and the reference, well inside 100 GiB
TOLERANCE = 2e-2
POISON = 0x5A5A


def cuda_seconds(stream: torch.cuda.Stream, enqueue: Callable[[], object]) -> float:
    """Seconds between CUDA events recorded on `stream` around what `enqueue()` puts there."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record(stream)
        enqueue()
        end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def median_of(repeat: int, run: Callable[[], float]) -> float:
    run()  # warm-up (and the kernels' compiles)
    return statistics.median(run() for _ in range(repeat))


# -- 1. block copy ---------------------------------------------------------------------------


class CopyBench:
    """Pools of one block size: host slots [0, n) and gpu slots [n, 2n) hold the sources."""

    def __init__(self, layout: KVLayout, mib: int, device: torch.device) -> None:
        self.n = n = mib * MIB // layout.block_bytes
        self.nbytes = n * layout.block_bytes
        self.device = device
        self.gpu = SlotPool("gpu", layout, 2 * n, device)
        self.host = SlotPool("host", layout, 2 * n, torch.device("cpu"), pin_memory=True)
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.raw_host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.raw_gpu = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        shape = (n, *layout.block_shape)
        self.ref_up = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device)
        self.ref_down = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device)
        self.host.buffer[:n].view(torch.int16).copy_(self.ref_up)
        self.gpu.buffer[n:].view(torch.int16).copy_(self.ref_down)
        gen = torch.Generator().manual_seed(0)
        perm = [tuple(torch.randperm(n, generator=gen).tolist()) for _ in range(4)]
        self.slots = {  # (source slots, destination slots), scattered on both sides
            "h2d": (perm[0], perm[1]),
            "d2h": (tuple(s + n for s in perm[2]), tuple(s + n for s in perm[3])),
        }
        torch.cuda.synchronize()

    def pools(self, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
        up = direction == "h2d"
        return (self.host.buffer, self.gpu.buffer) if up else (self.gpu.buffer, self.host.buffer)

    def run(self, direction: str, method: str, mismatches: list[str], label: str) -> float:
        """Poison the destination, time one move by `method`, verify it; seconds."""
        src, dst = self.pools(direction)
        src_slots, dst_slots = self.slots[direction]
        n = self.n
        target = self.gpu.buffer[:n] if direction == "h2d" else self.host.buffer[n:]
        target.view(torch.int16).fill_(POISON)

        def kernel() -> None:
            copy_blocks_kernel(src, dst, src_slots, dst_slots)

        def per_block() -> None:
            for s, d in zip(src_slots, dst_slots, strict=True):
                dst[d].copy_(src[s], non_blocking=True)

        seconds = cuda_seconds(self.stream, kernel if method == "kernel" else per_block)
        self.verify(direction, f"{label} {direction} {method}", mismatches)
        return seconds

    def raw(self, direction: str) -> float:
        src, dst = (
            (self.raw_host, self.raw_gpu) if direction == "h2d" else (self.raw_gpu, self.raw_host)
        )
        return cuda_seconds(self.stream, lambda: dst.copy_(src, non_blocking=True))

    def verify(self, direction: str, name: str, mismatches: list[str]) -> None:
        n, device = self.n, self.device
        src_slots, dst_slots = self.slots[direction]
        src = torch.tensor(src_slots, device=device)
        dst = torch.tensor(dst_slots, device=device)
        if direction == "h2d":
            got = self.gpu.buffer.view(torch.int16)[dst]
            want = self.ref_up[src]
        else:
            got = self.host.buffer[n:].to(device).view(torch.int16)[dst - n]
            want = self.ref_down[src - n]
        if not torch.equal(got, want):
            bad = int((got != want).flatten(1).any(1).sum())
            mismatches.append(f"{name}: {bad} of {n} blocks differ")


def measure_block_copy(
    mib: int, repeat: int, device: torch.device, mismatches: list[str]
) -> dict[str, dict[str, Any]]:
    """Part 1 (see the module doc); prints its table."""
    methods = ["kernel", "per_block"] if kernel_available() else ["per_block"]
    if not kernel_available():
        print("block copy: CuPy is not importable here; the kernel's rows are left out")
    print(
        f"{'block':<8}{'move':<6}{'blocks':>7}{'kernel GB/s':>13}{'per-block GB/s':>16}"
        f"{'raw GB/s':>10}{'kernel/raw':>12}{'per-block/raw':>15}"
    )
    figures: dict[str, dict[str, Any]] = {}
    for label, layout in COPY_LAYOUTS.items():
        bench = CopyBench(layout, mib, device)
        gb = bench.nbytes / 1e9
        for direction in ("h2d", "d2h"):
            raw = median_of(repeat, partial(bench.raw, direction))
            row: dict[str, Any] = {"blocks": bench.n, "raw_gbps": gb / raw}
            for method in methods:
                seconds = median_of(
                    repeat, partial(bench.run, direction, method, mismatches, label)
                )
                row[f"{method}_gbps"] = gb / seconds
                row[f"{method}_over_raw"] = raw / seconds
            figures[f"{label.replace(' ', '')} {direction}"] = row
            kernel_gbps = f"{row['kernel_gbps']:.1f}" if "kernel_gbps" in row else "n/a"
            kernel_ratio = f"{row['kernel_over_raw']:.2f}" if "kernel_over_raw" in row else "n/a"
            print(
                f"{label:<8}{direction:<6}{bench.n:>7}{kernel_gbps:>13}"
                f"{row['per_block_gbps']:>16.1f}{row['raw_gbps']:>10.1f}{kernel_ratio:>12}"
                f"{row['per_block_over_raw']:>15.2f}"
            )
        del bench
        torch.cuda.empty_cache()
    return figures


# -- 2. paged decode attention ---------------------------------------------------------------


def dram_bandwidth(repeat: int, device: torch.device) -> float:
    """Bytes read plus written per second by one `copy_` between two 4 GiB device buffers."""
    a = torch.empty(4 * GIB, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    seconds = median_of(repeat, partial(cuda_seconds, stream, partial(b.copy_, a)))
    return 2 * 4 * GIB / seconds


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in fp32."""
    ref32 = ref.float()
    return float((out.float() - ref32).abs().max() / ref32.abs().max().clamp_min(1e-30))


def gather_sdpa(
    q: torch.Tensor, buffer: torch.Tensor, block_table: torch.Tensor, tokens: int
) -> torch.Tensor:
    """The baseline: the pool's pages gathered (one indexing copy), reshaped into contiguous
    K/V `[batch, kv_heads, tokens, head_dim]` (a second copy), then
    `scaled_dot_product_attention` with GQA; `[batch, q_heads, head_dim]`."""
    batch = q.shape[0]
    pages = buffer[block_table.long(), LAYER]  # [batch, blocks, 2, block_tokens, kv_heads, dim]
    kv = pages.transpose(1, 2).reshape(batch, 2, -1, *pages.shape[-2:])[:, :, :tokens]
    k, v = kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)
    return out.squeeze(2)


def measure_attention(
    repeat: int, device: torch.device, mismatches: list[str]
) -> dict[str, dict[str, Any]]:
    """Part 2 (see the module doc); prints its table."""
    from kvtier.kernels import paged_attention

    if not paged_attention.available():
        mismatches.append("paged attention: Triton is not importable, nothing was checked")
        return {}
    layout = ATTENTION_LAYOUT
    dram = dram_bandwidth(repeat, device)
    torch.cuda.empty_cache()  # the copy's 8 GiB
    print(f"DRAM bandwidth (device copy_, bytes read + written): {dram / 1e9:.0f} GB/s")
    print(
        f"{'batch':>5}{'context':>8}{'err':>9}{'paged ms':>10}{'KV GB/s':>9}{'of DRAM':>9}"
        f"{'gather+sdpa ms':>16}{'speedup':>9}"
    )
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    gen = torch.Generator(device=device).manual_seed(0)
    figures: dict[str, dict[str, Any]] = {}
    for batch in BATCHES:
        for context in CONTEXTS:
            name = f"b{batch}_c{context // 1024}k"
            max_blocks = context // layout.block_tokens
            slots = batch * max_blocks + batch  # a spare slot per sequence: tables stay random
            if slots * layout.block_bytes > MAX_POOL_GIB * GIB:
                print(f"{batch:>5}{context:>8}  skipped: the pool would exceed {MAX_POOL_GIB} GiB")
                continue
            buffer = torch.randn(
                layout.pool_shape(slots), generator=gen, device=device, dtype=torch.bfloat16
            )
            table = torch.randperm(slots, generator=gen, device=device)[: batch * max_blocks]
            table = table.view(batch, max_blocks).to(torch.int32)
            q = torch.randn(
                batch, Q_HEADS, layout.head_dim, generator=gen, device=device, dtype=torch.bfloat16
            )
            full = torch.full((batch,), context, dtype=torch.int32, device=device)
            short = torch.randint(0, layout.block_tokens, (batch,), generator=gen, device=device)
            ragged = (full - short).to(torch.int32)
            err = relative_error(
                paged_attention.paged_decode(q, buffer, LAYER, table, ragged),
                paged_attention.paged_decode_reference(q, buffer, LAYER, table, ragged),
            )
            ref = paged_attention.paged_decode_reference(q, buffer, LAYER, table, full)
            out = paged_attention.paged_decode(q, buffer, LAYER, table, full)
            err = max(err, relative_error(out, ref))
            if err > TOLERANCE:
                mismatches.append(f"paged_decode {name}: error {err:.3g} > {TOLERANCE}")
            base_err = relative_error(gather_sdpa(q, buffer, table, context), ref)
            if base_err > TOLERANCE:
                mismatches.append(f"gather+sdpa {name}: error {base_err:.3g} > {TOLERANCE}")
            paged = partial(paged_attention.paged_decode, q, buffer, LAYER, table, full, out=out)
            baseline = partial(gather_sdpa, q, buffer, table, context)
            paged_s = median_of(repeat, partial(cuda_seconds, stream, paged))
            sdpa_s = median_of(repeat, partial(cuda_seconds, stream, baseline))
            kv_bytes = batch * context * 2 * layout.num_kv_heads * layout.head_dim * layout.itemsize
            row = figures[name] = {
                "batch": batch,
                "context": context,
                "error": err,
                "baseline_error": base_err,
                "paged_ms": paged_s * 1e3,
                "kv_gbps": kv_bytes / paged_s / 1e9,
                "of_dram": kv_bytes / paged_s / dram,
                "gather_sdpa_ms": sdpa_s * 1e3,
                "speedup": sdpa_s / paged_s,
            }
            print(
                f"{batch:>5}{context:>8}{err:>9.1e}{row['paged_ms']:>10.3f}{row['kv_gbps']:>9.0f}"
                f"{row['of_dram']:>9.2f}{row['gather_sdpa_ms']:>16.3f}{row['speedup']:>9.2f}"
            )
            del buffer, table, q, out, ref
            torch.cuda.empty_cache()
    figures["dram_gbps"] = {"read_plus_written": dram / 1e9}
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_kernels: CUDA is not available (torch.cuda.is_available() is false); "
            "this benchmark needs a CUDA GPU. Nothing was measured."
        )
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    print(
        f"{torch.cuda.get_device_name(device)}; block copies of {args.mib} MiB per move; "
        f"medians of {args.repeat}; GB/s = 1e9 B/s"
    )
    mismatches: list[str] = []
    copies = measure_block_copy(args.mib, args.repeat, device, mismatches)
    attention = measure_attention(args.repeat, device, mismatches)

    for mismatch in mismatches:
        print(f"MISMATCH {mismatch}")
    ratios = [
        f"{name.replace(' ', '_')}_{method}/raw={row[f'{method}_over_raw']:.2f}"
        for name, row in copies.items()
        for method in ("kernel", "per_block")
        if f"{method}_over_raw" in row
    ]
    ratios += [
        f"decode_{name}:dram={row['of_dram']:.2f},vs_sdpa={row['speedup']:.2f}"
        for name, row in attention.items()
        if "of_dram" in row
    ]
    print(f"ratios: {' '.join(ratios)} mismatches={len(mismatches)}")
    out = os.environ.get("OUT")
    if out:
        report = {
            "device": torch.cuda.get_device_name(device),
            "mib": args.mib,
            "repeat": args.repeat,
            "block_copy": copies,
            "paged_decode": attention,
            "mismatches": mismatches,
        }
        (Path(out) / "bench_kernels.json").write_text(json.dumps(report, indent=2) + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
