"""The command line against audit K's findings: `kvtier replay --dir` on a directory where
nothing can be made, a trace that is a FIFO, a store/LRU ratio whose LRU hit nothing, a
store/LRU comparison of a run that dropped blocks on store, `--plot ""` and a plot written over
a planted link, the fleet line of a run that hit nothing, `kvtier validate` of several files,
and the disk's "x the blocks" of a quantized disk (its slots, not its payloads).

Each bad input is one typed line and exit 2, never a traceback or a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest
from conftest import mounted_tmpfs
from test_cli_audit_k import trace_file

from kvtier.cli import main


def write_trace(path: Path, hash_ids: list[list[int]]) -> Path:
    return Path(trace_file(path, hash_ids))


def good_trace(path: Path) -> Path:
    return write_trace(path, [[0, 1], [0, 2], [0, 3]])


def one_error_line(err: str, *named: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: "), err[-2000:]
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


# ---- finding 1: --dir where no temporary directory can be made ---------------------------


def test_replay_dir_on_proc_is_one_typed_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/proc exists and is a directory, but nothing can be made in it."""
    path = good_trace(tmp_path / "t.jsonl")
    assert main(["replay", str(path), "--no-baseline", "--dir", "/proc"]) == 2
    captured = capsys.readouterr()
    one_error_line(captured.err, "'/proc'", "--dir", "temporary directory")
    assert captured.out == ""


def test_replay_dir_on_a_read_only_mount_is_one_typed_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only tmpfs (root ignores permission bits, not a read-only mount)."""
    path = good_trace(tmp_path / "t.jsonl")
    with mounted_tmpfs(tmp_path / "ro", "64k") as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=30)
        assert main(["replay", str(path), "--no-baseline", "--dir", str(mount)]) == 2
        captured = capsys.readouterr()
        one_error_line(captured.err, str(mount), "--dir", "Read-only")
        assert os.listdir(mount) == []


# ---- finding 4: a FIFO as the trace ----------------------------------------------------------


FIFO_WAIT = (
    "import sys, kvtier.replay.trace as t; t.FIFO_WAIT_S = 0.3; from kvtier.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


def test_a_fifo_trace_with_no_writer_is_refused_after_its_wait(tmp_path: Path) -> None:
    """A FIFO with no writer: the old code blocked in open() forever; now it waits
    `FIFO_WAIT_S` (0.3 s here) for a first byte, then refuses naming the wait."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    command = [sys.executable, "-c", FIFO_WAIT, "replay", str(fifo), "--jobs", "1"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("kvtier replay on a FIFO with no writer still waited after 15 s")
    assert done.returncode == 2
    one_error_line(done.stderr, str(fifo), "a FIFO", "sent nothing in 0.3 s")


def test_a_piped_trace_is_read(tmp_path: Path) -> None:
    """`zcat trace.gz | kvtier replay /dev/stdin` (and `<(...)`): a pipe is read to its end."""
    text = good_trace(tmp_path / "t.jsonl").read_text()
    command = [sys.executable, "-c", FIFO_WAIT, "replay", "/dev/stdin", "--no-baseline"]
    done = subprocess.run(
        [*command, "--jobs", "1", "--json"], input=text, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ceiling"]["requests"] == len(text.splitlines())


# ---- findings 2 and 3: store/LRU when LRU hit nothing, and a run that dropped on store --------


def test_store_over_lru_is_undefined_when_the_simulation_hit_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """3 gpu blocks: the store drops the 4- and 5-block requests whole (keeping [0, 1, 2]), the
    simulation caches their leading blocks and so never hits; the store hits 24 %."""
    ids = [[0, 1, 2], [3, 4, 5, 6], [0, 1, 2], [7, 8, 9, 10, 11], [0, 1, 2, 12, 13], [14, 15, 16]]
    path = write_trace(tmp_path / "t.jsonl", [*ids, [7, 8]])
    sizes = ["--gpu", "0.2", "--host", "0", "--disk", "0", "--no-baseline", "--jobs", "1"]
    assert main(["replay", str(path), *sizes, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["yardsticks"]["lru"]["hits"] == 0 and run["hit_rate"] > 0.2
    assert run["ratio_to_lru"] is None
    assert main(["replay", str(path), *sizes]) == 0
    out = capsys.readouterr().out
    assert "(store/LRU n/a)" in out
    assert "not like for like" in out  # it dropped on store: the simulations did not


def test_a_gpu_only_run_that_dropped_a_long_request_says_it_is_not_like_lru(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four 5-block requests sharing a block, gpu of 2 blocks: the store drops every request
    whole (0 %), LRU of leaves keeps the shared leading block (20 %)."""
    path = write_trace(
        tmp_path / "t.jsonl",
        [[0, 1, 2, 3, 4], [0, 1, 5, 6, 7], [0, 8, 9, 10, 11], [0, 12, 13, 14, 15]],
    )
    args = ["--gpu", "0.1", "--host", "0", "--disk", "0", "--no-baseline", "--jobs", "1"]
    assert main(["replay", str(path), *args]) == 0
    out = capsys.readouterr().out
    assert "LRU of leaves 20.0% (store/LRU 0.000)" in out
    assert "not like for like" in out


# ---- finding 6: --plot "", the plot's write, the fleet line ----------------------------------


def test_an_empty_plot_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = good_trace(tmp_path / "t.jsonl")
    assert main(["replay", str(path), "--no-baseline", "--jobs", "1", "--plot", ""]) == 2
    captured = capsys.readouterr()
    one_error_line(captured.err, "--plot: got ''")
    assert captured.out == ""


class _Figure:
    """Stands in for a matplotlib figure (not installed here): `savefig` to a file object."""

    def __init__(self) -> None:
        self.formats: list[str] = []

    def savefig(self, file: IO[bytes], format: str, dpi: int) -> None:
        self.formats.append(format)
        file.write(b"image bytes")


def test_a_plot_replaces_a_planted_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not yours")
    target = tmp_path / "out.png"
    target.symlink_to(victim)
    from kvtier.replay.figures import save_figure  # here: the old code has none

    figure = _Figure()
    save_figure(figure, str(target))
    assert victim.read_bytes() == b"not yours"
    assert not target.is_symlink() and target.read_bytes() == b"image bytes"
    assert figure.formats == ["png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png", "victim.txt"]


def test_a_plot_gets_a_new_files_mode_and_a_failed_write_is_typed(tmp_path: Path) -> None:
    """The image is 0666 less the umask (a plot is shared, not secret), and a write the system
    refuses is an `InvalidArgumentError` naming --plot with no temporary file left."""
    from kvtier.errors import InvalidArgumentError
    from kvtier.replay.figures import save_figure

    target = tmp_path / "out.png"
    old = os.umask(0o022)
    try:
        save_figure(_Figure(), str(target))
    finally:
        os.umask(old)
    assert target.stat().st_mode & 0o777 == 0o644
    missing = tmp_path / "gone" / "out.png"  # a directory removed after the checks
    with pytest.raises(InvalidArgumentError, match="--plot"):
        save_figure(_Figure(), str(missing))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png"]


def test_another_users_plot_in_a_sticky_directory_is_refused_before_the_run(
    tmp_path: Path,
) -> None:
    """Its rename would be refused at the end (EPERM), after the whole replay."""
    from kvtier.errors import InvalidArgumentError
    from kvtier.replay.checks import check_plot

    sticky = tmp_path / "shared"
    sticky.mkdir()
    sticky.chmod(0o1777)
    theirs = sticky / "out.png"
    theirs.write_bytes(b"theirs")
    os.chown(theirs, os.geteuid() + 1000, -1)
    with pytest.raises(InvalidArgumentError, match="sticky"):
        check_plot(str(theirs), [None])
    check_plot(str(sticky / "mine.png"), [None])  # a new file there is fine


def test_a_fleet_that_hit_nothing_prints_no_empty_parentheses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[0], [1], [2]])
    assert main(["replay", str(path), "--replicas", "3", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "hit rate 0.0%, " in out and "()" not in out


# ---- finding 5: validate checks every file ---------------------------------------------------

GOOD_CONFIG = "tiers: {gpu: {capacity: 16MiB, device: cpu}, host: {capacity: 16MiB}}\n"
BAD_CONFIG = "tiers: {gpu: {capacity: .nan, device: cpu}, host: {capacity: 16MiB}}\n"


def test_validate_checks_every_file_and_exits_2_if_any_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.yaml").write_text(GOOD_CONFIG)
    (tmp_path / "b.yaml").write_text(BAD_CONFIG)
    (tmp_path / "c.yaml").write_text(GOOD_CONFIG)
    files = [str(tmp_path / n) for n in ("a.yaml", "b.yaml", "c.yaml")]
    assert main(["validate", *files]) == 2
    captured = capsys.readouterr()
    ok = captured.out.strip().splitlines()
    assert [line.split(":")[0] for line in ok] == [files[0], files[2]]
    one_error_line(captured.err, files[1], "tiers.gpu.capacity")
    assert main(["validate", files[0], files[2]]) == 0


# ---- finding 7: a quantized disk's blocks are counted in slots -------------------------------


@pytest.mark.parametrize(("codec", "ratio"), [("int8", "1.25x"), ("int4", "1.67x")])
def test_validate_counts_a_quantized_disk_in_slots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], codec: str, ratio: str
) -> None:
    """1 MiB of 16 KiB blocks: 51 slots raw, 64 in int8, 85 in int4 (a slot is a header region
    and the payload, 4 KiB-aligned): not the payloads' 1.95x / 3.51x."""
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 64, dtype: float16}\n"
        "block_tokens: 16\n"
        "tiers:\n"
        "  gpu: {capacity: 64KiB, device: cpu}\n"
        "  host: {capacity: 64KiB, pinned: false, codec: int4, codec_keys: channel}\n"
        f"  disk: {{capacity: 1MiB, path: {tmp_path / 'disk'}, codec: {codec}}}\n"
    )
    assert main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"disk 1MiB in i{codec[3]}" in out and f", {ratio} the blocks)" in out
    assert "host 64KiB in i4kcv40, 3.24x the blocks" in out  # a host slot is the payload
