"""The disk tier's I/O paths and start (`tiers/disk/copies.py`, `reads.py`, `views.py`,
`tier.py`): copies into consecutive slots are written and read as runs of one system call each,
in any slot order, split at slab ends; blocks of any kind are seen as their bytes; a tier whose
directory was new skips the recovery scan, one that existed never does."""

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
from kvtier.tiers.disk.views import byte_views, direct_ready

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


def test_copies_in_consecutive_slots_are_read_as_runs_each_checked_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_slabs, "SLAB_TARGET_BYTES", 8 * 8192)  # 8 slots a slab
    pool = host_blocks(8)
    disk = DiskTier(LAYOUT, tmp_path / "disk", 16 * 8192)
    try:
        slots = [9, 6, 5, 10, 7, 8, 14]  # runs 5..7 (slab 0), 8..10 (slab 1), and 14 alone
        disk.allocate(16)
        metas = [meta(i) for i in range(len(slots))]
        assert all(disk.write_blocks(slots, [pool.buffer[i] for i in range(7)], metas))
        reads: list[int] = []
        readv = disk_io.SlabFile.readv

        def counted(self: disk_io.SlabFile, offset: int, buffers: list[memoryview]) -> int:
            reads.append(sum(memoryview(b).nbytes for b in buffers))
            return readv(self, offset, buffers)

        monkeypatch.setattr(disk_io.SlabFile, "readv", counted)
        ids = [m.block_id for m in metas]
        ids[4] = meta(99).block_id  # slot 7 holds another block: that copy alone fails
        into = host_blocks(8)
        _, ok = disk.read_blocks(slots, ids, out=[into.buffer[i] for i in range(7)])
        assert ok == [True, True, True, True, False, True, True]
        assert sorted(reads) == [8192, 3 * 8192, 3 * 8192]
        assert disk.faults["corrupt_reads"] == 1
        for i in (0, 1, 2, 3, 5, 6):
            assert torch.equal(into.buffer[i].view(torch.int16), pool.buffer[i].view(torch.int16))

        def refuse_runs(self: disk_io.SlabFile, offset: int, buffers: list[memoryview]) -> int:
            if len(buffers) > 2:  # a run: more than one header and payload
                raise OSError(5, "injected")
            return readv(self, offset, buffers)

        monkeypatch.setattr(disk_io.SlabFile, "readv", refuse_runs)
        _, ok = disk.read_blocks(slots, [m.block_id for m in metas], [into.buffer[0]] * 7)
        assert ok == [False, False, False, False, False, False, True]
        assert disk.faults["read_errors"] == 6
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


def test_byte_views_are_each_blocks_memory_whatever_the_blocks_are() -> None:
    """Pool slots and a batch tensor are sliced from one view of their storage; a block from
    elsewhere, unaligned or not contiguous is viewed alone. Reads land through the views."""
    pool = host_blocks(4)
    other = torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype)
    unaligned = torch.empty(LAYOUT.block_bytes + 2, dtype=torch.uint8)[2:].view(LAYOUT.dtype)
    strided = pool.buffer[:2].transpose(0, 1)[:, 1]  # slot 1, not contiguous
    blocks = [pool.buffer[2], other, pool.buffer[0], unaligned.view(LAYOUT.block_shape), strided]
    views, aligned = byte_views(blocks)
    for view, block in zip(views, blocks, strict=True):
        assert bytes(view) == block.contiguous().view(torch.uint8).numpy().tobytes()
    assert aligned[:4] == [True, direct_ready(other), True, False]  # pool slots are page-aligned
    views[0][:2] = b"\x01\x02"  # writes through to pool slot 2
    assert pool.buffer[2].view(torch.uint8).reshape(-1)[:2].tolist() == [1, 2]
    batch = pool.buffer[1:4]
    rows, row_aligned = byte_views(batch)
    assert [bytes(r) for r in rows] == [bytes(v) for v in byte_views(list(batch)).views]
    assert row_aligned == [True] * 3 and byte_views([]) == ([], [])


def test_blocks_of_any_kind_are_written_and_read_back_alike(tmp_path: Path) -> None:
    pool = host_blocks(6)
    disk = DiskTier(LAYOUT, tmp_path / "disk", 16 * 8192)
    try:
        slots = disk.allocate(6)
        copies = pool.buffer.clone()
        unaligned = torch.empty(2 * LAYOUT.block_bytes + 2, dtype=torch.uint8)[2:]
        unaligned = unaligned.view(LAYOUT.dtype).view(2, *LAYOUT.block_shape)
        unaligned.copy_(pool.buffer[2:4])
        strided = pool.buffer[4:6].transpose(-1, -2).contiguous().transpose(-1, -2)
        assert disk.write_blocks(slots[:2], pool.buffer[:2], [meta(0), meta(1)]) == [True] * 2
        assert disk.write_blocks(slots[2:4], list(unaligned), [meta(2), meta(3)]) == [True] * 2
        assert disk.write_blocks(slots[4:], list(strided), [meta(4), meta(5)]) == [True] * 2
        pool.buffer.zero_()
        into = [pool.buffer[i] for i in (5, 0, 3, 1, 4, 2)]  # read back in another order
        _, ok = disk.read_blocks(slots, [meta(i).block_id for i in range(6)], out=into)
        assert ok == [True] * 6
        for i, block in enumerate(into):
            assert torch.equal(block.view(torch.int16), copies[i].view(torch.int16))
    finally:
        disk.close()
