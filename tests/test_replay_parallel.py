"""`kvtier replay --jobs N` (`kvtier.replay.parallel`): the runs and simulations in worker
processes give the figures of one process, in the order the runs are defined; a failing task
stops the others."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.replay import ReplayOptions, ReplayResult, Sizing, ceiling, parallel, read_trace, replay
from kvtier.replay.parallel import Workload, replay_all, task_count

B = 512  # tokens per trace block
TIMED = ("wall_s", "lookup", "prefetch", "pacing")  # measured, not counted


def conversations(path: Path, chats: int = 8, turns: int = 5) -> Path:
    """`chats` conversations of `turns` turns, interleaved, behind a shared first block: turn
    t of chat c sends block 0, then 2 (t + 1) blocks of its own (ids chained, 81 unique)."""
    lines: list[str] = []
    for turn in range(turns):
        for chat in range(chats):
            ids = [0, *range(1000 * chat + 1, 1000 * chat + 2 * turn + 3)]
            record = {"timestamp": len(lines), "input_length": len(ids) * B, "output_length": 1}
            lines.append(json.dumps({**record, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def replayed(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["replay", *args, "--json", "--block-bytes", "2048"]) == 0
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return document


def counted(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run's figures less those measured in time."""
    return [{k: v for k, v in run.items() if k not in TIMED} for run in document["runs"]]


@pytest.mark.parametrize("mode", [[], ["--sweep"], ["--codec", "none,int4"]])
def test_two_jobs_give_the_figures_of_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    path = conversations(tmp_path / "t.jsonl")
    sizes = ["--gpu", "0.05", "--host", "0.1", "--disk", "0.5", "--dir", str(tmp_path)]
    one = replayed([str(path), *mode, *sizes, "--jobs", "1"], capsys)
    two = replayed([str(path), *mode, *sizes, "--jobs", "2"], capsys)
    assert (one["jobs"], two["jobs"]) == (1, 2)
    assert counted(one) == counted(two)  # served per tier, drops, bytes moved, yardsticks ...
    assert [r["sizing"]["label"] for r in two["runs"]] == [
        r["sizing"]["label"] for r in one["runs"]
    ]
    rest = {k: v for k, v in one.items() if k not in ("runs", "jobs")}
    assert rest == {k: v for k, v in two.items() if k not in ("runs", "jobs")}
    (tiered,) = [r for r in one["runs"] if r["sizing"]["label"] in ("tiered", "x1", "none")]
    assert tiered["served"]["disk"] > 0 and tiered["yardsticks"]["furthest"]["hits"] > 0
    assert list(tmp_path.iterdir()) == [path]  # every run's disk directory is gone


def test_the_runs_report_in_their_order_and_progress_counts_every_request(
    tmp_path: Path,
) -> None:
    requests = read_trace(conversations(tmp_path / "t.jsonl"))
    work = Workload.of(requests, ceiling(requests), ReplayOptions(block_bytes=2048))
    sizings = [Sizing("small", 0.02, 0.0, 0.0), Sizing("big", 0.1, 0.5, 1.0), Sizing("mid",
               0.05, 0.1, 0.0)]  # fmt: skip
    told: list[int] = []
    results = replay_all(work, sizings, 2, told.append)
    assert [r.sizing.label for r in results] == ["small", "big", "mid"]
    assert sum(told) == 3 * len(requests)
    assert task_count(work, sizings) == 3 + 3 * 2  # three capacities, two simulations each
    assert [r.yardsticks.lru.capacity for r in results if r.yardsticks] == [2, 129, 12]


def test_a_result_survives_its_dict_form(tmp_path: Path) -> None:
    requests = read_trace(conversations(tmp_path / "t.jsonl"))
    work = Workload.of(requests, ceiling(requests), ReplayOptions(block_bytes=2048, speed=1e6))
    (result,) = replay_all(work, [Sizing("t", 0.05, 0.1, 0.5)], 1)
    assert result.pacing is not None and result.yardsticks is not None
    assert ReplayResult.from_dict(result.to_dict()) == result
    bare = replay(requests, work.ceiling, Sizing("g", 0.05, 0.0, 0.0), ReplayOptions())
    assert ReplayResult.from_dict(bare.to_dict()) == bare


def test_a_failing_task_stops_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the tiered run would replay for 100 s; the gpu-only run fails at once with an error that
    # does not pickle as itself (ConfigError takes three arguments): the tiered run is stopped
    # at its next request and the error is the command's
    def fake(requests: Any, limit: Any, sizing: Sizing, options: Any,
             progress: Callable[[int], None]) -> ReplayResult:  # fmt: skip
        if sizing.label == "gpu-only":
            raise ConfigError("tiers.disk.capacity", 7, "what the disk holds")
        for _ in range(100_000):
            progress(1)
            time.sleep(0.001)
        raise AssertionError("not stopped")

    monkeypatch.setattr(parallel, "replay", fake)  # the forked workers inherit it
    path = conversations(tmp_path / "t.jsonl")
    started = time.perf_counter()
    assert main(["replay", str(path), "--jobs", "2", "--block-bytes", "2048"]) == 2
    assert time.perf_counter() - started < 30
    err = capsys.readouterr().err
    assert "kvtier: config field 'tiers.disk.capacity': got 7, expected what the disk" in err
    assert main(["replay", str(path), "--jobs", "0"]) == 2
    assert "--jobs: got 0, expected >= 1" in capsys.readouterr().err
