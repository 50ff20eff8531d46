"""Hostile input at the command line: trace files for `kvtier replay`, config files, and option
values. Each bad one is a typed error naming where it is and what was expected; the command
exits 2 with one line, never a traceback, a hang or an allocation a number in the file asks for.

A few probes run the real command in a process (a hang there is a timeout, a traceback is on
stderr); the rest call `kvtier.cli.main` in this process, where a traceback is an exception."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mounted_tmpfs

from kvtier.cli import main
from kvtier.config import load_config, parse_config, parse_size
from kvtier.errors import ConfigError, InvalidArgumentError, TraceError
from kvtier.replay import ReplayOptions, read_trace

GOOD = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}
SMALL_TIERS = "tiers: {gpu: {capacity: 16MiB, device: cpu}, host: {capacity: 16MiB}}\n"


def trace(path: Path, *lines: str) -> Path:
    """A trace of one good request, then `lines` as given."""
    path.write_text("\n".join([json.dumps(GOOD), *lines]) + "\n")
    return path


def line(**fields: object) -> str:
    return json.dumps({**GOOD, **fields})


def run(
    *args: str, cwd: Path | None = None, timeout: float = 20
) -> subprocess.CompletedProcess[str]:
    """`kvtier ARGS` in a process; a run past `timeout` fails the test (a hang)."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvtier.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvtier {' '.join(args)[:200]} still ran after {timeout} s")


def refused(done: subprocess.CompletedProcess[str], *named: str) -> str:
    """The one line of a command refused with status 2, checked to name each of `named`."""
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: "), done.stderr[-2000:]
    for text in named:
        assert text in lines[0]
    return lines[0]


# ---- trace files ---------------------------------------------------------------------------


def test_a_trace_line_nested_too_deeply_is_one_line_from_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = trace(tmp_path / "t.jsonl", "[" * 100_000)
    assert main(["replay", str(path)]) == 2
    assert "t.jsonl:2: not a request: JSON nested too deeply" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["timestamp", "input_length", "output_length"])
@pytest.mark.parametrize("digits", [401, 5001])  # 5001: past Python's int-from-text limit
def test_an_integer_of_hundreds_of_digits_is_a_trace_error(
    tmp_path: Path, field: str, digits: int
) -> None:
    number = "1" + "0" * (digits - 1)
    text = line(**{field: 0}).replace(f'"{field}": 0', f'"{field}": {number}')
    expected = rf"{field}: got an integer of 1329 bits, expected an integer in \[0, 2\*\*63\)"
    if digits > 4300:  # past what Python's int() takes from text: json refuses it
        expected = "not a request: Exceeds the limit"
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: {expected}") as info:
        read_trace(trace(tmp_path / "t.jsonl", text))
    assert info.value.line == 2


def test_a_key_given_twice_in_a_record_is_refused_not_last_wins(tmp_path: Path) -> None:
    text = line().replace('"timestamp": 0', '"timestamp": 0, "timestamp": 99')
    with pytest.raises(TraceError, match=r"t\.jsonl:2: not a request: key 'timestamp' given twice"):
        read_trace(trace(tmp_path / "t.jsonl", text))


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes((json.dumps(GOOD) + "\n").encode() * 2 + b'{"timestamp": \xff\xfe}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:3: not UTF-8") as info:
        read_trace(path)
    assert info.value.line == 3


def test_a_line_longer_than_any_request_is_refused_unread(tmp_path: Path) -> None:
    path = trace(tmp_path / "t.jsonl", " " * (2 * 2**20) + json.dumps(GOOD))
    with pytest.raises(TraceError, match=r"t\.jsonl:2: longer than 1048576 bytes"):
        read_trace(path)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (line(timestamp=float("nan")), "timestamp: got nan"),
        (line(timestamp=float("inf")), "timestamp: got inf"),
        (line(timestamp="5"), "timestamp: got '5'"),
        (line(input_length=True), "input_length: got True"),
        (line(output_length=None), "output_length: got None"),
        (line(input_length=5.0), "input_length: got 5.0"),
        (line(hash_ids=[1.0]), r"hash_ids\[0\]: got 1.0"),
        (line(hash_ids=[True]), r"hash_ids\[0\]: got True"),
        (line(hash_ids=[[1]]), r"hash_ids\[0\]: got \[1\]"),
        (line(hash_ids={"0": 1}), "hash_ids: got {'0': 1}"),
        (line(input_length=10**15), "hash_ids: got 1 ids for input_length 1000000000000000"),
    ],
)
def test_a_field_of_the_wrong_type_is_named_exactly(
    tmp_path: Path, text: str, problem: str
) -> None:
    """Correct already: exact types (a bool is not an int, 1.0 is not an id); NaN and inf,
    which Python's JSON reads, are refused as timestamps."""
    with pytest.raises(TraceError, match=f"t.jsonl:2: {problem}"):
        read_trace(trace(tmp_path / "t.jsonl", text))


def test_a_directory_or_a_truncated_last_line_is_one_line_from_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Correct already."""
    assert main(["replay", str(tmp_path)]) == 2
    assert "cannot be read" in capsys.readouterr().err
    path = trace(tmp_path / "t.jsonl", line(timestamp=1)[:-9])
    assert main(["replay", str(path)]) == 2
    assert "t.jsonl:2: not JSON" in capsys.readouterr().err


# ---- replay options ------------------------------------------------------------------------


def test_a_paced_schedule_no_sleep_can_keep_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = trace(tmp_path / "t.jsonl", line(timestamp=1))
    assert main(["replay", str(path), "--speed", "1e-300", "--block-bytes", "2048"]) == 2
    err = capsys.readouterr().err
    assert "speed: got 1e-300" in err and "within 604800 s" in err


def test_a_gap_of_ages_in_a_paced_trace_is_refused_not_slept(tmp_path: Path) -> None:
    path = trace(tmp_path / "t.jsonl", line(timestamp=10**15))
    done = run("replay", str(path), "--speed", "1", "--block-bytes", "2048", "--jobs", "1")
    refused(done, "speed: got 1.0", "1000000000000000 ms")


def test_a_missing_dir_for_the_disk_tier_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = trace(tmp_path / "t.jsonl")
    for where in (tmp_path / "absent", path):
        assert main(["replay", str(path), "--dir", str(where), "--jobs", "1"]) == 2
        assert f"directory: got {str(where)!r}, expected an existing directory" in (
            capsys.readouterr().err
        )


def test_block_bytes_past_a_real_models_block_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = trace(tmp_path / "t.jsonl")
    assert main(["replay", str(path), "--block-bytes", str(2**40), "--jobs", "1"]) == 2
    assert f"block_bytes: got {2**40}" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="up to 67108864"):
        ReplayOptions(block_bytes=64 * 2**20 + 2048)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_replicas_past_the_bound_are_refused_before_any_store_is_built(tmp_path: Path) -> None:
    path = trace(tmp_path / "t.jsonl")
    refused(run("replay", str(path), "--replicas", "1000000"), "--replicas: got 1000000")


@pytest.mark.parametrize(
    ("plot", "problem"),
    [
        ("absent/out.png", "a file in an existing directory"),
        ("out.exe", "a file ending in .png, .pdf, .svg"),
        ("t.jsonl.png/", "a file, not a directory"),
        ("t.png", "a file other than the command's trace and config"),
    ],
)
def test_a_plot_path_is_checked_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], plot: str, problem: str
) -> None:
    path = trace(tmp_path / "t.png")  # a trace named like an image: --plot must not overwrite it
    (tmp_path / "t.jsonl.png").mkdir()
    before = path.read_bytes()
    target = str(tmp_path / plot)
    assert main(["replay", str(path), "--plot", target, "--jobs", "1"]) == 2
    assert f"--plot: got {target!r}, expected {problem}" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_a_plot_where_kvtier_may_not_write_is_refused_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found out before the replay, not after minutes of it (a read-only tmpfs: root ignores
    permission bits, not a read-only mount)."""
    path = trace(tmp_path / "t.jsonl")
    with mounted_tmpfs(tmp_path / "ro", "64k") as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=30)
        target = str(mount / "out.png")
        assert main(["replay", str(path), "--plot", target, "--jobs", "1"]) == 2
        captured = capsys.readouterr()
        assert f"--plot: got {target!r}, expected a file kvtier may write" in captured.err
        assert captured.out == ""  # no replay ran


# ---- config files --------------------------------------------------------------------------


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


def test_an_alias_bomb_is_refused_not_expanded(tmp_path: Path) -> None:
    items = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = config(tmp_path, "block_tokens: [" + ", ".join(items) + "]\n")
    message = refused(run("validate", str(path)), "<top level>", "at most 100000 values")
    assert len(message) < 300


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        ("policy: {write: [write_back]}", "policy.write", ["write_back"]),
        ("model: {name: m, num_layers: 1, num_kv_heads: 1, head_dim: 8, dtype: {}}",
         "model.dtype", {}),
        ("service: {shared_memory: [true]}", "service.shared_memory", [True]),
    ],
)  # fmt: skip
def test_a_list_or_mapping_where_a_choice_goes_is_a_config_error(
    tmp_path: Path, text: str, field: str, value: object
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config(tmp_path, text + "\n"))
    assert (info.value.field, info.value.value) == (field, value)


@pytest.mark.parametrize(
    "text",
    [
        "block_tokens: " + "[" * 100_000,  # nested past the YAML reader's recursion
        "block_tokens: 1" + "0" * 5000,  # past Python's int-from-text limit
        "block_tokens: 2020-13-45",  # a date with a 13th month
        'block_tokens: !!float "x"',
        "{[a]: 1}",  # a key that is a list
        "? [a]\n: 1",
    ],
)
def test_yaml_python_cannot_convert_is_a_yaml_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config(tmp_path, text + "\n"))
    assert info.value.field == "<yaml>"
    assert len(str(info.value)) < 400


def test_merge_keys_read_and_a_repeated_key_beside_them_is_still_refused(tmp_path: Path) -> None:
    text = (
        "tiers:\n"
        "  gpu: &memory {capacity: 16MiB, high_watermark: 0.9, low_watermark: 0.5}\n"
        "  host: {<<: *memory, capacity: 32MiB}\n"
    )
    host = load_config(config(tmp_path, text)).tiers.host
    assert host is not None
    assert (str(host.capacity), host.high_watermark, host.low_watermark) == ("32MiB", 0.9, 0.5)
    with pytest.raises(ConfigError, match="a key repeated in one mapping"):
        load_config(config(tmp_path, text.replace("capacity: 32MiB", "capacity: 1, capacity: 2")))


def test_a_config_file_too_long_to_be_one_is_not_read_whole(tmp_path: Path) -> None:
    path = config(tmp_path, "# " + "x" * 2**20 + "\nblock_tokens: 16\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.field, info.value.value) == ("<file>", str(path))
    assert "at most 1048576 characters" in str(info.value)


@pytest.mark.parametrize(
    "size",
    ["1" * 5000, "1" * 30 + "PiB", "1025PiB", 2**60 + 1, "٨GiB", "８GiB", "1.5.3GiB", "1e30"],
)
def test_sizes_past_any_machine_or_in_other_digits_are_refused(size: str | int) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(size)
    assert info.value.value == size
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": {"host": {"capacity": size}}})
    assert info.value.field == "tiers.host.capacity"


def test_a_capacity_larger_than_the_machine_stops_the_start_naming_it(tmp_path: Path) -> None:
    path = config(
        tmp_path, "tiers: {gpu: {capacity: 16MiB, device: cpu}, host: {capacity: 1000PiB}}"
    )
    refused(run("info", "--config", str(path), cwd=tmp_path), "tiers.host.capacity", "available")


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_serve_checks_host_and_port_as_the_config_does(tmp_path: Path) -> None:
    state = f"service: {{state_dir: {tmp_path / 'state'}, shared_memory: false}}\n"
    path = config(tmp_path, SMALL_TIERS + state)
    done = run("serve", "--config", str(path), "--port", "70000", cwd=tmp_path)
    refused(done, "service.port", "70000", "--host/--port")
    assert not (tmp_path / "state").exists()  # refused before anything started
