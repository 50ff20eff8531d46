"""Online eviction policies against LRU of leaves on a real trace (issue 13), by exact simulation.

Each policy of `kvtier.replay.policies.POLICIES` runs the trace (default: the Mooncake
conversation trace, 512-token blocks) through one prefix cache of 1, 5, 10, 25 and 50% of the
trace's unique blocks (`kvtier.replay.simulate`: hit = longest cached prefix, only leaves are
evicted, a request never evicts what it uses). The table gives each policy's hit rate (share of
the block references served) and, for the online candidates, the difference from LRU of leaves
in points; the offline furthest-next-use leaf is a planner's headroom, the last row the
infinite-cache ceiling. A simulation is deterministic, so one run is the figure (no medians).

The verdict line names every online candidate that beats LRU by at least 2 points at the
small sizes (1 and 5%) without losing 0.1 point or more at any size.
Run: `python benchmarks/bench_policies.py [--trace PATH] [--limit N] [--sizes 0.01,0.05,...]`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from kvtier.replay import Furthest, ceiling, chains, read_trace, simulate
from kvtier.replay.policies import POLICIES, PolicyFactory
from kvtier.replay.simulate import Chain, Policy

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
SMALL = (0.01, 0.05)
WIN_POINTS = 2.0
LOSS_POINTS = 0.1
OFFLINE = "furthest (offline)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trace", default=str(TRACE), help="Mooncake-format JSONL trace")
    parser.add_argument("--limit", type=int, help="only the first N requests")
    parser.add_argument("--sizes", default="0.01,0.05,0.1,0.25,0.5", help="fractions of unique")
    args = parser.parse_args(argv)
    sizes = [float(f) for f in args.sizes.split(",")]
    requests = read_trace(args.trace, args.limit)
    limit = ceiling(requests)
    keys = chains(requests)
    print(
        f"trace {args.trace}: {limit.requests:,} requests, {limit.references:,} block "
        f"references, {limit.unique_blocks:,} unique blocks"
    )
    rates: dict[str, list[float]] = {}
    makers: dict[str, PolicyFactory] = {**POLICIES, OFFLINE: offline}
    for name, make in makers.items():
        started = time.perf_counter()
        rates[name] = []
        for fraction in sizes:
            capacity = max(1, round(fraction * limit.unique_blocks))
            rates[name].append(100 * simulate(keys, capacity, make(keys, capacity)).hit_rate)
        print(f"  {name}: {time.perf_counter() - started:.1f} s")
    lru = rates["lru"]
    print()
    print("| policy | " + " | ".join(f"{f:.0%}" for f in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name, row in rates.items():
        cells = [
            f"{rate:.1f}" if name == "lru" else f"{rate:.1f} ({rate - base:+.1f})"
            for rate, base in zip(row, lru, strict=True)
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    top = f"{100 * limit.hit_rate:.1f}"
    print("| infinite-cache ceiling | " + " | ".join(top for _ in sizes) + " |")
    small = [i for i, f in enumerate(sizes) if f in SMALL]
    winners = [name for name in POLICIES if name != "lru" and beats(rates[name], lru, small)]
    print()
    print(
        "hit rate, % of block references (points vs LRU of leaves); beats LRU by >= "
        f"{WIN_POINTS:g} points at {', '.join(f'{f:.0%}' for f in SMALL)} without losing "
        f"elsewhere: {', '.join(winners) or 'none'}" + ("" if small else " (no small size was run)")
    )


def offline(keys: Sequence[Chain], capacity: int) -> Policy:
    return Furthest(keys)


def beats(row: list[float], lru: list[float], small: list[int]) -> bool:
    """At least `WIN_POINTS` above LRU at every small size (there must be one), and nowhere
    `LOSS_POINTS` or more below it."""
    return (
        bool(small)
        and all(row[i] - lru[i] >= WIN_POINTS for i in small)
        and all(r - b > -LOSS_POINTS for r, b in zip(row, lru, strict=True))
    )


if __name__ == "__main__":
    main()
