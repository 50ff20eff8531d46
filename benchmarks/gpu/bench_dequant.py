"""Quantized host tier, the GPU side (issue 17): the Triton decoder against a raw copy, on CUDA.

One script for one call on a CUDA machine (an H200), well under 2 minutes. Blocks of
Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, bf16, 16 tokens: 2 MiB), `--blocks` of them
(default 256, 512 MiB raw), random bf16 KV with a per-channel offset in K:

1. Decode on the device: payloads already on the GPU decoded by `dequantize` (the Triton
   kernel, fp fusion off) into scattered slots of a gpu pool, against `copy_` of the same raw
   bytes between two device buffers (the ceiling a decoder that reads payloads and writes
   blocks is compared with). GB/s of raw bf16 written.
2. Promotion host -> gpu, what a prefetch from a quantized host tier does: payloads in pinned
   host memory copied up (`non_blocking`) and decoded, against the raw blocks copied up. A
   promotion moves `ratio` times fewer bytes over PCIe, then decodes.
3. Encode on the device (torch, as a demotion gpu -> host runs it), GB/s of raw bf16 read.
4. Checks: the kernel's output bit for bit against `QuantCodec.decode` run on the same GPU
   (torch, op by op: the same roundings), for every codec. A mismatch is reported, the run goes
   on, the exit status is 1.

Timing: CUDA events around each step on the current stream, median of `--repeat` (5) after a
warm-up. Writes `$OUT/bench_dequant.json` when `$OUT` is set.
Run: `python benchmarks/gpu/bench_dequant.py [--blocks N] [--repeat N]`. Exit status: 0 ok, 1
on a mismatch, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.blocks import KVLayout
from kvtier.kernels.dequant import dequantize
from kvtier.quant import QuantCodec, QuantSpec

LAYOUT = KVLayout("llama-3.1-8b", 32, 8, 128, "bfloat16", 16)
SPECS = {
    "fp8": QuantSpec("fp8"),
    "int8": QuantSpec("int8"),
    "int4": QuantSpec("int4"),
    "int4 keys/channel": QuantSpec("int4", keys="channel"),
}


def kv_blocks(n: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, *LAYOUT.block_shape, generator=gen, device=device)
    x[:, :, 0] += torch.randn(LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=gen, device=device)
    return x.to(LAYOUT.dtype)


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `fn` on the current stream, CUDA events around it, after a warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(float(start.elapsed_time(end)) / 1e3)
    return statistics.median(samples)


def differ(codec: QuantCodec, payload: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> None:
    """Print how the kernel's output differs from torch's decode on the GPU, and which of the
    two a decode by torch on the CPU agrees with: what the next session needs to fix it."""
    on_cpu = codec.decode(payload.cpu())
    g, w, c = (t.reshape(len(t), -1).view(torch.int16).cpu() for t in (got, want, on_cpu))
    wrong = (g != w).nonzero()
    print(
        f"{codec.id}: {len(wrong)} of {g.numel()} values differ from torch on the GPU; "
        f"kernel == torch on the CPU: {bool(torch.equal(g, c))}, "
        f"torch GPU == torch CPU: {bool(torch.equal(w, c))}"
    )
    for b, e in wrong[:8].tolist():
        code = int(payload[b, e].item()) if e < codec.code_nbytes else -1
        kernel = g[b, e].view(torch.bfloat16).item()
        print(
            f"  block {b} value {e}: code 0x{code:02x}, kernel {kernel!r} "
            f"(0x{int(g[b, e]) & 0xFFFF:04x}), torch GPU {w[b, e].view(torch.bfloat16).item()!r} "
            f"(0x{int(w[b, e]) & 0xFFFF:04x}), torch CPU (0x{int(c[b, e]) & 0xFFFF:04x})"
        )


def measure(codec: QuantCodec, blocks: torch.Tensor, repeat: int) -> dict[str, Any]:
    device = blocks.device
    n = blocks.shape[0]
    raw = n * LAYOUT.block_bytes
    pool = torch.empty(2 * n, *LAYOUT.block_shape, dtype=LAYOUT.dtype, device=device)
    slots = torch.randperm(2 * n, device=device)[:n]
    payload = codec.encode(blocks)
    dequantize(codec, payload, pool, slots)
    reference = codec.decode(payload)  # torch on the GPU
    exact = bool(torch.equal(pool[slots].view(torch.int16), reference.view(torch.int16)))
    if not exact:
        differ(codec, payload, pool[slots], reference)
    flat_src, flat_dst = blocks.reshape(-1), torch.empty_like(blocks).reshape(-1)
    copy_s = timed(lambda: flat_dst.copy_(flat_src), repeat)
    decode_s = timed(lambda: dequantize(codec, payload, pool, slots), repeat)
    encode_s = timed(lambda: codec.encode(blocks), repeat)
    pinned_payload = payload.cpu().pin_memory()
    pinned_raw = blocks.cpu().pin_memory()
    up_raw_s = timed(lambda: flat_dst.copy_(pinned_raw.reshape(-1), non_blocking=True), repeat)
    staged = torch.empty_like(payload)

    def promote() -> None:
        staged.copy_(pinned_payload, non_blocking=True)
        dequantize(codec, staged, pool, slots)

    promote_s = timed(promote, repeat)
    return {
        "codec": codec.id,
        "ratio": codec.ratio(),
        "bit_exact": exact,
        "decode_gbs": raw / decode_s / 1e9,
        "copy_gbs": raw / copy_s / 1e9,
        "encode_gbs": raw / encode_s / 1e9,
        "promote_gbs": raw / promote_s / 1e9,
        "promote_raw_gbs": raw / up_raw_s / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_dequant: CUDA is not available; this script needs a GPU")
        return 2
    device = torch.device("cuda")
    blocks = kv_blocks(args.blocks, device)
    rows = {n: measure(QuantCodec(spec, LAYOUT), blocks, args.repeat) for n, spec in SPECS.items()}
    size = LAYOUT.block_bytes >> 20
    print(f"{args.blocks} blocks of {size} MiB (Llama-3.1-8B, bf16), GB/s of raw KV")
    print(
        f"{'codec':<18} {'id':>8} {'smaller':>7} {'decode':>8} {'d2d copy':>8} {'encode':>8} "
        f"{'promote':>8} {'raw H2D':>8} {'exact':>6}"
    )
    for name, r in rows.items():
        print(
            f"{name:<18} {r['codec']:>8} {r['ratio']:>6.2f}x {r['decode_gbs']:>8.1f} "
            f"{r['copy_gbs']:>8.1f} {r['encode_gbs']:>8.1f} {r['promote_gbs']:>8.1f} "
            f"{r['promote_raw_gbs']:>8.1f} {r['bit_exact']!s:>6}"
        )
    print(
        "decode / copy: "
        + ", ".join(f"{n} {r['decode_gbs'] / r['copy_gbs']:.2f}" for n, r in rows.items())
        + "; promote / raw H2D: "
        + ", ".join(f"{n} {r['promote_gbs'] / r['promote_raw_gbs']:.2f}" for n, r in rows.items())
    )
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_dequant.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["bit_exact"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
