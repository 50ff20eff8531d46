"""A server whose secret exists starts on a `state_dir` it can no longer write (a full or
read-only filesystem): the secret is only read (`private_files.create_once` writes nothing when
the file exists). Before, every start wrote a temporary copy first, so a sidecar SIGKILLed on
a volume that has since filled would not come back (`service.state_dir` refused).
A first start there still stops, naming `service.state_dir` and the OS's reason."""

from __future__ import annotations

import multiprocessing
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import mounted_tmpfs

from kvtier.errors import ConfigError
from kvtier.service.auth import server_secret


def fill(directory: Path) -> None:
    """Write `directory`'s filesystem full."""
    with open(directory / "ballast", "wb", buffering=0) as ballast, pytest.raises(OSError):
        while True:
            ballast.write(b"\0" * 4096)


def test_a_secret_made_before_is_read_on_a_full_or_read_only_filesystem(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "512k") as mount:
        state = mount / "state"
        first = server_secret(state)
        fill(mount)
        assert server_secret(state) == first  # a restart on the full volume
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=30)
        try:
            assert server_secret(state) == first  # and on a read-only one
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True, timeout=30)


def test_a_first_start_on_a_full_filesystem_names_state_dir(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "512k") as mount:
        (mount / "state").mkdir(mode=0o700)
        fill(mount)
        with pytest.raises(ConfigError) as info:
            server_secret(mount / "state")
        assert info.value.field == "service.state_dir"


def _secret_at_barrier(state_dir: str, barrier: Any, out: Any) -> None:
    barrier.wait()
    try:
        out.put(server_secret(state_dir).hex())
    except Exception as exc:
        out.put(f"error: {exc}")


def test_ranks_starting_at_once_on_one_state_dir_share_one_secret(tmp_path: Path) -> None:
    """8 processes (a TP-8 server's sidecars) make the secret of one fresh `state_dir` at once:
    each reads the one on disk (before: they removed each other's `secret.tmp`, and some failed
    to start or kept a secret that was not the one written, orphaning their disk copies)."""
    ctx = multiprocessing.get_context("fork")
    for trial in range(4):
        state_dir = tmp_path / f"state{trial}"
        barrier, out = ctx.Barrier(8), ctx.Queue()
        ranks = [ctx.Process(target=_secret_at_barrier, args=(str(state_dir), barrier, out))
                 for _ in range(8)]  # fmt: skip
        for rank in ranks:
            rank.start()
        got = [out.get(timeout=60) for _ in ranks]
        for rank in ranks:
            rank.join(60)
        on_disk = (state_dir / "secret").read_bytes().hex()
        assert got == [on_disk] * 8, got
        assert sorted(p.name for p in state_dir.iterdir()) == ["secret"]  # no temporary left
