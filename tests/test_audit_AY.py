"""Audit AY: trace replay and capacity planning (`kvtier/replay/`).

- A fleet's replicas, or one store's gpu (in host memory) and host tiers, each within memory
  but not together, were opened all the same (a pool's mapping is committed as it is written)
  and the replay could fill them past the machine's memory: refused now before any opens.
- `--replicas N --route` past 341 replicas failed minutes in with a traceback (the router's
  subscriber ran out of ZMQ sockets): bounded now, refused before the trace is read.
- The LRU-of-leaves and furthest-next-use simulations match a brute-force cache written here.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_replay import write_trace

from kvtier.errors import InvalidArgumentError
from kvtier.replay.parallel import Workload, replay_all
from kvtier.replay.replicas import replay_fleet
from kvtier.replay.report import Sizing
from kvtier.replay.runner import ReplayOptions, replay
from kvtier.replay.simulate import LRU, Furthest, LeafCache, simulate
from kvtier.replay.trace import ceiling, read_trace
from kvtier.tiers.memory import available_host_bytes

BIG_BLOCK = 64 * 2**20  # the largest --block-bytes: few blocks make a large tier


def test_a_fleet_whose_replicas_together_pass_memory_is_refused(tmp_path: Path) -> None:
    # one id: a host tier of 100 times the unique blocks is 100 blocks of 64 MiB, 6.4 GiB,
    # which one store maps (lazily); enough replicas of it pass the memory available
    requests = read_trace(write_trace(tmp_path / "t.jsonl", [[0]]))
    each = 101 * BIG_BLOCK  # gpu 1 block + host 100
    replicas = available_host_bytes() // each + 1
    if replicas > 1024:
        pytest.skip(reason="this machine's memory holds more than 1024 such replicas")
    options = ReplayOptions(block_bytes=BIG_BLOCK, directory=str(tmp_path))
    sizing = Sizing("big host", 1.0, 100.0, 0.0)
    with pytest.raises(InvalidArgumentError, match=r"--replicas.*available"):
        replay_fleet(requests, ceiling(requests), sizing, options, replicas, None)
    assert list(tmp_path.iterdir()) == [tmp_path / "t.jsonl"]  # no store's directory left
    # one replica fits: the same sizes run
    run = replay_fleet(requests, ceiling(requests), sizing, options, 1, None)
    assert run.tokens == 512 and run.served["recomputed"] == 512


def test_one_store_whose_gpu_and_host_together_pass_memory_is_refused(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip(reason="the gpu tier is in device memory here, not in host memory")
    # gpu and host each about 0.6 of the memory available: each fits, the two do not
    blocks = math.ceil(0.6 * available_host_bytes() / BIG_BLOCK)
    ids = math.ceil(blocks / 100)  # a tier is at most 100 times the unique blocks
    if ids > 2048:
        pytest.skip(reason="this machine's memory needs a request longer than 2**20 tokens")
    requests = read_trace(write_trace(tmp_path / "t.jsonl", [list(range(ids))]))
    fraction = blocks / ids
    options = ReplayOptions(block_bytes=BIG_BLOCK, directory=str(tmp_path))
    with pytest.raises(InvalidArgumentError, match=r"--gpu / --host.*available"):
        replay(requests, ceiling(requests), Sizing("t", fraction, fraction, 0.0), options)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_routing_more_replicas_than_the_router_subscribes_is_refused_at_once(
    tmp_path: Path,
) -> None:
    trace = str(write_trace(tmp_path / "t.jsonl", [[0], [0, 1]]))
    argv = ["replay", trace, "--replicas", "400", "--route", "prefix", "--dir", str(tmp_path)]
    argv += ["--host", "0", "--disk", "0"]
    code = "import sys; from kvtier.program import run; sys.exit(run())"
    # before: 400 stores were built (a minute), then "the router could not subscribe"
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "kvtier: --replicas: got 400 with --route, expected 1 to 256 (the "
        "router subscribes to each replica's events)"
    ]
    assert "Traceback" not in done.stderr


def _brute(chains: list[list[int]], capacity: int, furthest: bool) -> int:
    """The leaf cache of `simulate.py`'s module doc, written out plainly: O(n^2) per victim."""
    parent: dict[int, int | None] = {}
    cached: set[int] = set()
    last: dict[int, int] = {}
    hits = 0

    def next_use(block: int, now: int) -> int:
        return next((j for j in range(now + 1, len(chains)) if block in chains[j]), 1 << 30)

    for now, chain in enumerate(chains):
        h = 0
        while h < len(chain) and chain[h] in cached:
            last[chain[h]] = now
            h += 1
        hits += h
        previous = chain[h - 1] if h else None
        for block in chain[h:]:
            while len(cached) >= capacity:
                leaves = [
                    b for b in cached if last[b] != now and not any(parent[c] == b for c in cached)
                ]
                if not leaves:
                    break
                if furthest:
                    victim = min(leaves, key=lambda b: (-next_use(b, now), last[b], b))
                else:
                    victim = min(leaves, key=lambda b: (last[b], b))
                cached.remove(victim)
            if len(cached) >= capacity:
                break
            parent[block] = previous
            cached.add(block)
            last[block] = now
            previous = block
    return hits


@st.composite
def _chained(draw: st.DrawFn) -> list[list[int]]:
    """Requests as paths in a random tree of ids: chained, as a trace's are."""
    children: dict[int | None, list[int]] = {}
    chains = []
    for _ in range(draw(st.integers(1, 10))):
        node: int | None = None
        chain = []
        for _ in range(draw(st.integers(1, 5))):
            kids = children.setdefault(node, [])
            if draw(st.booleans()) and kids:
                node = draw(st.sampled_from(kids))
            else:
                node = sum(len(k) for k in children.values())
                kids.append(node)
            chain.append(node)
        chains.append(chain)
    return chains


@settings(max_examples=300, deadline=None)
@given(_chained(), st.integers(1, 8))
def test_the_simulations_match_a_brute_force_cache(chains: list[list[int]], capacity: int) -> None:
    lru = simulate(chains, capacity, LRU()).hits
    furthest = simulate(chains, capacity, Furthest(chains)).hits
    assert lru == _brute(chains, capacity, furthest=False)
    assert furthest == _brute(chains, capacity, furthest=True)
    cache = LeafCache(capacity, LRU())
    for chain in chains:
        cache.request(chain)
        cache.check()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_runs_too_big_to_sit_side_by_side_still_run_in_parallel_mode(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip(reason="the gpu tier is in device memory here, not in host memory")
    # two gpu-only runs of some 0.6 of the memory available each: each fits alone, the two do
    # not, so `--jobs 2` runs them one at a time, with the figures of `--jobs 1`
    blocks = math.ceil(0.6 * available_host_bytes() / BIG_BLOCK)
    ids = math.ceil(blocks / 100)
    if ids > 2048:
        pytest.skip(reason="this machine's memory needs a request longer than 2**20 tokens")
    requests = read_trace(write_trace(tmp_path / "t.jsonl", [list(range(ids))] * 2))
    options = ReplayOptions(block_bytes=BIG_BLOCK, directory=str(tmp_path))
    work = Workload.of(requests, ceiling(requests), options)
    sizings = [Sizing(label, blocks / ids, 0.0, 0.0) for label in ("a", "b")]
    two, one = replay_all(work, sizings, 2), replay_all(work, sizings, 1)
    assert [r.served for r in two] == [r.served for r in one]
    assert all(r.served["gpu"] == ids * 512 for r in two)  # the second request hits
