"""The `kvtier` command in a real process: `info` on the default config, `validate`, bad files.

The embedded default has a disk tier of 2 GiB at `./kvtier-data`: its tests run in a real tmpfs
mounted for them (never preallocating on the shared root filesystem)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mounted_tmpfs

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


BLOCK = 30 * 2 * 16 * 3 * 64 * 2  # the default model's block: 360 KiB


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_info_on_the_default_config_prints_three_tiers(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "fs", "2304m") as cwd:
        done = run("info", cwd=cwd)
        assert done.returncode == 0, done.stderr
        assert "SmolLM2-135M-Instruct" in done.stdout
        lines = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:5]}
        assert lines["gpu"][3] == str((256 << 20) // BLOCK)  # 728 slots
        assert lines["host"][3] == str((1 << 30) // BLOCK)  # 2912 slots
        assert lines["disk"][1] == str(cwd / "kvtier-data")  # where it runs, made absolute
        assert int(lines["disk"][3]) == (2 << 30) // (BLOCK + 4096)  # 4 KiB header a slot
        assert (cwd / "kvtier-data" / "kvtier-disk.json").is_file()


def test_the_default_disk_tier_is_refused_where_it_does_not_fit(tmp_path: Path) -> None:
    """On a filesystem with less free space than the default's 2 GiB (less a reserve), the
    default start is refused naming the field and the figures, and nothing is allocated."""
    with mounted_tmpfs(tmp_path / "fs", "64m") as cwd:
        done = run("info", cwd=cwd)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "tiers.disk.capacity" in done.stderr
        asked = re.search(r"got (\d+), expected at most (\d+) bytes", done.stderr)
        assert asked is not None, done.stderr
        assert 0.99 * (2 << 30) < int(asked[1]) <= 2 << 30  # the slabs the capacity asks for
        assert int(asked[2]) < 64 << 20  # what the filesystem can give
        assert "bytes free" in done.stderr
        assert "Traceback" not in done.stderr
        assert not list((cwd / "kvtier-data").glob("slab-*"))


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_info_json_matches_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "small.yaml"
    path.write_text(
        "model: {name: t, num_layers: 1, num_kv_heads: 1, head_dim: 8, dtype: float16}\n"
        "block_tokens: 4\ntiers: {gpu: {capacity: 64KiB}, host: {capacity: 128KiB}}\n"
    )
    done = run("info", "--config", str(path), "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["layout"]["block_bytes"] == 1 * 2 * 4 * 1 * 8 * 2
    assert status["tiers"]["gpu"]["slots"] == 65536 // 128
    assert status["tiers"]["host"]["capacity_bytes"] == 131072


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_validate_accepts_every_shipped_config() -> None:
    files = sorted(str(p) for p in CONFIGS.glob("*.yaml"))
    done = run("validate", *files)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": ok (") == len(files)


def test_a_bad_file_stops_the_start_naming_field_and_value(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("policy: {write: write_sideways}\n")
    done = run("info", "--config", str(path))
    assert done.returncode == 2
    assert "policy.write" in done.stderr and "write_sideways" in done.stderr
    assert done.stdout == ""


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_validate_names_each_quantized_tier_and_a_group_that_does_not_fit(
    tmp_path: Path,
) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(
        "tiers:\n  host: {capacity: 1GiB, codec: int8}\n"
        f"  disk: {{capacity: 2GiB, path: {tmp_path / 'd'}, codec: int4, codec_keys: channel}}\n"
    )
    done = run("validate", str(good))
    assert done.returncode == 0, done.stderr
    # SmolLM2's bf16 blocks: 368,640 bytes; int8 payloads 190,080, int4 with K per channel 113,760
    assert "host 1GiB in i8k60v60, 1.94x the blocks" in done.stdout
    # disk slots (a 4 KiB header region and the payload, 4 KiB-aligned): 372,736 / 118,784
    assert "disk 2GiB in i4kcv40, 3.14x the blocks" in done.stdout
    bad.write_text(
        f"tiers: {{disk: {{capacity: 1GiB, path: {tmp_path}, codec: int4, codec_group: 100}}}}\n"
    )
    done = run("validate", str(bad))
    assert done.returncode == 2 and done.stdout == ""
    assert "tiers.disk.codec_group" in done.stderr and "divisor" in done.stderr
