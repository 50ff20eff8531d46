"""A disk tier whose lock file is empty (a SIGKILL between its truncation and the pid's write,
or a new directory) starts on a full filesystem: the pid in `kvtier.lock` is for a refusal's
message only (`tiers/disk/lock.py`), so a pid that cannot be written leaves the file empty.
Before, the store did not start at all, with a bare `OSError` (ENOSPC) naming nothing, and
`kvtier serve` reported that as its readiness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import mounted_tmpfs

from kvtier import KVStore, parse_config
from kvtier.errors import ConfigError

TOKENS = list(range(5000, 5032))


def config(disk: Path, capacity: str) -> dict[str, Any]:
    return {
        "model": {
            "name": "lock-full",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 32,
            "dtype": "float16",
        },
        "block_tokens": 16,
        "tiers": {
            "gpu": {"capacity": "256KiB"},
            "host": {"capacity": "256KiB"},
            "disk": {"capacity": capacity, "path": str(disk)},
        },
    }


def fill(directory: Path) -> None:
    with open(directory / "ballast", "wb", buffering=0) as ballast, pytest.raises(OSError):
        while True:
            ballast.write(b"\0" * 4096)


def test_a_tier_with_an_empty_lock_file_starts_on_a_full_filesystem(tmp_path: Path) -> None:
    kv = torch.randn(2, 2, len(TOKENS), 2, 32).to(torch.float16)
    with mounted_tmpfs(tmp_path / "small", "2m") as mount:
        with KVStore(parse_config(config(mount / "d", "512KiB"))) as store:
            store.store(TOKENS, kv)
            assert store.persist()
        (mount / "d" / "kvtier.lock").write_bytes(b"")  # killed between truncate and write
        fill(mount)
        with KVStore(parse_config(config(mount / "d", "512KiB"))) as store:
            store.check()
            assert store.status()["tiers"]["disk"]["blocks"] == 2
            loaded = store.load(TOKENS)
            assert loaded.num_tokens == len(TOKENS)
            assert torch.equal(loaded.kv.view(torch.int16), kv.view(torch.int16))


def test_a_new_tier_on_a_full_filesystem_names_its_capacity(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "1m") as mount:
        fill(mount)
        with pytest.raises(ConfigError) as info:
            KVStore(parse_config(config(mount / "d", "512KiB")))
        assert info.value.field.startswith("tiers.disk"), info.value
