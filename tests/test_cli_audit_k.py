"""Auditor K's findings on `kvtier status` and `kvtier replay`, pinned:

- `kvtier status` against a sidecar whose status reply lacks a field or has one of the wrong
  type exits 2 with one line naming the field (`status_reply.check_status`), no traceback; a
  real store's status still prints;
- a replay of one 2**19-token request at big blocks does not allocate KV for the whole request
  (the zero KV is one token, `expand`ed): the process' peak memory grows by far less;
- `--replicas N --remote` without redis-server on PATH is refused, typed, before any run;
- `--sweep` with `--codec`, and `--sweep` / `--codec` with `--replicas N` / `--route`, are
  refused, typed, naming both options, before any run;
- a config's model name and a trace's path holding ESC and a new line are printed escaped;
- a trace line of many keys with the last one repeated is refused in linear time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_audit4_hostile_text import _Sidecar, fake_sidecar

from kvtier.cli import main
from kvtier.config import parse_config
from kvtier.errors import TraceError
from kvtier.replay.trace import parse_line
from kvtier.store import KVStore


@pytest.fixture
def sidecar() -> Iterator[tuple[str, type[_Sidecar]]]:
    with fake_sidecar() as served:
        yield served


def _real_status() -> dict[str, Any]:
    config = parse_config({"tiers": {"gpu": {"capacity": "1MiB"}, "host": {"capacity": "1MiB"}}})
    with KVStore(config) as store:
        return store.status()


def _broken(path: str, value: Any) -> dict[str, Any]:
    """A real status with the field at dotted `path` set to `value` (`...`: removed)."""
    status = _real_status()
    *parents, last = path.split(".")
    node = status
    for name in parents:
        node = node[name]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return status


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (None, {}, "status.layout: missing"),
        (None, {"tenant": "t", "layout": {}}, "status.layout.model: missing"),
        ("hit_rate", "notanumber", "status.hit_rate: got 'notanumber'"),
        ("tiers.gpu.slots", [1], "status.tiers.gpu.slots: got [1]"),
        ("mover.prefetch_to_ready_s", 3, "status.mover.prefetch_to_ready_s: got 3"),
        ("ops.lookups", 10**400, "status.ops.lookups: got an integer of"),
        ("paths", ..., "status.paths: missing"),
        ("hit_rate", -(10**400), "status.hit_rate: got a negative integer of"),
    ],
)
def test_status_of_a_malformed_reply_names_the_field(
    sidecar: tuple[str, type[_Sidecar]],
    capsys: pytest.CaptureFixture[str],
    path: str | None,
    value: Any,
    named: str,
) -> None:
    """`path` None: the reply is `value`; else a real status with that field changed."""
    url, handler = sidecar
    handler.body = value if path is None else _broken(path, value)
    assert main(["status", "--url", url]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("kvtier: ") and out.err.count("\n") == 1, out.err
    assert named in out.err, out.err


def test_status_of_a_real_reply_prints(
    sidecar: tuple[str, type[_Sidecar]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, handler = sidecar
    handler.body = _real_status()
    assert main(["status", "--url", url]) == 0
    assert "hit rate" in capsys.readouterr().out


def trace_file(path: Path, requests: list[list[int]]) -> str:
    lines = [
        json.dumps(
            {"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
        )
        for i, ids in enumerate(requests)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


SMALL = [[0, 1, 2], [0, 1, 3], [4], [0, 1, 2, 5]]


def _memory_kib(field: str) -> int:
    """`VmRSS` (now) or `VmHWM` (the peak since `_reset_peak`) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(field)


def _reset_peak() -> None:
    """The peak resident memory (`VmHWM`) set to the current one (Linux `clear_refs`)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(reason=f"cannot reset this process' peak memory: {exc}")


def test_long_request_of_big_blocks_holds_no_kv_of_its_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2**19 tokens of 256 KiB blocks: a whole zero KV would be 256 MiB; the run's peak grows
    by less than half of it (the tier is 10 blocks, 2.5 MiB)."""
    trace = trace_file(tmp_path / "long.jsonl", [list(range(1024))])
    args = [trace, "--jobs", "1", "--no-baseline", "--host", "0", "--disk", "0", "--json"]
    _reset_peak()
    before = _memory_kib("VmRSS")
    assert main(["replay", *args, "--block-bytes", str(256 * 1024)]) == 0
    grew = _memory_kib("VmHWM") - before
    assert grew < 128 * 1024, f"the peak grew by {grew} KiB"
    assert json.loads(capsys.readouterr().out)["runs"][0]["requests"] == 1


def test_remote_without_redis_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = trace_file(tmp_path / "t.jsonl", SMALL)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert main(["replay", trace, "--jobs", "1", "--replicas", "2", "--remote"]) == 2
    out = capsys.readouterr()
    assert out.out == "", out.out  # no run was made
    assert "--remote: got no --remote-nodes and no redis-server" in out.err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--sweep", "--codec", "none,int8"], "--sweep with --codec: got both"),
        (["--sweep", "--replicas", "2"], "--sweep with --replicas: got both"),
        (["--sweep", "--replicas", "2", "--route", "prefix"], "--sweep with --route: got both"),
        (["--codec", "none,int8", "--replicas", "2"], "--codec with --replicas: got both"),
    ],
)
def test_one_sizing_modes_refuse_many_sizings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    trace = trace_file(tmp_path / "t.jsonl", SMALL)
    assert main(["replay", trace, "--jobs", "1", *extra]) == 2
    out = capsys.readouterr()
    assert out.out == "" and named in out.err, out


def test_replay_prints_the_model_name_and_trace_path_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = trace_file(tmp_path / "a\x1b[31mRED\nforged.jsonl", SMALL)
    config = tmp_path / "c.yaml"
    config.write_text(
        'model: {name: "evil\\e[31mRED\\nforged line", num_layers: 1, num_kv_heads: 1, '
        "head_dim: 8, dtype: float32}\n"
        "tiers: {gpu: {capacity: 1MiB, device: cpu}, host: {capacity: 1MiB}}\n"
    )
    assert main(["replay", trace, "--config", str(config), "--jobs", "1", "--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert not any(line.startswith("forged") for line in out.splitlines()), out
    assert "evil\\x1b[31mRED\\x0aforged line" in out
    assert "a\\x1b[31mRED\\x0aforged.jsonl" in out


def test_duplicate_key_check_is_linear() -> None:
    keys = 40_000
    record = {f"k{i}": 0 for i in range(keys)}
    text = json.dumps(record)[:-1] + f', "k{keys - 1}": 1}}'
    started = time.perf_counter()
    with pytest.raises(TraceError, match=f"key 'k{keys - 1}' given twice"):
        parse_line(text)
    assert time.perf_counter() - started < 1.5
