"""A disk tier opened at a relative path (the embedded default's `./kvtier-data`) in a process
that changes its working directory afterwards (an engine that embeds the store): `check()`
looks each slab up by path (a slab deleted or replaced under the tier fails it), and the
relative path then named nothing, so a healthy store failed its check (review 2). The tier
keeps its path absolute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier import KVStore, parse_config

MODEL = {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}


def test_a_relative_disk_path_survives_a_change_of_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = parse_config(
        {
            "model": MODEL,
            "block_tokens": 4,
            "tiers": {
                "gpu": {"capacity": "64KiB"},
                "host": {"capacity": "64KiB"},
                "disk": {"capacity": "1MiB", "path": "./reldisk"},
            },
            "policy": {"disk_admission_hits": 0},
        }
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with KVStore(config) as store:
        tokens = list(range(8))
        store.store(tokens, torch.randn(2, 2, 8, 2, 8))
        assert store.persist().left_blocks == 0
        monkeypatch.chdir(elsewhere)
        store.check()  # was: InvariantError "slab reldisk/slab-00000.kvt is no longer ..."
        assert store.load(tokens).num_tokens == 8
    assert (tmp_path / "reldisk" / "slab-00000.kvt").exists()
    assert not (elsewhere / "reldisk").exists()
