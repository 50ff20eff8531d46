"""`kvtier check PATH [--fix]` in a real process, on a disk tier a real store wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DISK_HEADER_BYTES, DISK_SLOT_BYTES, disk_config, kv_for, slab_headers

from kvtier import KVStore


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120
    )


def counts(stdout: str) -> dict[str, int]:
    found = {}
    for line in stdout.splitlines()[1:]:
        *words, number = line.split()
        if number.isdigit():
            found[" ".join(words)] = int(number)
    return found


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_check_finds_damage_and_fix_retires_it(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    store = KVStore(disk_config(path))
    seqs = [list(range(100 * i, 100 * i + 8)) for i in range(4)]  # 2 blocks each
    for i, tokens in enumerate(seqs):
        store.store(tokens, kv_for(store, 8, seed=i))
    assert store.persist() == 8
    store.close()

    clean = kvtier("check", str(path))
    assert clean.returncode == 0, clean.stderr
    assert "8 valid" in clean.stdout and "0 valid" not in clean.stdout
    assert set(counts(clean.stdout).values()) == {0}

    headers = slab_headers(path)
    slab = path / "slab-00000.kvt"
    data = bytearray(slab.read_bytes())
    first_of = {tokens: slot for tokens, (slot, _) in headers.items()}
    head0 = first_of[tuple(range(0, 4))]  # sequence 0, block 0: its child becomes an orphan
    body1 = first_of[tuple(range(100, 104))]  # sequence 1, block 0: payload damaged
    data[head0 * DISK_SLOT_BYTES + 40] ^= 0xFF
    data[body1 * DISK_SLOT_BYTES + DISK_HEADER_BYTES + 123] ^= 0x01
    slab.write_bytes(bytes(data))

    found = kvtier("check", str(path))
    assert found.returncode == 1
    c = counts(found.stdout)
    assert (c["corrupt headers"], c["corrupt payloads"], c["orphans"]) == (1, 1, 2)
    assert "4 valid" in found.stdout

    fixed = kvtier("check", str(path), "--fix")
    assert fixed.returncode == 0
    assert counts(fixed.stdout)["retired"] == 4
    again = kvtier("check", str(path))
    assert again.returncode == 0 and "4 valid, " in again.stdout
    assert set(counts(again.stdout).values()) == {0}

    store = KVStore(disk_config(path))
    assert (store.recovery["recovered"], store.recovery["corrupt"]) == (4, 0)
    assert store.lookup(seqs[2]).disk_tokens == 8 and store.lookup(seqs[0]).num_tokens == 0
    store.check()
    store.close()


def test_check_refuses_a_directory_that_is_not_a_disk_tier(tmp_path: Path) -> None:
    done = kvtier("check", str(tmp_path))
    assert done.returncode == 2
    assert "a disk tier directory" in done.stderr
