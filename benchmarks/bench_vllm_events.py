"""What relaying kvtier's KV events into vLLM's stream costs the scheduler process
(`kvtier.events_endpoint`, `integrations/vllm_events.py`): the relay's CPU per block and medium
(decode, checks, vLLM's event objects, `take`), against a router's `PrefixIndex.apply` of the
same messages in the same run (what any subscriber pays to follow them).

Messages shaped as a kvtier store publishes them: one per store of `--blocks` new 16-token
blocks written to two tiers (a BlockStored in GPU and one in CPU, chained), `--messages` of
them, vLLM taking the queue every 10 messages. CPU time (`time.process_time`), medians of
`--reps` alternated rounds, and the ratio.

    bash tests/engines/install.sh vllm
    PYTHONPATH=.engines/vllm python benchmarks/bench_vllm_events.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import msgpack  # type: ignore[import-untyped]

from kvtier.integrations.vllm_events import Relay
from kvtier.routing import PrefixIndex

BS = 16


def messages(count: int, blocks: int) -> list[bytes]:
    """`count` messages, each a store of `blocks` new blocks (chained to the last one's) in two
    media."""
    out, parent = [], None
    for m in range(count):
        hashes = list(range(m * blocks + 1, (m + 1) * blocks + 1))
        tokens = list(range(m * blocks * BS, (m + 1) * blocks * BS))
        events = [["BlockStored", hashes, parent, tokens, BS, None, medium, None]
                  for medium in ("GPU", "CPU")]  # fmt: skip
        out.append(msgpack.packb([time.time(), events, None]))
        parent = hashes[-1]
    return out


def relayed(payloads: list[bytes]) -> float:
    relay = Relay(BS, max_blocks=1 << 24, max_pending=1 << 24)
    start = time.process_time()
    for i, payload in enumerate(payloads):
        relay.apply("kv@pod@model", payload)
        if i % 10 == 9:
            relay.take()
    relay.take()
    seconds = time.process_time() - start
    assert relay.stats()["bad"] == 0
    relay.check()
    return seconds


def routed(payloads: list[bytes]) -> float:
    index = PrefixIndex(BS, max_blocks=1 << 24)
    start = time.process_time()
    for payload in payloads:
        index.apply("kv@pod@model", payload)
    seconds = time.process_time() - start
    assert index.stats()["bad"] == 0
    index.check()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=62)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    payloads = messages(args.messages, args.blocks)
    per = args.messages * args.blocks * 2 / 1e6  # block-media, in millions: us per one
    sides: dict[str, Callable[[list[bytes]], float]] = {"relay": relayed, "router": routed}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(args.reps):
        for name in sorted(sides, reverse=rep % 2 == 1):  # each side first in turn
            times[name].append(sides[name](payloads) / per)
    for name, samples in times.items():
        print(f"{name:<8} {statistics.median(samples):6.3f} us per block and medium "
              f"(median of {args.reps}; {min(samples):.3f}-{max(samples):.3f})")  # fmt: skip
    ratio = statistics.median(times["relay"]) / statistics.median(times["router"])
    print(f"relay / router: {ratio:.2f}")


if __name__ == "__main__":
    main()
