"""Memory tiers given in bytes must fit the memory available when the store is built: a tier's
mapping commits its pages as blocks are written, so a gpu tier in host memory (no CUDA) and a
host tier that each fit, but not together, were accepted and then filled until the kernel
killed a process (audit AY: `kvtier serve` and every in-process store, not only the replay).
Nothing is mapped or created for a refused config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier import KVStore, parse_config
from kvtier.errors import ConfigError
from kvtier.tiers.memory import available_host_bytes

MODEL = {"name": "t", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16"}


def config(gpu: int | str, host: int | str, disk: Path | None = None) -> dict[str, Any]:
    tiers: dict[str, Any] = {
        "gpu": {"capacity": gpu, "device": "cpu"},
        "host": {"capacity": host, "pinned": False},
    }
    if disk is not None:
        tiers["disk"] = {"capacity": "1MiB", "path": str(disk)}
    return {"model": MODEL, "block_tokens": 4, "tiers": tiers}


def test_gpu_and_host_that_fit_only_apart_are_refused(tmp_path: Path) -> None:
    each = available_host_bytes() * 6 // 10  # each fits; the two do not
    with pytest.raises(ConfigError, match=r"tiers\.host\.capacity.*beside the gpu tier"):
        KVStore(parse_config(config(each, each, tmp_path / "disk")))
    assert not (tmp_path / "disk").exists()  # refused before the disk tier was made


def test_a_gpu_tier_in_host_memory_past_it_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.gpu\.capacity.*of memory available"):
        KVStore(parse_config(config(available_host_bytes() * 3 // 2, "1MiB")))


def test_tiers_that_fit_together_open() -> None:
    with KVStore(parse_config(config("64MiB", "64MiB"))) as store:
        assert store.status()["tiers"]["host"]["capacity_bytes"] == 64 << 20
        store.check()
