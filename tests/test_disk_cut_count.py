"""Counting the copies a lowered disk capacity cuts is a figure, never a reason to refuse a
start, and never a long one (an in-process `KVStore` on real slab files).

Pins:
- a slot past the new capacity that cannot be read (EIO from `pread`, a bad sector) leaves
  start-up going: the cut is made, the readable copies are counted, the unreadable not (the
  first count raised the `OSError` out of `KVStore`, where the cut alone had started);
- the count reads at most `scan.MAX_COUNTED` headers: past them it is a lower bound, so the
  cut of a huge (or sparse, planted) slab does not hold start-up for minutes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from service_server import kv_of, tokens_of

from kvtier.config.loading import parse_config
from kvtier.config.root import KVTierConfig
from kvtier.store import KVStore
from kvtier.tiers.disk import scan

KEPT = 32  # the slots the lowered capacity keeps
STORED = 40  # blocks persisted at the first capacity


def config(
    directory: Path, capacity: int | str, events: dict[str, Any] | None = None
) -> KVTierConfig:
    """The store of these tests (and of `test_events_bind_first.py`, with `events`)."""
    document: dict[str, Any] = {
        "model": {
            "name": "m",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 64,
            "dtype": "float16",
        },
        "block_tokens": 4,
        "mover": {"background": False},
        "tiers": {
            "gpu": {"capacity": "1MiB", "device": "cpu"},
            "host": {"capacity": "1MiB", "pinned": False},
            "disk": {"capacity": capacity, "path": str(directory / "disk")},
        },
    }
    if events is not None:
        document["events"] = events
    return parse_config(document)


def persisted(tmp_path: Path) -> int:
    """Store and persist `STORED` blocks at 1 MiB of disk; the disk's slot size."""
    store = KVStore(config(tmp_path, "1MiB"))
    try:
        store.store(tokens_of(0, STORED * 4), kv_of(STORED * 4, seed=1))
        assert store.persist().left_blocks == 0
        store.check()
        assert store.disk is not None
        return store.disk.slot_bytes
    finally:
        store.close()


def test_an_unreadable_slot_past_the_capacity_is_not_counted_and_the_start_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot = persisted(tmp_path)
    real = os.pread

    def bad_sector(fd: int, n: int, offset: int) -> bytes:
        if offset >= 36 * slot:  # slots 36.. of the 8 past the new capacity
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", bad_sector)
    store = KVStore(config(tmp_path, KEPT * slot))
    try:
        store.check()
        assert store.recovery["recovered"] == KEPT
        assert store.recovery["cut"] == 4  # slots 32..35: read; 36..39: not
    finally:
        store.close()


def test_the_count_reads_at_most_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slot = persisted(tmp_path)
    monkeypatch.setattr(scan, "MAX_COUNTED", 3)
    store = KVStore(config(tmp_path, KEPT * slot))
    try:
        store.check()
        assert (store.recovery["recovered"], store.recovery["cut"]) == (KEPT, 3)
    finally:
        store.close()
