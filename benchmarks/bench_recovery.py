"""Recovery time of the disk tier (issue 3: "100k blocks should take seconds, not minutes").

Builds a store whose disk tier holds `--blocks` blocks (default 100,000) of a small layout
(4 KiB blocks, 8 KiB slots: 2 layers, 2 KV heads, head_dim 64, fp16, 4 tokens), written by
`persist()` from 64-block sequences sharing 16 prefixes, then closes it and times the start of
a new store on the same directory: the header scan, id re-hashing and index rebuild. It checks
that every block was recovered and that a sample loads bit-exact. Prints the median of
`--repeat` starts. Run: `python benchmarks/bench_recovery.py [--blocks N] [--dir DIR]`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier import KVStore, parse_config

SEQ_BLOCKS, BT = 64, 4


def config(path: Path, blocks: int) -> dict[str, object]:
    block_bytes = 2 * 2 * BT * 2 * 64 * 2
    return {
        "model": {
            "name": "recovery",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 64,
            "dtype": "float16",
        },
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": 64 * block_bytes},
            "host": {"capacity": (blocks + 1024) * block_bytes, "high_watermark": 1.0},
            "disk": {"capacity": (blocks + 1024) * 2 * block_bytes, "path": str(path)},
        },
    }


def tokens_of(seq: int) -> list[int]:
    return [seq % 16 * 10_000 + j for j in range(BT)] + [
        100_000 + seq * 1000 + j for j in range((SEQ_BLOCKS - 1) * BT)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="parent of the work directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=args.dir))
    try:
        cfg = parse_config(config(work / "disk", args.blocks))
        store = KVStore(cfg)
        seqs = -(-args.blocks // (SEQ_BLOCKS - 1))
        start = time.perf_counter()
        for seq in range(seqs):
            kv = torch.full((2, 2, SEQ_BLOCKS * BT, 2, 64), float(seq % 1000), dtype=torch.float16)
            store.store(tokens_of(seq), kv)
            if seq % 64 == 63:
                store.persist()
        store.persist()
        held = store.index.num_blocks
        print(f"wrote {held} blocks in {time.perf_counter() - start:.1f} s")
        store.close()
        seconds = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            store = KVStore(cfg)
            seconds.append(time.perf_counter() - start)
            assert store.recovery["recovered"] == held, store.recovery
            for seq in range(0, seqs, max(1, seqs // 20)):
                loaded = store.load(tokens_of(seq))
                assert loaded.num_tokens == SEQ_BLOCKS * BT
                assert bool((loaded.kv[:, :, BT:] == float(seq % 1000)).all())
            store.close()
        print(
            f"recovery of {held} blocks: median {statistics.median(seconds):.2f} s "
            f"(runs: {', '.join(f'{s:.2f}' for s in seconds)}); "
            f"{held / statistics.median(seconds):.0f} blocks/s"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
