"""Audit AG of `kvtier replay`: the memory a trace costs while read, and a replay that is
killed (SIGTERM to it, SIGKILL to the parent of its workers) leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from kvtier.errors import TraceError
from kvtier.replay.trace import Renumber, TraceRequest, read_trace

REPO = Path(__file__).resolve().parent.parent


def _line(timestamp: int, ids: list[int], block_tokens: int = 512) -> str:
    record = {"timestamp": timestamp, "input_length": len(ids) * block_tokens,
              "output_length": 1, "hash_ids": ids}  # fmt: skip
    return json.dumps(record) + "\n"


def _peak(path: Path, block_tokens: int = 512) -> tuple[int, list[TraceRequest]]:
    tracemalloc.start()
    try:
        requests = read_trace(path, block_tokens=block_tokens)
        return tracemalloc.get_traced_memory()[1], list(requests)
    finally:
        tracemalloc.stop()


def test_repeated_ids_cost_a_pointer_each_not_an_int(tmp_path: Path) -> None:
    """A Mooncake trace keeps its ids (numbered as they first appear); every reference to an id
    used to hold an int of its own (8.4x the file's bytes in memory), now the id's one int."""
    path = tmp_path / "repeated.jsonl"
    ids = list(range(2048))  # one long conversation asked again and again
    path.write_text("".join(_line(t, ids) for t in range(60)))
    peak, requests = _peak(path)
    first, last = requests[0].hash_ids, requests[-1].hash_ids
    assert peak < 4 * path.stat().st_size, (peak, path.stat().st_size)
    assert first == last == tuple(ids)
    assert all(a is b for a, b in zip(first, last, strict=True))


def test_distinct_ids_are_bounded_and_cheap(tmp_path: Path) -> None:
    """Each distinct id costs a few array slots to check the chaining, not a dict entry of
    tuples (the old ~250 bytes an id made a 1 GB trace of small ids need ~27 GB); and a trace
    holds at most MAX_DISTINCT_IDS of them whatever its ids' tokens (2**28 at 16 before)."""
    path = tmp_path / "distinct.jsonl"
    per, lines = 1000, 200
    path.write_text(
        "".join(_line(t, list(range(t * per, (t + 1) * per)), 16) for t in range(lines))
    )
    peak, requests = _peak(path, 16)
    assert len(requests) == lines
    assert peak / (per * lines) < 175, peak / (per * lines)
    unchained = tmp_path / "unchained.jsonl"  # the check on numbers still names ids as given
    unchained.write_text(_line(0, [10**15, 7]) + _line(1, [5, 7]))
    with pytest.raises(TraceError, match=r":2: hash_ids\[1\]: id 7 comes after id 5 here, "
                       r"but came after id 1000000000000000 on line 1"):  # fmt: skip
        read_trace(unchained)
    from kvtier.replay.trace import MAX_DISTINCT_IDS  # new with the bound

    assert Renumber(16).most == MAX_DISTINCT_IDS == 2**24
    assert Renumber(512).most == 2**23  # Mooncake's: its tokens' bound comes first


def _replay(trace: Path, directory: Path, jobs: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = "import sys; from kvtier.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "replay", str(trace), "--jobs", str(jobs),
            "--dir", str(directory), "--host", "0.2", "--disk", "1.0"]  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _long_trace(tmp_path: Path) -> Path:
    path = tmp_path / "long.jsonl"
    # a shared first id, then 3 of each request's own: a replay of some seconds
    path.write_text("".join(_line(t, [0, *range(1 + 3 * t, 4 + 3 * t)]) for t in range(20000)))
    return path


def _wait_for_store(directory: Path, process: subprocess.Popen[bytes], count: int) -> None:
    deadline = time.monotonic() + 60
    while len(list(directory.iterdir())) < count:
        assert process.poll() is None, process.stderr.read() if process.stderr else b""
        assert time.monotonic() < deadline, "no store started"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_sigterm_removes_the_stores_directory(tmp_path: Path) -> None:
    """SIGTERM (`timeout`, `kill`) used to end the replay by its default action, leaving its
    disk tier's temporary directory (hundreds of MB on the conversation trace) in --dir."""
    directory = tmp_path / "dir"
    directory.mkdir()
    process = _replay(_long_trace(tmp_path), directory, 1)
    try:
        _wait_for_store(directory, process, 1)
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    assert list(directory.iterdir()) == []


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_workers_of_a_killed_replay_stop_and_clean_up(tmp_path: Path) -> None:
    """SIGKILL to `--jobs 2`'s parent used to leave its forked workers replaying on, then
    waiting forever on a task queue nobody writes; now they stop at their next request,
    remove their stores' directories and exit."""
    directory = tmp_path / "dir"
    directory.mkdir()
    process = _replay(_long_trace(tmp_path), directory, 2)
    workers: list[int] = []
    try:
        _wait_for_store(directory, process, 2)
        workers = _children(process.pid)
        assert workers
        process.kill()
        process.wait()
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers)
        assert list(directory.iterdir()) == []
    finally:
        process.kill()
        process.wait()
        for worker in workers:
            if _alive(worker):
                os.kill(worker, signal.SIGKILL)
