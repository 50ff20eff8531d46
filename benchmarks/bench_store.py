"""`KVStore.store` of a half-cached prompt, against the code of an earlier commit (issue 13).

Workload: tiny KV (1 layer, 1 kv head, head_dim 8, float16, block_tokens 16: 512-byte blocks),
`write_back` (one gpu copy per block; `--write write_through` adds the host copy), the mover
inline. 20 shared 1000-token prefixes are stored first; each timed call stores a new 2000-token
prompt: one of those prefixes and 1000 tokens of its own, so 125 blocks of which 62 are cached
and 63 new. Tokens arrive as a Python list, an int64 NumPy array or an int64 torch tensor; the
KV is one `[1, 2, 2000, 1, 8]` tensor for every call. The pools are sized to hold every block a
run stores (nothing is evicted) and written once before timing, so no call pays a first touch.

Baseline in the same run: the same workload on the code of `--baseline` (default c4f5e4c, the
code before issue 13's store work), exported with `git archive` into a temporary directory.
Each side runs in its own worker process (this script with `--worker`, `PYTHONPATH` naming the
code it imports; both print the `kvtier` they loaded). The driver alternates them: for each
round and each input kind it has one side, then the other (the order flips every round), store
`--batch` prompts, timing each call with `perf_counter_ns`; inputs are prepared before the
timed calls. Both workers use one torch thread. Before and after timing, the driver checks
that both sides' indexes hold the same block ids for a prompt each stored, and that they are
the BLAKE2b chain of its tokens (ids are keys on disk and in events; since issue 13 they are
chained when first read, not in `store`).

Prints, per input kind: the median (and p90) microseconds per call of each side, and the
ratio baseline / now (how many times faster the working tree is).
Run: `python benchmarks/bench_store.py [--rounds 15] [--batch 200] [--baseline c4f5e4c]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from kvtier.blocks import Tokens

REPO = Path(__file__).resolve().parent.parent
KINDS = ("list", "ndarray", "tensor")
PROMPT, SHARED, NUM_PREFIXES, BT = 2000, 1000, 20, 16
BLOCK_BYTES = 1 * 2 * BT * 1 * 8 * 2


# ---- worker: one side, in its own process ------------------------------------------------


def worker(capacity_blocks: int, policy: str) -> None:
    """Serve the driver's commands on stdin, one JSON reply per line on stdout."""
    import kvtier
    from kvtier.blocks import BlockHasher, encode_tokens
    from kvtier.config import parse_config
    from kvtier.store import KVStore

    torch.set_num_threads(1)
    tier_bytes = capacity_blocks * BLOCK_BYTES
    host_bytes = tier_bytes if policy == "write_through" else 64 * BLOCK_BYTES  # unused then
    config = parse_config(
        {
            "model": {
                "name": "bench-store",
                "num_layers": 1,
                "num_kv_heads": 1,
                "head_dim": 8,
                "dtype": "float16",
            },
            "block_tokens": BT,
            "tiers": {
                "gpu": {"capacity": tier_bytes, "device": "cpu"},
                "host": {"capacity": host_bytes, "pinned": False},
            },
            "policy": {"write": policy},
            "mover": {"background": False},
        }
    )
    store = KVStore(config)
    for pool in store.memory:
        pool.buffer.fill_(0)  # touch every page now, not in a timed call
    prefixes = np.random.default_rng(0).integers(0, 50_000, (NUM_PREFIXES, SHARED))
    kv = torch.zeros((1, 2, PROMPT, 1, 8), dtype=torch.float16)
    for prefix in prefixes:
        store.store(prefix.tolist(), kv[:, :, :SHARED])
    rng = np.random.default_rng(1)
    convert: dict[str, Callable[[np.ndarray[Any, Any]], Tokens]] = {
        "list": np.ndarray.tolist,
        "ndarray": np.asarray,
        "tensor": torch.from_numpy,
    }
    reply(version=kvtier.__file__)
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "ids":  # the ids the store's index gives a prompt it stored
            sample = np.concatenate([prefixes[0], np.arange(command["start"], SHARED)])
            store.store(sample.tolist(), kv[:, :, : len(sample)])
            key = encode_tokens(sample)
            seed = store.namespaces.seed("default")
            index = store.index
            held = b"".join(index.block_id(r) for r in index.blocks(index.match(seed, key).end))
            whole = key[: len(key) - len(key) % (BT * 4)]
            chain = BlockHasher(config.hashing.algorithm).chain(seed, whole, BT * 4)
            assert held == chain, "the index's ids are not the chain of the prompt's tokens"
            reply(ids=held.hex())
            continue
        kind, count = command["kind"], command["count"]
        prompts = [
            convert[kind](np.concatenate([prefixes[i % NUM_PREFIXES], fresh]))
            for i, fresh in enumerate(rng.integers(0, 50_000, (count, PROMPT - SHARED)))
        ]
        times = []
        stored = set()
        for tokens in prompts:
            start = time.perf_counter_ns()
            result = store.store(tokens, kv)
            times.append(time.perf_counter_ns() - start)
            stored.add((result.cached_tokens, result.stored_tokens))
        reply(times=times, results=sorted(stored))


def reply(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


# ---- driver: both sides, alternating -----------------------------------------------------


class Side:
    def __init__(self, name: str, path: Path, args: argparse.Namespace) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(path)}
        capacity = NUM_PREFIXES * 64 + args.rounds * args.batch * len(KINDS) * 63 + 64
        command = [sys.executable, __file__, "--worker", str(capacity), args.write]
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.version = self.ask(None)["version"]
        self.times: dict[str, list[int]] = {kind: [] for kind in KINDS}

    def ask(self, command: dict[str, Any] | None) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command is not None:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker ended (exit {self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, kind: str, count: int) -> None:
        answer = self.ask({"do": "store", "kind": kind, "count": count})
        # every call stored the 63 new blocks of a 125-block prompt
        assert answer["results"] == [[PROMPT - PROMPT % BT, 63 * BT]], answer["results"]
        self.times[kind] += answer["times"]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def export(commit: str, into: Path) -> None:
    """The `kvtier` package of `commit`, written under `into` (git archive: no worktree)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "kvtier"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def us(values: list[int], q: float) -> float:
    return float(np.quantile(np.asarray(values), q)) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=200, help="calls per side per round")
    parser.add_argument("--baseline", default="c4f5e4c", help="commit timed as the baseline")
    parser.add_argument("--write", default="write_back", choices=["write_back", "write_through"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        export(args.baseline, Path(tmp))
        sides = [Side(f"baseline {args.baseline}", Path(tmp), args), Side("now", REPO, args)]
        try:
            for side in sides:
                print(f"{side.name:>18}: {side.version}")
            ids = {side.ask({"do": "ids", "start": 0})["ids"] for side in sides}
            assert len(ids) == 1, "the two sides give different block ids for the same tokens"
            print("block ids: the same on both sides (the 125 blocks of one prompt, as stored)")
            for round_ in range(args.rounds):
                for kind in KINDS:
                    for side in sides if round_ % 2 == 0 else sides[::-1]:
                        side.run(kind, args.batch)
            ids = {side.ask({"do": "ids", "start": 7})["ids"] for side in sides}
            assert len(ids) == 1, "after the timed calls, the two sides' ids differ"
        finally:
            for side in sides:
                side.close()
    old, new = sides
    calls = args.rounds * args.batch
    print(
        f"\nKVStore.store, 2000-token prompt, 62 blocks cached + 63 new, {args.write}, "
        f"{calls} calls per side per kind, alternating in {args.rounds} rounds"
    )
    print(
        f"{'tokens as':<10} {'baseline p50':>13} {'p90':>8} {'now p50':>9} {'p90':>8} {'ratio':>7}"
    )
    for kind in KINDS:
        before, after = old.times[kind], new.times[kind]
        ratio = statistics.median(before) / statistics.median(after)
        print(
            f"{kind:<10} {us(before, 0.5):>10.1f} us {us(before, 0.9):>8.1f} "
            f"{us(after, 0.5):>6.1f} us {us(after, 0.9):>8.1f} {ratio:>6.2f}x"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3])
    else:
        main()
