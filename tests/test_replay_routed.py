"""`kvtier replay --replicas N --route ...` (`kvtier/replay/routed.py`) on a hand-counted trace:
real stores publish real KV events on loopback, a subscriber feeds the prefix index, and the
router places each request by what the stores told it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_replay import SHARED, TINY, write_trace

from kvtier.cli import main
from kvtier.replay.replicas import replay_fleet
from kvtier.replay.report import Sizing
from kvtier.replay.routed import replay_routed
from kvtier.replay.runner import ReplayOptions
from kvtier.replay.trace import ceiling, read_trace

B = 512
BIG = Sizing("big", 1.0, 1.0, 0.0)


def test_prefix_routing_keeps_what_round_robin_scatters(tmp_path: Path) -> None:
    # SHARED: [0 1 2] [0 1 3] [0 4] [0 1 2 5]; the ceiling is 6 of 12 block references
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    limit = ceiling(requests)
    big, rr, prefix, balanced = replay_routed(
        requests, limit, BIG, TINY, 2, ["round-robin", "prefix", "prefix-load"]
    )
    assert big.replicas == 1 and big.ratio == 1.0
    # round robin: r2 and r4 on replica 1, which holds only r2's blocks when r4 comes
    assert rr.assigned == (2, 2) and rr.served["recomputed"] == (12 - 3) * B
    # prefix: every request shares block 0 with replica 0, so all go there: all hits, one hot
    assert prefix.assigned == (4, 0) and prefix.ratio == 1.0 and prefix.imbalance == 2.0
    # prefix-load: r1 -> 0; r2 -> 1 (0 is past the bound); r3 -> 0 (a tie: block 0 on both);
    # r4 -> 1 (0 is past the bound), which holds blocks 0, 1 of it: 0 + 1 + 2 hits
    assert balanced.assigned == (2, 2) and balanced.served["recomputed"] == (12 - 3) * B
    # the events-free round robin of `--replicas` gives the same figures as the routed one
    plain = replay_fleet(requests, limit, BIG, TINY, 2, None)
    assert plain.served == rr.served


def test_the_command_prints_the_table_and_refuses_a_policy_it_does_not_know(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(write_trace(tmp_path / "t.jsonl", SHARED))
    args = ["replay", trace, "--replicas", "2", "--gpu", "1", "--host", "1", "--disk", "0"]
    args += ["--block-bytes", "2048"]
    assert main([*args, "--route", "round-robin,prefix"]) == 0
    out = capsys.readouterr().out
    assert "1 store x2 capacity             50.0%      1.000" in out
    assert "2 replicas, round-robin         25.0%      0.500" in out
    assert "2 replicas, prefix              50.0%      1.000" in out and "4 / 0" in out
    assert main([*args, "--route", "prefix", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["replicas"]["2"]
    assert [run["policy"] for run in runs] == [None, "prefix"]
    assert runs[1]["assigned"] == [4, 0] and runs[1]["imbalance"] == 2.0
    assert main([*args, "--route", "prefix,random"]) == 2
    err = capsys.readouterr().err
    assert "--route: got 'prefix,random', expected a comma-separated list" in err


def test_replicas_whose_prompts_go_down_to_disk_tell_their_router_of_no_orphan(
    tmp_path: Path,
) -> None:
    """Long prompts, few shared, on small tiers: the replicas' mover writes each node's tail
    to disk in flights while host copies go a block at a time from the end, and the router
    must see every BlockStored after its parent (`tests/test_events_order.py`). The run's own
    router check (`FleetRouter.check`) fails it on any event skipped, orphans included; before
    the observer's fix this trace gave 4 to 6 orphans."""
    rng = random.Random(1)
    ids: list[list[int]] = []
    fresh = 0
    for _ in range(100):
        head = [] if not ids or rng.random() >= 0.3 else rng.choice(ids)
        prompt = list(head[: rng.randint(1, len(head))]) if head else []
        count = rng.randint(10, 60)
        ids.append(prompt + list(range(fresh, fresh + count)))
        fresh += count
    requests = read_trace(write_trace(tmp_path / "t.jsonl", ids))
    options = ReplayOptions(block_tokens=128, block_bytes=2048)
    run = replay_fleet(requests, ceiling(requests), Sizing("s", 0.01, 0.1, 1.0), options, 2, None,
                       "prefix")  # fmt: skip
    assert run.served["disk"] > 0 and run.served["host"] > 0  # the tails went down and came back
