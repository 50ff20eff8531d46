"""The disk tier's write path and start (`tiers/disk/copies.py`, `tier.py`): copies into
consecutive slots go out as runs of one `pwritev` each, in any slot order, split at slab ends;
a tier whose directory was new skips the recovery scan, one that existed never does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.blocks import KVLayout
from kvtier.tiers import SlotPool
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.disk import io as disk_io
from kvtier.tiers.disk import slabs as disk_slabs
from kvtier.tiers.disk.slab_set import SlabSet

LAYOUT = KVLayout("tiny", 2, 2, 64, "float16", 4)  # 4 KiB blocks, as the disk tests use
CPU = torch.device("cpu")


def meta(i: int) -> BlockMeta:
    return BlockMeta(i.to_bytes(16, "little"), b"\0" * 16, b"\1" * 16, "t", b"\0" * 16)


def host_blocks(n: int) -> SlotPool:
    """A host pool of `n` page-aligned slots holding random blocks."""
    pool = SlotPool("host", LAYOUT, n, CPU)
    pool.allocate(n)
    gen = torch.Generator().manual_seed(n)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(LAYOUT.dtype))
    return pool


def count_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the bytes of every slab write from now on."""
    sizes: list[int] = []
    write: Callable[..., None] = disk_io.SlabFile.write

    def counted(self: disk_io.SlabFile, offset: int, buffers: list[memoryview]) -> None:
        sizes.append(sum(memoryview(b).nbytes for b in buffers))
        write(self, offset, buffers)

    monkeypatch.setattr(disk_io.SlabFile, "write", counted)
    return sizes


def test_copies_into_consecutive_slots_are_written_as_runs_in_any_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 slots a slab: slots 5..10 cross from slab 0 into slab 1
    monkeypatch.setattr(disk_slabs, "SLAB_TARGET_BYTES", 8 * 8192)
    pool = host_blocks(8)
    disk = DiskTier(LAYOUT, tmp_path / "disk", 16 * 8192)
    try:
        assert disk.slot_bytes == 8192 and disk.slots_per_slab == 8
        disk.allocate(16)
        sizes = count_writes(monkeypatch)
        slots = [9, 6, 5, 10, 7, 8, 14]  # runs 5..7 (slab 0), 8..10 (slab 1), and 14 alone
        views = [pool.buffer[i] for i in range(len(slots))]
        ok = disk.write_blocks(slots, views, [meta(i) for i in range(len(slots))])
        assert ok == [True] * len(slots)
        assert sorted(sizes) == [8192, 3 * 8192, 3 * 8192]
        back, good = disk.read_blocks(slots, [meta(i).block_id for i in range(len(slots))])
        assert good == [True] * len(slots)
        for i in range(len(slots)):
            assert torch.equal(back[i].view(torch.int16), pool.buffer[i].view(torch.int16))
    finally:
        disk.close()


def test_a_run_that_fails_fails_each_of_its_copies_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = host_blocks(4)
    disk = DiskTier(LAYOUT, tmp_path / "disk", 16 * 8192)
    try:
        disk.allocate(16)
        write = disk_io.SlabFile.write

        def refuse_runs(self: disk_io.SlabFile, offset: int, buffers: list[memoryview]) -> None:
            if len(buffers) > 2:  # a run: more than one header and payload
                raise OSError(5, "injected")
            write(self, offset, buffers)

        monkeypatch.setattr(disk_io.SlabFile, "write", refuse_runs)
        views = [pool.buffer[i] for i in range(4)]
        ok = disk.write_blocks([0, 1, 2, 9], views, [meta(i) for i in range(4)])
        assert ok == [False, False, False, True]
        assert disk.faults["write_errors"] == 3
    finally:
        disk.close()


def test_a_new_directory_is_not_scanned_and_one_that_existed_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = host_blocks(2)
    path = tmp_path / "disk"
    disk = DiskTier(LAYOUT, path, 16 * 8192)
    with monkeypatch.context() as patched:
        patched.setattr(SlabSet, "run", lambda self, jobs: pytest.fail("the scan read a slot"))
        report = disk.scan()
    assert (report.copies, report.empty, report.corrupt) == ([], disk.num_slots, 0)
    slots = disk.allocate(2)
    assert disk.write_blocks(slots, [pool.buffer[0], pool.buffer[1]], [meta(0), meta(1)])
    assert [c.slot for c in disk.scan().copies] == slots  # written since: scanned
    disk.close()

    again = DiskTier(LAYOUT, path, 16 * 8192)  # the directory existed: scanned
    try:
        report = again.scan()
        assert sorted(c.slot for c in report.copies) == slots
        assert report.empty == again.num_slots - 2
    finally:
        again.close()


def test_slabs_left_without_a_superblock_are_scanned(tmp_path: Path) -> None:
    pool = host_blocks(1)
    path = tmp_path / "disk"
    disk = DiskTier(LAYOUT, path, 16 * 8192)
    slot = disk.allocate(1)
    assert disk.write_blocks(slot, [pool.buffer[0]], [meta(7)]) == [True]
    disk.close()
    (path / disk_slabs.SUPERBLOCK).unlink()
    again = DiskTier(LAYOUT, path, 16 * 8192)
    try:
        assert [c.header.block_id for c in again.scan().copies] == [meta(7).block_id]
    finally:
        again.close()
