"""The disk tier as an operator meets it while it runs (audit AT): a lock file deleted under a
running store keeps a second store (and `kvtier check --fix`) out all the same; a slab cut
short under the tier fails the reads of what it no longer holds instead of vouching for them
from an earlier read's buffer; a slab deleted, moved or replaced under the running tier fails
its `check()` (`/v1/admin/check`), since every copy written into it since is lost at the next
start (it said all was well); a directory whose superblock was deleted, on a full filesystem,
is a typed refusal at start (it was a bare `OSError` traceback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import mounted_tmpfs

from kvtier.blocks import KVLayout
from kvtier.errors import ConfigError, InvariantError
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.disk.check import check_directory
from kvtier.tiers.disk.io import aligned_buffer
from kvtier.tiers.disk.lock import LOCK_FILE

LAYOUT = KVLayout("tiny", 2, 2, 64, "float16", 4)  # 4 KiB blocks in 8 KiB slots
SLOT = 8192


def meta(i: int) -> BlockMeta:
    return BlockMeta(i.to_bytes(16, "little"), b"\0" * 16, b"\1" * 16, "t", b"\0" * 16)


def blocks(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    return torch.randn((n, *LAYOUT.block_shape), generator=gen).to(LAYOUT.dtype)


def aligned_block() -> torch.Tensor:
    """A destination a payload is read into in place (page-aligned, one payload long)."""
    raw = torch.frombuffer(aligned_buffer(LAYOUT.block_bytes), dtype=torch.uint8)
    return raw.view(LAYOUT.dtype).view(LAYOUT.block_shape)


def test_a_lock_file_deleted_under_a_running_store_still_keeps_others_out(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    disk = DiskTier(LAYOUT, path, 16 * SLOT)
    try:
        assert disk.write_blocks(disk.allocate(2), blocks(2), [meta(0), meta(1)]) == [True] * 2
        os.unlink(path / LOCK_FILE)  # "a stale lock": the store still runs
        with pytest.raises(ConfigError, match="no other kvtier process has open"):
            DiskTier(LAYOUT, path, 16 * SLOT)
        with pytest.raises(ConfigError, match="no other kvtier process has open"):
            check_directory(path, fix=True)  # what `kvtier check --fix` runs
        _, ok = disk.read_blocks([0, 1], [meta(0).block_id, meta(1).block_id])
        assert ok == [True, True]  # nothing retired or overwritten behind the running tier
    finally:
        disk.close()
    again = DiskTier(LAYOUT, path, 16 * SLOT)  # the holder gone, the directory opens
    try:
        assert len(again.scan().copies) == 2
    finally:
        again.close()


@pytest.mark.parametrize("in_place", [False, True])
def test_a_slab_cut_short_under_the_tier_fails_its_reads(tmp_path: Path, in_place: bool) -> None:
    disk = DiskTier(LAYOUT, tmp_path / "disk", 16 * SLOT, workers=1)  # one thread's buffers
    try:
        slots = disk.allocate(2)
        written = blocks(2)
        assert disk.write_blocks(slots, written, [meta(0), meta(1)]) == [True, True]

        def read() -> tuple[torch.Tensor, bool]:
            out = [aligned_block()] if in_place else None
            got, ok = disk.read_blocks(slots[:1], [meta(0).block_id], out)
            return got[0], ok[0]

        got, ok = read()
        assert ok and torch.equal(got, written[0])
        os.truncate(tmp_path / "disk" / "slab-00000.kvt", 0)  # cut under the running tier
        _, ok = read()
        assert not ok  # the disk holds no copy any more: never reported as one
        assert disk.faults["read_errors"] == 1  # a read the file's end cut short
        assert disk.faults["corrupt_reads"] == 0
    finally:
        disk.close()


def test_a_superblock_that_cannot_be_written_back_is_a_typed_refusal(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "small", "1m") as mount:
        path = mount / "disk"
        DiskTier(LAYOUT, path, 32 * SLOT).close()
        os.unlink(path / "kvtier-disk.json")  # deleted by hand; the slabs stay
        with open(mount / "ballast", "wb", buffering=0) as ballast, pytest.raises(OSError):
            while True:
                ballast.write(b"\0" * 4096)
        with pytest.raises(ConfigError, match=r"superblock into \(No space left") as info:
            DiskTier(LAYOUT, path, 32 * SLOT)
        assert info.value.field == "tiers.disk.path"
        assert not (path / "kvtier-disk.json.tmp").exists()
        os.unlink(mount / "ballast")
        DiskTier(LAYOUT, path, 32 * SLOT).close()  # the lock was given back: it opens


@pytest.mark.parametrize("how", ["deleted", "moved", "replaced"])
def test_a_slab_gone_from_its_path_under_the_tier_fails_its_check(tmp_path: Path, how: str) -> None:
    path = tmp_path / "disk"
    slab = path / "slab-00000.kvt"
    disk = DiskTier(LAYOUT, path, 16 * SLOT)
    try:
        disk.check()
        if how == "deleted":
            slab.unlink()
        elif how == "moved":
            slab.rename(tmp_path / "backup.kvt")
        else:  # a copy put in its place: the tier still writes the old file
            (path / "new.kvt").write_bytes(slab.read_bytes())
            (path / "new.kvt").replace(slab)
        assert disk.write_blocks(disk.allocate(1), blocks(1), [meta(0)]) == [True]
        with pytest.raises(InvariantError, match="no longer the file the tier writes"):
            disk.check()
    finally:
        disk.close()
    if how == "replaced":
        again = DiskTier(LAYOUT, path, 16 * SLOT)
        try:
            assert again.scan().copies == []  # the acknowledged copy is gone, as check said
        finally:
            again.close()
