"""A clear's or a reset's retirement of disk copies is synced under `fsync: none` too: its
copies' writes are not (the trade-off that setting makes), but a reset after a weight update
that reported no block left, then a power loss, brought the old weights' KV back at the next
start (the retirement was never synced). The syncs are counted by wrapping `os.fdatasync`
(the real call still made)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import KVStore, parse_config

MODEL = {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}
BT = 4


def store_of(path: Path) -> KVStore:
    return KVStore(
        parse_config(
            {
                "model": MODEL,
                "block_tokens": BT,
                "tiers": {
                    "gpu": {"capacity": "64KiB"},
                    "host": {"capacity": "64KiB"},
                    "disk": {"capacity": "4MiB", "path": str(path), "fsync": "none"},
                },
                "policy": {"disk_admission_hits": 0},
            }
        )
    )


@pytest.mark.parametrize("drop", [lambda s: s.clear(), lambda s: s.reset()], ids=["clear", "reset"])
def test_a_drop_of_disk_copies_is_synced_under_fsync_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drop: Callable[[KVStore], Any]
) -> None:
    syncs: list[int] = []
    real = os.fdatasync

    def counted(fd: int) -> None:
        syncs.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counted)
    with store_of(tmp_path / "disk") as store:
        for i in range(4):
            tokens = list(range(100 * i, 100 * i + 2 * BT))
            store.store(tokens, torch.randn(2, 2, 2 * BT, 2, 8))
        assert store.persist().left_blocks == 0
        assert store.status()["tiers"]["disk"]["blocks"] == 8
        assert syncs == []  # `none`: the copies' writes are not synced
        drop(store)
        assert syncs, "the retirement was not synced"  # was: never
        assert store.status()["tiers"]["disk"]["blocks"] == 0
        store.check()
