"""The writer of the crash test (`test_disk_crash.py`), run as a separate process.

    python crash_writer.py DISK_DIR FIRST_SEQ [CODEC]

Opens a store whose disk tier is DISK_DIR (recovering what is there), prints `ready`, then
stores sequence after sequence from FIRST_SEQ on, persists each one and only then prints
`ack N`: a sequence is acknowledged once its blocks are durable. After `PER_RUN` sequences it
idles until it is killed, so that 20 runs never outgrow the disk tier (an LRU eviction of an
acknowledged block would be correct behaviour, but not what this test is about). CODEC is the
disk tier's (`tiers.disk.codec`, default none).
"""

from __future__ import annotations

import sys
import time

import torch

from kvtier import KVStore, parse_config

BT = 16
BLOCKS_PER_SEQ = 3
SHARED_PREFIXES = 4
PER_RUN = 150


def config(disk_dir: str, codec: str = "none") -> dict[str, object]:
    return {
        "model": {
            "name": "crash",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 32,
            "dtype": "float16",
        },
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": "256KiB", "high_watermark": 1.0, "low_watermark": 1.0},
            "host": {"capacity": "256KiB", "high_watermark": 1.0, "low_watermark": 1.0},
            "disk": {"capacity": "96MiB", "path": disk_dir, "codec": codec},
        },
        "policy": {"write": "write_back", "disk_admission_hits": 0},
    }


def tokens_of(seq: int) -> list[int]:
    """A shared first block (one of a few), then blocks of its own."""
    shared = [7_000_000 + (seq % SHARED_PREFIXES) * BT + j for j in range(BT)]
    own = [seq * 1000 + j for j in range((BLOCKS_PER_SEQ - 1) * BT)]
    return shared + own


def kv_of(seq: int) -> torch.Tensor:
    """The KV of a sequence; the shared first block's KV depends only on its prefix."""
    own = torch.Generator().manual_seed(seq)
    first = torch.Generator().manual_seed(10**9 + seq % SHARED_PREFIXES)
    shape = (2, 2, BT, 2, 32)
    head = torch.randn(shape, generator=first, dtype=torch.float32).to(torch.float16)
    tail_shape = (2, 2, (BLOCKS_PER_SEQ - 1) * BT, 2, 32)
    tail = torch.randn(tail_shape, generator=own, dtype=torch.float32).to(torch.float16)
    return torch.cat([head, tail], dim=2)


def main() -> None:
    disk_dir, first = sys.argv[1], int(sys.argv[2])
    codec = sys.argv[3] if len(sys.argv) > 3 else "none"
    store = KVStore(parse_config(config(disk_dir, codec)))
    print("ready", flush=True)
    for seq in range(first, first + PER_RUN):
        store.store(tokens_of(seq), kv_of(seq))
        store.persist()
        print(f"ack {seq}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
