"""A server whose secret exists starts on a `state_dir` it can no longer write (a full or
read-only filesystem): the secret is only read (`private_files.create_once` writes nothing when
the file exists). Before, every start wrote a temporary copy first, so a sidecar SIGKILLed on
a volume that has since filled would not come back (`service.state_dir` refused).
A first start there still stops, naming `service.state_dir` and the OS's reason."""

from __future__ import annotations

import subprocess
from pathlib import Path

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
