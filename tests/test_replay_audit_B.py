"""Audit B of `kvtier replay`'s figures: a paced run that overslept its sleep says it fell
behind, the routed runs' one big store has exactly N times a replica's slots (also past a
fraction of 100), a fleet counts the prefetches its gpu tier was too small for, and the routed
table shows "n/a" against a big store that hit nothing. Real stores, real signals, real
sockets; tiny traces of 2 KiB blocks (`test_replay.TINY`)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_replay import TINY, write_trace

from kvtier.cli import main
from kvtier.replay import ReplayOptions, Sizing, ceiling, format_result, read_trace, replay
from kvtier.replay.replicas import format_fleet, replay_fleet
from kvtier.replay.routed import replay_routed
from kvtier.replay.trace import TraceRequest

B = 512


@pytest.fixture
def hold_up() -> Iterator[Callable[[int], None]]:
    """A `progress` callback that, after the first request, arms a SIGALRM 0.1 s later whose
    handler holds the process up for 0.6 s (the main thread does nothing else meanwhile, as
    under a busy CPU)."""
    previous = signal.signal(signal.SIGALRM, lambda *_: time.sleep(0.6))
    armed: list[bool] = []

    def progress(_: int) -> None:
        if not armed:
            armed.append(True)
            signal.setitimer(signal.ITIMER_REAL, 0.1)

    try:
        yield progress
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_request_whose_sleep_ended_late_counts_as_late(hold_up: Callable[[int], None]) -> None:
    # request 2 is due 0.5 s after request 1; the replay sleeps for it, is held up from ~0.1 s
    # to ~0.7 s, and starts it ~0.2 s late. The lag was measured before the sleep: "kept its
    # clock", "the latest started 0 ms late".
    requests = [TraceRequest(0, B, 1, (0,)), TraceRequest(500, B, 1, (1,))]
    paced = ReplayOptions(block_bytes=2048, speed=1.0)
    result = replay(requests, ceiling(requests), Sizing("g", 2.0, 0.0, 0.0), paced, hold_up)
    pacing = result.pacing
    assert pacing is not None and pacing.fell_behind, pacing
    assert pacing.late == 1 and pacing.max_lag_s >= 0.15, pacing
    assert "FELL BEHIND its clock: 1 of 2 requests" in format_result(result)


# 4 blocks in a cycle, twice: a cache of 4 blocks hits the second round, one of 2 nothing
CYCLE = [[0], [1], [2], [3], [0], [1], [2], [3]]


def test_the_one_big_store_has_n_times_each_replicas_slots(tmp_path: Path) -> None:
    # gpu 0.1 of 4 unique blocks: a replica has 1 slot (at least one); 4 replicas have 4, and
    # round robin gives each replica its one block twice. The big store had round(0.4 * 4) = 2
    # slots and hit nothing: 1 store "x4 capacity" at 0 %, below the 4 replicas it measures.
    requests = read_trace(write_trace(tmp_path / "t.jsonl", CYCLE))
    sizing = Sizing("g", 0.1, 0.0, 0.0)
    big, rr = replay_routed(requests, ceiling(requests), sizing, TINY, 4, ["round-robin"])
    assert big.label == "1 store x4 capacity" and big.replicas == 1
    assert big.served["gpu"] == 4 * B  # the second round, from 4 slots
    assert rr.served["gpu"] == 4 * B and rr.assigned == (2, 2, 2, 2)


def test_a_big_store_past_a_fraction_of_100_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --gpu 60 with 2 replicas: the big store was sized as a fraction of 120 and refused
    # ("--gpu: got 120.0", a value nobody typed), after the trace was read
    trace = str(write_trace(tmp_path / "t.jsonl", CYCLE))
    args = ["replay", trace, "--replicas", "2", "--gpu", "60", "--host", "0", "--disk", "0"]
    assert main([*args, "--block-bytes", "2048", "--route", "round-robin", "--json"]) == 0
    big, rr = json.loads(capsys.readouterr().out)["replicas"]["2"]
    assert big["label"] == "1 store x2 capacity" and big["served"]["gpu"] == 4 * B
    assert rr["served"]["recomputed"] == 4 * B  # each replica: 2 blocks, twice each


def test_a_fleet_counts_the_prefetches_its_gpu_is_too_small_for(tmp_path: Path) -> None:
    # gpu 1 slot, host 3: the second request hits 3 blocks, 2 of them below gpu, and its
    # prefetch (3 gpu blocks) is refused; the fleet said nothing of it
    requests = read_trace(write_trace(tmp_path / "t.jsonl", [[0, 1, 2], [0, 1, 2]]))
    run = replay_fleet(requests, ceiling(requests), Sizing("t", 1 / 3, 1.0, 0.0), TINY, 1, None)
    assert run.hit_tokens == 3 * B and run.served["gpu"] < 3 * B
    assert run.prefetch_refused == 1 and run.to_dict()["prefetch_refused"] == 1
    assert "1 prefetches refused (gpu too small" in format_fleet([run])


def test_the_routed_table_has_no_ratio_to_a_big_store_that_hit_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2 replicas of 1 gpu slot, round robin: replica 0 gets [0] three times (2 hits), replica 1
    # pairs it cannot hold. The store of 2 slots sees the pairs between the [0]s, each evicting
    # it: it hits nothing, and the replicas' ratio to it was printed 1.000
    trace = str(write_trace(tmp_path / "t.jsonl", [[0], [1, 2], [0], [3, 4], [0], [5, 6]]))
    args = ["replay", trace, "--replicas", "2", "--gpu", "0.1", "--host", "0", "--disk", "0"]
    assert main([*args, "--block-bytes", "2048", "--route", "round-robin"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("1 store x2 capacity") and " 0.0% " in lines[2], lines
    assert lines[3].startswith("2 replicas, round-robin") and "n/a" in lines[3], lines
