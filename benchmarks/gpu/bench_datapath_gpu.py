"""The data path at memory speed on a GPU (issue 19): `KVStore.load` and `store` between pinned
host memory and HBM, each against `torch.cuda` copies of the same bytes in the same run.

A store whose gpu tier is on this CUDA device and whose host tier is pinned (no disk, the mover
inline), each pool 1.25x the prompt, so that nothing is demoted; 1 MiB blocks (32 layers, 8 kv
heads, head_dim 64) and 64 KiB blocks (4 layers, 4 kv heads, head_dim 64), bf16, 16 tokens a
block; prompts of `--sizes` MiB (default 16, 256, 1024). Per block shape and prompt:

  load h2d out=layers|blocks  blocks on host only (stored, then evicted from gpu) into a CUDA
                              `out`                                       vs one H2D copy
  load d2h out=layers|blocks  blocks on gpu into a pinned host `out`     vs one D2H copy
  store write_through         a CUDA KV into gpu and host slots          vs one D2D + one D2H copy
  store write_back            a CUDA KV into gpu slots                   vs one D2D copy

A raw copy is `dst.copy_(src, non_blocking=True)` between preallocated contiguous buffers (the
host one pinned): one cudaMemcpyAsync. Every op is timed from an idle device to
`torch.cuda.synchronize()` after it; rounds run a figure and its baseline once each, which goes
first alternating, after `WARMUP` untimed rounds; medians of `--repeat` (5) rounds; the ratio
is the baseline's median seconds over the figure's (target >= 0.8). Stores land in free slots
(the store is cleared, untimed, before each). Each load is checked bit for bit (into a zeroed
`out`, on the GPU) once per prompt, outside the timing, and the blocks' residency (gpu, or host
only) before and after its figures.

Prints a table (each figure's median ms, and ms until its call returned: a store between CUDA
buffers only enqueues its copies, so a call that returns about when they end is bound by its
Python work) and, last, each figure group met or missed; writes the figures as JSON to
`$OUT/bench_datapath_gpu.json` when `$OUT` is set.
Run: `python benchmarks/gpu/bench_datapath_gpu.py [--sizes 16,256,1024] [--repeat N]`. Exit
status: 0 ok, 1 on any mismatch, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier import KVStore, parse_config
from kvtier.blocks import KVLayout, blocks_of
from kvtier.results import LoadResult

MIB = 1 << 20
TARGET = 0.8
WARMUP = 2
LAYOUTS = (
    KVLayout("1MiB", 32, 8, 64, "bfloat16", 16),
    KVLayout("64KiB", 4, 4, 64, "bfloat16", 16),
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def store_of(layout: KVLayout, mib: int, write: str, device: torch.device) -> KVStore:
    """gpu on `device` and host (pinned with CUDA), each 1.25x `mib`; policy `write`."""
    capacity = f"{-(-mib * 5 // 4)}MiB"
    config = {
        "model": {
            "name": layout.model_name,
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "dtype": layout.dtype_name,
        },
        "block_tokens": layout.block_tokens,
        "tiers": {
            "gpu": {"capacity": capacity, "device": str(device)},
            "host": {"capacity": capacity, "pinned": device.type == "cuda"},
        },
        "policy": {"write": write},
        "mover": {"background": False},
    }
    return KVStore(parse_config(config))


@dataclass
class Prompt:
    """A prompt's tokens, its KV on the device (random bits), and a zeroed `out` of its size
    on the device and one in pinned host memory."""

    layout: KVLayout
    tokens: np.ndarray[Any, Any]
    kv: torch.Tensor
    out: torch.Tensor
    host_out: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_blocks(self) -> int:
        return len(self.tokens) // self.layout.block_tokens

    def pages(self, out: torch.Tensor) -> torch.Tensor:
        """`out`'s memory seen as pages `[blocks, *block_shape]` (layout "blocks")."""
        return out.view(self.num_blocks, *self.layout.block_shape)


def prompt_of(layout: KVLayout, mib: int, device: torch.device) -> Prompt:
    num_tokens = mib * MIB // layout.block_bytes * layout.block_tokens
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device)
    pinned = device.type == "cuda"
    host = torch.zeros(shape, dtype=layout.dtype, pin_memory=pinned)
    out = torch.zeros(shape, dtype=layout.dtype, device=device)
    tokens = np.arange(num_tokens, dtype=np.int64)
    return Prompt(layout, tokens, bits.view(layout.dtype), out, host)


# ---- timing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One timed call, and what runs untimed just before it (a clear before a store)."""

    run: Callable[[], object]
    before: Callable[[], object] | None = None


def medians(ops: list[Op], repeat: int, device: torch.device) -> list[tuple[float, float]]:
    """Median seconds of each op over `repeat` rounds after `WARMUP` untimed ones, each timed
    from an idle device to the end of its copies, and the median seconds until the call
    returned (copies between CUDA buffers are only enqueued by then: a call that returns about
    when its copies end is bound by its Python work, not by them); the order rotates by one
    each round."""
    samples: list[list[float]] = [[] for _ in ops]
    cpu: list[list[float]] = [[] for _ in ops]
    for r in range(WARMUP + repeat):
        for k in range(len(ops)):
            op = ops[(r + k) % len(ops)]
            if op.before is not None:
                op.before()
            sync(device)
            start = time.perf_counter()
            result = op.run()
            returned = time.perf_counter()
            sync(device)
            elapsed, used = time.perf_counter() - start, returned - start
            del result
            if r >= WARMUP:
                samples[(r + k) % len(ops)].append(elapsed)
                cpu[(r + k) % len(ops)].append(used)
    return [(statistics.median(s), statistics.median(c)) for s, c in zip(samples, cpu, strict=True)]


@dataclass(frozen=True)
class Figure:
    block: str
    prompt_mib: int
    name: str
    nbytes: int
    seconds: float
    baseline: str
    baseline_seconds: float
    call_seconds: float  # until the figure's call returned (median; module doc)

    @property
    def ratio(self) -> float:
        return self.baseline_seconds / self.seconds

    def row(self) -> str:
        gbps, base = self.nbytes / self.seconds / 1e9, self.nbytes / self.baseline_seconds / 1e9
        verdict = "met" if self.ratio >= TARGET else "MISSED"
        return (
            f"{self.block:<6}{self.prompt_mib:>5}MiB  {self.name:<24}{gbps:>7.1f}  "
            f"{self.baseline:<12}{base:>7.1f}{self.ratio:>7.3f}  {verdict:<7}"
            f"{self.seconds * 1e3:>9.3f}{self.call_seconds * 1e3:>9.3f}"
        )

    def as_json(self) -> dict[str, Any]:
        gbps = {"gbps": self.nbytes / self.seconds / 1e9, "ratio": self.ratio}
        return {**asdict(self), **gbps, "met": self.ratio >= TARGET}


HEADER = (
    f"{'block':<6}{'prompt':>8}  {'figure':<24}{'GB/s':>7}  {'baseline':<12}{'GB/s':>7}{'ratio':>7}"
    f"  {'':<7}{'ms':>9}{'call ms':>9}"
)


# ---- checks -----------------------------------------------------------------------------------


def check_load(name: str, loaded: LoadResult, want: torch.Tensor, num_tokens: int) -> list[str]:
    """What differs between `loaded` and `want` (same layout, on the device), bit for bit."""
    if loaded.num_tokens != num_tokens or loaded.kv.shape != want.shape:
        return [f"{name}: loaded {loaded.num_tokens} tokens of {tuple(loaded.kv.shape)}"]
    got = loaded.kv.to(want.device).view(torch.int16)
    if torch.equal(got, want.view(torch.int16)):
        return []
    bad = sum(not torch.equal(g, w) for g, w in zip(got, want.view(torch.int16), strict=True))
    return [f"{name}: {bad} of {len(want)} slices along dim 0 differ"]


def residency(store: KVStore, prompt: Prompt, tier: str, when: str) -> list[str]:
    """[] when every token of the prompt is cached with `tier` its fastest copy."""
    hit = store.lookup(prompt.tokens)
    held = hit.gpu_tokens if tier == "gpu" else hit.host_tokens
    if held == len(prompt.tokens):
        return []
    return [f"{when}: {held} of {len(prompt.tokens)} tokens on {tier} ({hit})"]


# ---- the figures ------------------------------------------------------------------------------


def raw(*copies: tuple[torch.Tensor, torch.Tensor]) -> Op:
    """One `dst.copy_(src, non_blocking=True)` per (dst, src), in order: cudaMemcpyAsync each."""

    def run() -> None:
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)

    return Op(run)


class Bench:
    """The figures of one prompt on `device`, and every mismatch met."""

    def __init__(self, prompt: Prompt, repeat: int, device: torch.device) -> None:
        self.prompt, self.repeat, self.device = prompt, repeat, device
        self.figures: list[Figure] = []
        self.mismatches: list[str] = []

    def add(self, name: str, op: Op, baseline: str, raw: Op) -> None:
        (seconds, call_seconds), (raw_seconds, _) = medians([op, raw], self.repeat, self.device)
        prompt = self.prompt
        figure = Figure(
            prompt.layout.model_name,
            prompt.nbytes // MIB,
            name,
            prompt.nbytes,
            seconds,
            baseline,
            raw_seconds,
            call_seconds,
        )
        print(figure.row(), flush=True)
        self.figures.append(figure)

    def loads(self, store: KVStore, direction: str, out: torch.Tensor, raw: Op) -> None:
        """Load into `out` in both layouts: checked once, then timed against `raw`."""
        prompt = self.prompt
        expected = {
            "layers": prompt.kv,
            "blocks": blocks_of(prompt.kv, prompt.layout.block_tokens, 0, prompt.num_blocks),
        }
        for kind, into in (("layers", out), ("blocks", prompt.pages(out))):
            out.zero_()
            loaded = store.load(prompt.tokens, out=into, layout=kind)
            sync(self.device)
            name = f"load {direction} out={kind}"
            self.mismatches += check_load(name, loaded, expected[kind], len(prompt.tokens))
            load = Op(partial(store.load, prompt.tokens, out=into, layout=kind))
            self.add(name, load, direction, raw)

    def store(self, store: KVStore, name: str, baseline: str, raw: Op) -> None:
        prompt = self.prompt
        op = Op(partial(store.store, prompt.tokens, prompt.kv), store.clear)
        self.add(f"store {name}", op, baseline, raw)


def measure(layout: KVLayout, mib: int, repeat: int, device: torch.device) -> Bench:
    """Every figure of one prompt (module doc)."""
    prompt = prompt_of(layout, mib, device)
    bench = Bench(prompt, repeat, device)
    d2d, d2h = (prompt.out, prompt.kv), (prompt.host_out, prompt.kv)
    with store_of(layout, mib, "write_through", device) as store:
        store.store(prompt.tokens, prompt.kv)
        bench.mismatches += residency(store, prompt, "gpu", "after the store")
        bench.loads(store, "d2h", prompt.host_out, raw(d2h))
        store.evict("gpu", prompt.num_blocks)
        bench.mismatches += residency(store, prompt, "host", "after the eviction from gpu")
        bench.loads(store, "h2d", prompt.out, raw((prompt.out, prompt.host_out)))
        bench.mismatches += residency(store, prompt, "host", "after the h2d loads")
        bench.store(store, "write_through", "d2d + d2h", raw(d2d, d2h))
    with store_of(layout, mib, "write_back", device) as store:
        bench.store(store, "write_back", "d2d", raw(d2d))
    return bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="16,256,1024", help="prompt sizes in MiB, with commas")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_datapath_gpu: CUDA is not available (torch.cuda.is_available() is false); "
            "this benchmark needs a CUDA GPU. Nothing was measured."
        )
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"{torch.cuda.get_device_name(device)}; prompts of {sizes} MiB; medians of "
        f"{args.repeat} rounds; GB/s = 1e9 B/s of the prompt's bytes; target >= {TARGET}"
    )
    print(HEADER)
    figures: list[Figure] = []
    mismatches: list[str] = []
    for layout in LAYOUTS:
        for mib in sizes:
            bench = measure(layout, mib, args.repeat, device)
            figures += bench.figures
            mismatches += bench.mismatches
            del bench
            torch.cuda.empty_cache()
    for mismatch in mismatches:
        print(f"MISMATCH {mismatch}")
    for group in ("load h2d", "load d2h", "store"):
        rows = [f for f in figures if f.name.startswith(group)]
        missed = [
            f"{f.block} {f.prompt_mib}MiB {f.name} {f.ratio:.3f}" for f in rows if f.ratio < TARGET
        ]
        state = "MISSED" if missed else "met"
        print(
            f"{state}: {group} >= {TARGET} of raw"
            + (f" (missed: {', '.join(missed)})" if missed else "")
        )
    out = os.environ.get("OUT")
    if out:
        report = {
            "device": torch.cuda.get_device_name(device),
            "sizes_mib": sizes,
            "repeat": args.repeat,
            "target": TARGET,
            "figures": [f.as_json() for f in figures],
            "mismatches": mismatches,
        }
        (Path(out) / "bench_datapath_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
