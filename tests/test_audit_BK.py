"""The disk tier's slabs as a restore leaves them (audit BK): a slab of the right length whose
blocks are not allocated (restored by a sparse copy, `rsync -S`, `fallocate --dig-holes`) is
allocated when the tier opens, as a new one is: it was kept as it was, so that on a filling
filesystem every write to a hole failed with ENOSPC while the tier reported its slots free
(a real run on an 8 MiB tmpfs: 66 refused writes, nothing persisted)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from conftest import mounted_tmpfs

from kvtier.blocks import KVLayout
from kvtier.tiers.disk import BlockMeta, DiskTier

LAYOUT = KVLayout("tiny", 2, 2, 64, "float16", 4)  # 4 KiB blocks in 8 KiB slots
SLOT = 8192
SLOTS = 64


def meta(i: int) -> BlockMeta:
    return BlockMeta(i.to_bytes(16, "little"), b"\0" * 16, b"\1" * 16, "t", b"\0" * 16)


def blocks(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.block_shape), generator=gen).to(LAYOUT.dtype)


def make_sparse(slab: Path) -> None:
    """Rewrite `slab` as a sparse copy of itself: its bytes kept, its zero pages holes."""
    data = slab.read_bytes()
    slab.unlink()
    fd = os.open(slab, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, len(data))
        for at in range(0, len(data), 4096):
            if any(data[at : at + 4096]):
                os.pwrite(fd, data[at : at + 4096], at)
    finally:
        os.close(fd)


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_sparse_slab_is_allocated_at_open_and_takes_writes_on_a_full_disk(
    tmp_path: Path,
) -> None:
    with mounted_tmpfs(tmp_path / "small", "1m") as mount:
        path, slab = mount / "disk", mount / "disk" / "slab-00000.kvt"
        disk = DiskTier(LAYOUT, path, SLOTS * SLOT)
        kept = blocks(2, 1)
        assert disk.write_blocks(disk.allocate(2), kept, [meta(0), meta(1)]) == [True, True]
        disk.close()
        make_sparse(slab)  # "restored from a backup"
        assert allocated(slab) < SLOTS * SLOT
        disk = DiskTier(LAYOUT, path, SLOTS * SLOT)
        try:
            assert allocated(slab) >= SLOTS * SLOT  # its capacity is bytes on disk again
            disk.claim([copy.slot for copy in disk.scan().copies])
            with open(mount / "ballast", "wb", buffering=0) as ballast:
                try:
                    while True:
                        ballast.write(b"\0" * 4096)  # another process fills the filesystem
                except OSError:
                    pass
            slots = disk.allocate(SLOTS - 2)
            written = blocks(len(slots), 2)
            metas = [meta(2 + i) for i in range(len(slots))]
            assert disk.write_blocks(slots, written, metas) == [True] * len(slots)
            assert disk.faults["write_errors"] == 0
            got, ok = disk.read_blocks(slots, [m.block_id for m in metas])
            assert all(ok) and torch.equal(torch.stack(list(got)), written)
            got, ok = disk.read_blocks([0, 1], [meta(0).block_id, meta(1).block_id])
            assert all(ok) and torch.equal(torch.stack(list(got)), kept)  # the restore kept
            disk.check()
        finally:
            disk.close()
