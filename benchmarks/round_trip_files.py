"""Which kvtier modules one block's round trip runs (issue 12's "files the round trip touches").

    python benchmarks/round_trip_files.py [--list]

A store with the tiny disk-tier layout of the tests (mover inline): store one 2-block prefix,
demote it gpu -> host -> disk (`evict`), prefetch it back to gpu, run a paged decode over its
lease, release. Every Python function entered in a module under kvtier/ while these calls run
(any thread) is recorded with `sys.setprofile`; the script prints how many modules that is (and
with --list, which). The profile is installed before the store is built, so that threads the
store starts (I/O pools, executor workers) are traced too, and records only while the round
trip runs. Run it at two commits to compare.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from conftest import disk_config, kv_for  # noqa: E402

from kvtier.kernels.attention import PagedAttention  # noqa: E402
from kvtier.store import KVStore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the modules too")
    args = parser.parse_args()
    package = str(ROOT / "kvtier")
    seen: set[str] = set()
    recording = threading.Event()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and recording.is_set() and frame.f_code.co_filename.startswith(package):
            seen.add(str(Path(frame.f_code.co_filename).relative_to(package)))

    sys.setprofile(profile)
    threading.setprofile(profile)
    with tempfile.TemporaryDirectory() as directory:
        store = KVStore(disk_config(Path(directory) / "disk", background=False))
        layout = store.layout
        tokens, kv = list(range(8)), kv_for(store, 8)
        attention = PagedAttention(store)
        q = torch.randn(1, 2 * layout.num_kv_heads, layout.head_dim, dtype=layout.dtype)
        recording.set()
        store.store(tokens, kv)
        store.evict("gpu", 4)
        store.evict("host", 4)
        lease = store.prefetch(tokens)
        attention.decode(q, 0, [lease])
        store.release(lease)
        recording.clear()
        sys.setprofile(None)
        threading.setprofile(None)
        store.close()
    print(f"modules the round trip runs: {len(seen)}")
    if args.list:
        print("\n".join(sorted(seen)))


if __name__ == "__main__":
    main()
