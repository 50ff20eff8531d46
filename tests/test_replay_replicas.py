"""`kvtier replay --replicas N --remote` (`kvtier/replay/replicas.py`) on a hand-counted trace:
a round-robin router scatters requests over two stores, which then recompute what the other
holds, unless they share a remote tier (a real Redis Cluster started by the replay).

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis_cluster import require_redis
from test_replay import SHARED, TINY, write_trace

from kvtier.cli import main
from kvtier.replay.replicas import cluster_nodes, replay_fleet
from kvtier.replay.report import Sizing
from kvtier.replay.trace import ceiling, read_trace

B = 512


def test_two_replicas_recompute_what_the_other_holds_unless_they_share(tmp_path: Path) -> None:
    require_redis()
    # replica 0 gets requests 1 and 3, replica 1 requests 2 and 4 (module doc of test_replay:
    # the ceiling is 6 of 12 block references)
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    limit = ceiling(requests)
    sizing = Sizing("big", 1.0, 1.0, 0.0)
    alone = replay_fleet(requests, limit, sizing, TINY, 2, None)
    # alone: r2 finds nothing on replica 1, r3 block 0 on replica 0, r4 blocks 0, 1 (its own r2)
    assert alone.served["recomputed"] == (12 - 3) * B and alone.ratio == 0.5
    with cluster_nodes(None) as nodes:
        shared = replay_fleet(requests, limit, sizing, TINY, 2, nodes)
    # shared: r2 takes 0, 1 from the cluster; r4 takes block 2 (stored by replica 0) from it
    assert shared.served["remote"] == 3 * B and shared.ratio == 1.0
    assert shared.remote is not None and shared.remote["filled_blocks"] == 3
    assert shared.remote["errors"] == 0


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_the_command_prints_both_runs_and_the_gain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_redis()
    trace = write_trace(tmp_path / "t.jsonl", SHARED)
    args = ["replay", str(trace), "--replicas", "2", "--remote", "--gpu", "1", "--host", "1"]
    assert main([*args, "--disk", "0", "--block-bytes", "2048"]) == 0
    out = capsys.readouterr().out
    assert "2 replicas, alone: hit rate 25.0%" in out
    assert "2 replicas, shared remote: hit rate 50.0%" in out
    assert "gain from the shared remote tier: +25.0% of tokens (0.500 -> 1.000" in out
    assert main([*args, "--disk", "0", "--block-bytes", "2048", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [run["ratio_to_ceiling"] for run in runs] == [0.5, 1.0]


def test_a_fleet_of_no_replicas_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", SHARED)
    assert main(["replay", str(trace), "--replicas", "0"]) == 2
    assert "--replicas: got 0, expected 1 to 1024" in capsys.readouterr().err
