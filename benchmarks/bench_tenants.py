"""What the number of tenants costs a store that evicts on every call (fair-share floors).

Workload: tiny KV (1 layer, 1 kv head, head_dim 8, float16, block_tokens 16), gpu 4 MiB and
host 8 MiB on the CPU, the mover inline, so that nearly every `store()` makes room in both
tiers. N tenants with their default floors (an equal share each); `--stores` prompts of 512
random tokens, stored round-robin over the tenants. Printed per N: `store()` p50 and p99, and
the p50's ratio to one tenant's, measured in the same run (the baseline).
Run: `python benchmarks/bench_tenants.py [--tenants 1,100,2000] [--stores 3000]`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvtier import KVStore, parse_config


def store_times(tenants: int, stores: int, seed: int = 0) -> np.ndarray:
    """Seconds of each `store()` call with `tenants` tenants (module doc)."""
    config = parse_config(
        {
            "model": {"name": "t", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                      "dtype": "float16"},
            "block_tokens": 16,
            "tiers": {"gpu": {"capacity": "4MiB", "device": "cpu"}, "host": {"capacity": "8MiB"}},
            "mover": {"background": False},
            "tenants": {f"t{i}": {} for i in range(tenants)},
        }
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    kv = torch.zeros(1, 2, 512, 1, 8, dtype=torch.float16)
    times = []
    with KVStore(config) as store:
        for i in range(stores):
            tokens = rng.integers(0, 50_000, 512)
            started = time.perf_counter()
            store.store(tokens, kv, tenant=f"t{i % tenants}")
            times.append(time.perf_counter() - started)
        store.check()
    return np.array(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", default="1,100,2000", help="comma-separated counts")
    parser.add_argument("--stores", type=int, default=3000)
    args = parser.parse_args()
    counts = [int(n) for n in args.tenants.split(",")]
    base = None
    for n in counts:
        times = store_times(n, args.stores) * 1e3
        p50, p99 = float(np.median(times)), float(np.percentile(times, 99))
        base = p50 if base is None else base
        print(f"{n:>6} tenants: store p50 {p50:.3f} ms, p99 {p99:.3f} ms, "
              f"p50 / {counts[0]} tenant(s) {p50 / base:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
