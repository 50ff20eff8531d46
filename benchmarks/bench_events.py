"""What KV events cost a store (issue 16: the target is 5 %), against the same store without
them, in the same run.

Workload: tiny KV (2 layers, 2 kv heads, head_dim 8, float16, block_tokens 16), gpu and host
tiers on the CPU (`write_through`: each new block gains two copies, two events), the mover
inline. Each timed call stores a 2000-token prompt: a shared 1000-token prefix and 1000 tokens
of its own: 62 cached blocks and 63 new ones. Three stores are built per round, in turn:
- off: no `events` section;
- built: events built by the index's observer (ids, tokens, hashes) but never queued;
- on: `events` on a loopback ZMQ PUB, nobody subscribed (ZMQ drops the messages, as for a
  router that is not there; the publisher's thread still packs and sends them).
Figures are medians over `--rounds` rounds of the per-call median, in microseconds, and the
ratios on / off and built / off.
Run: `python benchmarks/bench_events.py [--rounds 5] [--calls 300]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from kvtier import KVStore, parse_config
from kvtier.events import EventPublisher, IndexEvents
from kvtier.index import RadixIndex

PREFIX, OWN = 1000, 1000


def make(mode: str) -> KVStore:
    config: dict[str, Any] = {
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                  "dtype": "float16"},
        "block_tokens": 16,
        "tiers": {"gpu": {"capacity": "64MiB", "device": "cpu"},
                  "host": {"capacity": "64MiB", "pinned": False}},
        "policy": {"write": "write_through"},
        "mover": {"background": False},
    }  # fmt: skip
    if mode != "off":
        config["events"] = {"endpoint": "tcp://127.0.0.1:0"}
    store = KVStore(parse_config(config))
    if mode == "built":  # the observer's work only: nothing reaches the publisher's queue
        assert store.parts.events is not None
        observer = store.index.observer
        assert isinstance(observer, IndexEvents)
        # every event counted as dropped, none queued: the observer keeps its own copy of the
        # limit, read when the store was built (before, only the publisher's was set, and the
        # "built" store queued and sent every event as "on" did)
        store.parts.events.queue_limit = observer.queue_limit = 0
        store.parts.events.overflow = lambda *_: None  # type: ignore[method-assign]
    return store


def observe(index: RadixIndex) -> EventPublisher:
    """Events on for a bare index (`bench_index.py`): its observer feeding a publisher on a
    loopback PUB nobody reads, every block told of as tenant "bench"'s."""
    publisher = EventPublisher("tcp://127.0.0.1:0")
    # a dict's lookup, as the store's (`Namespaces.tenant_of`)
    every: defaultdict[bytes, str] = defaultdict(lambda: "bench")
    index.observer = IndexEvents(publisher, index, every.__getitem__)
    return publisher


def one_round(mode: str, calls: int, offset: int) -> float:
    store = make(mode)
    kv = torch.zeros(2, 2, PREFIX + OWN, 2, 8, dtype=torch.float16)
    shared = list(range(PREFIX))
    times = []
    for call in range(calls):
        base = 10_000 + (offset + call) * OWN
        tokens = shared + list(range(base, base + OWN))
        start = time.perf_counter()
        stored = store.store(tokens, kv)
        times.append(time.perf_counter() - start)
        assert stored.stored_tokens == (PREFIX + OWN if call == 0 else 1008), stored  # 63 blocks
    store.close()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = ("off", "built", "on")
    figures: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        order = modes if round_ % 2 == 0 else modes[::-1]
        for mode in order:
            figures[mode].append(one_round(mode, args.calls, round_ * args.calls))
    med = {mode: statistics.median(values) for mode, values in figures.items()}
    for mode in modes:
        runs = " / ".join(f"{v:.0f}" for v in figures[mode])
        print(f"{mode:>5}: median {med[mode]:6.1f} us per store ({runs})")
    print(f"on / off {med['on'] / med['off']:.2f}, built / off {med['built'] / med['off']:.2f} "
          "(issue 16's target: on / off <= 1.05)")  # fmt: skip


if __name__ == "__main__":
    main()
