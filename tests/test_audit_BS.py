"""Audit BS: trace replay against its LRU-of-leaves yardstick, and the replay options a fleet
run ignored.

- A gpu-only replay (inline mover) serves exactly what `simulate.LeafCache` with `LRU` serves
  under the store's placement: a request's new blocks are stored when room can be made for all
  of them beside its hit (every other block is an evictable leaf in time), else none of them
  (`writes.py`); random chained tree traces, prompts longer than the tier among them. The
  store's dropped tokens and the tokens recomputed after a drop are the model's too.
- `--speed` with `--replicas N` / `--route` was ignored without a word (a fleet keeps no clock:
  a trace of 2**62 ms at `--speed 1` ended at once): refused before the trace is read.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.replay import ReplayOptions, Sizing, ceiling, read_trace, replay
from kvtier.replay.simulate import LRU, LeafCache, chains

B = 512  # tokens per trace block


def write_trace(path: Path, hash_ids: list[list[int]], step_ms: int = 10) -> Path:
    lines = []
    for i, ids in enumerate(hash_ids):
        record = {"timestamp": step_ms * i, "input_length": len(ids) * B, "output_length": 1}
        lines.append(json.dumps({**record, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def tree_trace(rng: random.Random) -> list[list[int]]:
    """Requests that extend a random prefix of an earlier one by 0-9 new ids (chained)."""
    made: list[list[int]] = [[]]
    fresh = 0
    for _ in range(rng.randint(1, 20)):
        base = rng.choice(made)
        ids = base[: rng.randint(0, len(base))]
        for _ in range(rng.choice([0, 1, 1, 2, 3, 5, 9]) or (0 if ids else 1)):
            ids.append(fresh)
            fresh += 1
        made.append(ids)
    return made[1:]


def lru_model(keys: list[list[int]], capacity: int) -> tuple[int, int, int]:
    """(hit, dropped, recomputed after a drop) blocks of one LRU-of-leaves cache that stores a
    request's new blocks only where all of them fit beside its hit (module doc)."""
    cache, dropped = LeafCache(capacity, LRU()), set[int]()
    hits = drops = after = 0
    for chain in keys:
        hit = next((i for i, k in enumerate(chain) if k not in cache.children), len(chain))
        fits = len(chain) - hit <= capacity - hit
        assert cache.request(chain if fits else chain[:hit]) == hit
        hits += hit
        after += sum(k in dropped for k in chain[hit:])
        if fits:
            dropped.difference_update(chain[hit:])
        else:
            dropped.update(chain[hit:])
            drops += len(chain) - hit
        cache.check()
    return hits, drops, after


@pytest.mark.parametrize("block_tokens", [512, 128])
def test_a_gpu_only_replay_serves_exactly_lru_of_leaves_drops_included(
    tmp_path: Path, block_tokens: int
) -> None:
    rng = random.Random(block_tokens)
    options = ReplayOptions(block_bytes=2048, block_tokens=block_tokens)  # check(): each run
    longer = 0
    for case in range(40):
        requests = read_trace(write_trace(tmp_path / f"t{case}.jsonl", tree_trace(rng)))
        sizing = Sizing("g", rng.choice([0.05, 0.1, 0.3, 0.5, 0.8]), 0.0, 0.0)
        result = replay(requests, ceiling(requests), sizing, options)
        capacity = result.capacity_blocks["gpu"]
        keys = [list(c) for c in chains(requests, block_tokens)]
        longer += any(len(k) > capacity for k in keys)
        hits, drops, after = lru_model(keys, capacity)
        assert result.hit_tokens == hits * block_tokens, case
        assert result.dropped_tokens == drops * block_tokens, case
        assert result.recomputed_after_drop == after * block_tokens, case
        assert result.hit_tokens + result.missed_tokens + result.recomputed_after_drop == (
            result.tokens
        )
    assert longer >= 5  # prompts longer than the tier were among them


@pytest.mark.parametrize(
    ("fleet", "named"),
    [(["--replicas", "2"], "--replicas"), (["--replicas", "2", "--route", "prefix"], "--route")],
)
def test_speed_with_a_fleet_is_refused_not_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fleet: list[str], named: str
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[0], [0, 1]], step_ms=2**60)
    assert main(["replay", str(path), "--jobs", "1", "--speed", "1", *fleet]) == 2
    err = capsys.readouterr().err
    assert f"--speed with {named}" in err and "Traceback" not in err
