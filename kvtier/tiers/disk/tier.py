"""The disk tier: block copies in fixed slots of preallocated slab files on local NVMe.

    <path>/kvtier-disk.json      geometry: slot size, slots per slab, layout fingerprint (and
                                 its fields), hash algorithm
    <path>/slab-00000.kvt        slots 0 .. S-1
    <path>/slab-00001.kvt        slots S .. 2S-1           (S = slots_per_slab)

    slot = [ header region (msgpack header + header checksum, format.py) | payload (codec) ]

Layout by measurement (this machine, ext4, O_DIRECT, 8 threads, group commits of 64 blocks):
one file per block (create, pwritev, fdatasync each, one directory fsync per batch) wrote 2 MiB
blocks at 3.53-3.61 GB/s against 3.88-3.93 GB/s for fixed slots in a preallocated slab (one
fdatasync per batch), and 256 KiB blocks at 0.59-1.36 GB/s against 2.39-2.77 GB/s: the per-file
create and sync cost grows as blocks shrink, and a file per block also pays a directory entry
and an inode, fragments free space, and turns recovery into a directory walk. Fixed slots turn
every write into one aligned `pwritev` at a known offset, a batch into one `fdatasync` per
slab, and recovery into a scan of header regions at known offsets (see README, "Disk tier").

Contract:
- Capacity is enforced on bytes allocated on disk: every slab is `posix_fallocate`d when the
  tier opens, so `du` of the directory is the slabs' size (<= capacity) plus the superblock
  and the directory itself. A capacity the filesystem cannot hold, less a reserve for other
  processes, is refused at start (`ConfigError` on `tiers.disk.capacity`, `slabs.check_room`);
  room that goes while the slabs are allocated gives fewer slabs (counted in
  `faults["enospc"]`), never a write that fails later for lack of space.
- `write_blocks` is a group commit: all copies of the batch are written in parallel, then each
  touched slab is synced once (`fsync: batch`; `fsync: none` skips the sync and accepts losing
  the tail on power loss). Batches written at once from several threads into one slab share
  their syncs (`SlabFile.sync`). A copy is reported durable only after a sync that began after
  its write returned. A failed write or sync makes that copy fail (counted), never raises.
- `read_blocks` verifies each copy (header checksum, expected block id, layout, payload
  checksum, codec); a copy that fails is reported so and counted, never returned.
- A capacity lowered since the last start cuts the slabs (`slabs.open_slabs`) when the tier
  opens; `cut_copies` is how many valid headers the cut slots held (`scan.count_past`).
- `scan()` reads every header region and returns the valid copies; the store rebuilds its index
  from them (`index/restore.py`) and hands back the slots it keeps. A tier whose directory had
  no superblock and no slab when it opened (its slabs were just created, zero-filled) and that
  has written no copy since skips the reads: every slot is empty.
- The directory is private and the tier's alone: created 0700 (one any group or other user can
  write is refused, `private_files.private_dir`), locked for the tier's life (`lock.py`: a
  second store on it is refused, naming the holder's pid), its files opened without following
  links; a damaged superblock or slab path is a `DamagedDiskError` naming the file, and a
  superblock it cannot write (a full or read-only filesystem) a `ConfigError` naming the path.
- `check()` fails (`InvariantError`) once a slab is no longer the file its path names (deleted,
  moved or replaced by hand while the tier runs): its writes since are lost at the next start.
- `free` retires copies as it frees their slots (a failed retire is counted: the copy is still
  verified when read); `free_durably` also syncs them and says how many may still come back at
  the next start (a clear needs to know).
- `keep` notes copies recovery left in free slots (namespaces the config does not know), by
  tenant id; a slot allocated since is no longer noted (its copy is being overwritten), and
  `retire_kept` retires those of some tenants (or all) durably, for a clear or reset.
- A refused write (copy, sync or retire) starts a backoff (`slab_set.WriteBackoff`):
  `accepting_writes()` is False while it lasts, and the mover plans no background write to this
  tier meanwhile.
  `write_status()` reports the refused writes, the current backoff and the last error.
The tier does not decide what to evict; the index and the demoter do.

`DiskTier` is the face of the tier: it owns the directory's lock, the slab files, the I/O
threads and the slot allocator, and hands each path to its own part over one `SlabSet`
(`slab_set.py`: slot -> slab and offset, batch syncs; `DiskHealth` there counts the faults and
keeps the write backoff): `copies.py` (group-commit writes), `reads.py` (checked reads), both
seeing blocks as bytes through `views.py`, `retire.py` (zeroing freed slots' headers),
`scan.py` (the recovery scan).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Sequence

import torch

from kvtier.blocks import KVLayout
from kvtier.errors import ClosedError, ConfigError, InvariantError
from kvtier.private_files import private_dir
from kvtier.tiers.disk import slabs
from kvtier.tiers.disk.codec import Codec, get_codec
from kvtier.tiers.disk.copies import BlockMeta, BlockWriter
from kvtier.tiers.disk.format import header_region_size, slot_size
from kvtier.tiers.disk.geometry import DEFAULT_HASHING, MODEL_NAME_CHARS
from kvtier.tiers.disk.io import SlabFile, probe_direct
from kvtier.tiers.disk.io_pool import IOPool
from kvtier.tiers.disk.lock import DirectoryLock
from kvtier.tiers.disk.reads import VerifiedReader
from kvtier.tiers.disk.retire import CopyRetirer
from kvtier.tiers.disk.scan import ScannedCopy, ScanReport, count_past, scan_slots
from kvtier.tiers.disk.slab_set import DiskHealth, SlabSet
from kvtier.tiers.disk.slabs import check_room, check_superblock, open_slabs
from kvtier.tiers.slots import SlotAllocator

__all__ = ["BlockMeta", "DiskTier", "ScanReport", "ScannedCopy", "disk_slot_bytes"]


def disk_slot_bytes(layout: KVLayout, codec: Codec) -> int:
    """The bytes of one slot of a disk tier of `layout` in `codec` (header region and payload,
    aligned): a capacity holds `capacity // disk_slot_bytes(...)` slots."""
    header_region = header_region_size(layout.block_tokens, 32)
    return slot_size(header_region, codec.payload_bound(layout.block_bytes))


class DiskTier:
    """Slots over slab files (the `Tier` contract), group commits, verified reads, the scan."""

    name = "disk"

    def __init__(
        self,
        layout: KVLayout,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        codec: Codec | str = "none",
        fsync: str = "batch",
        workers: int = 8,  # I/O in flight; deeper queues keep NVMe (and this VM's disk) busy
        hashing: str = DEFAULT_HASHING,  # `hashing.algorithm`: the block ids
    ) -> None:
        self.layout = layout
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self.fsync = fsync
        self.header_region = header_region_size(layout.block_tokens, 32)
        self.payload_bytes = self.codec.payload_bound(layout.block_bytes)  # quantized: smaller
        self.slot_bytes = disk_slot_bytes(layout, self.codec)
        fit = capacity_bytes // self.slot_bytes
        if fit < 1:
            raise ConfigError(
                "tiers.disk.capacity",
                capacity_bytes,
                f"at least one slot of {self.slot_bytes} bytes",
            )
        # fixed by the geometry alone, so a change of capacity never changes where slots are
        self.slots_per_slab = max(1, slabs.SLAB_TARGET_BYTES // self.slot_bytes)
        self._health = DiskHealth()  # shared with the copies that run on mover threads
        self.faults = self._health.counts
        self.backoff = self._health.backoff
        # absolute: `check()` looks its slabs up by path, and a process that embeds the store
        # may change its working directory (a relative `./kvtier-data` then named nothing)
        self.path = private_dir(path, "tiers.disk.path").absolute()
        self._lock = DirectoryLock(self.path, "tiers.disk.path")  # before anything is read
        self._io = IOPool(workers)
        self._closed = False
        self._slab_files: list[SlabFile] = []
        try:
            self.direct = probe_direct(self.path)
            geometry = {
                "format": 1,
                "slot_bytes": self.slot_bytes,
                "header_region": self.header_region,
                "slots_per_slab": self.slots_per_slab,
                "layout": self.layout.fingerprint.hex(),
                "itemsize": self.layout.itemsize,
                "hashing": hashing,  # another algorithm: none of the copies could be found
                "model": {  # what `layout` fingerprints, readable: a refusal names the change
                    "name": layout.model_name[:MODEL_NAME_CHARS],
                    "num_layers": layout.num_layers,
                    "num_kv_heads": layout.num_kv_heads,
                    "head_dim": layout.head_dim,
                    "dtype": layout.dtype_name,
                    "block_tokens": layout.block_tokens,
                },
            }
            if self.codec.lossy:  # what `kvtier check` needs to decode the copies
                geometry["quant"] = {
                    "codec": self.codec.name,
                    "block_shape": list(layout.block_shape),
                    "dtype": layout.dtype_name,
                }
            # a new directory: its slabs are created now, zero-filled, and hold no copy
            check_room(self.path, fit * self.slot_bytes, "tiers.disk.capacity")  # before writing
            try:  # a full or read-only filesystem: a typed refusal (it was a raw OSError)
                self._unwritten = check_superblock(self.path, geometry)
            except OSError as exc:
                expected = f"a directory it can write its superblock into ({exc.strerror})"
                raise ConfigError("tiers.disk.path", str(self.path), expected) from None
            # the copies a lowered capacity cuts when the slabs open, for recovery's status
            self.cut_copies = count_past(
                self.path, fit, self.slot_bytes, self.slots_per_slab, self.header_region
            )
            self._slab_files = open_slabs(
                self.path, fit, self.slot_bytes, self.slots_per_slab, self.direct, self.faults
            )
            slab_set = SlabSet(
                self._slab_files, self.slot_bytes, self.slots_per_slab, fsync, self._io
            )
            self.num_slots = slab_set.num_slots
            if self.num_slots == 0:
                raise ConfigError("tiers.disk.path", str(self.path), "room for at least one slab")
        except BaseException:
            self.close()  # the lock too: a failed start leaves the directory to the next one
            raise
        self._slots = SlotAllocator("disk", self.num_slots)
        self._slabs = slab_set  # a view: the tier opened the files and the pool, and closes them
        self._writer = BlockWriter(layout, self.codec, self.header_region, slab_set, self._health)
        self._reader = VerifiedReader(
            layout, self.codec, self.header_region, slab_set, self._health
        )
        self._retirer = CopyRetirer(self.header_region, slab_set, self._health)
        self._kept: dict[int, str] = {}  # free slot -> tenant id of the copy left in it

    # ---- slots (the same contract as SlotPool) ---------------------------------------------

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_used(self) -> int:
        return self._slots.num_used

    @property
    def used_bytes(self) -> int:
        """Slots in use times `slot_bytes` (header and aligned payload): in `capacity_bytes`'s
        unit, so that used / capacity is the tier's occupancy (1 when no slot is free)."""
        return self._slots.num_used * self.slot_bytes

    def can_allocate(self, n: int) -> bool:
        return self._slots.can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        self._ensure_open()
        slots = self._slots.allocate(n)
        if self._kept:  # a kept copy's slot taken: the copy is overwritten, no longer kept
            for slot in slots:
                self._kept.pop(slot, None)
        return slots

    def free(self, slots: Sequence[int]) -> None:
        """Free slots and retire their copies: the header region is zeroed, so that a restart
        does not bring back a block the store dropped (evicted, or found corrupt). Not synced:
        a copy that comes back after a power loss is still a valid copy of its block."""
        self._slots.validate(slots, "free")
        if not self._closed:
            self._retirer.retire(slots)  # a copy left behind is verified when read
        self._slots.free(slots)

    def free_durably(self, slots: Sequence[int]) -> int:
        """Free slots, retire their copies and sync the retirement (under `fsync: none` too); return
        how many copies the disk refused to retire (or to sync): those blocks may come back at
        the next start. 0 means that the drop is durable."""
        self._slots.validate(slots, "free")
        left = len(slots) if self._closed else self._retirer.retire_durably(slots)
        self._slots.free(slots)
        return left

    def keep(self, copies: dict[int, str]) -> None:
        """Note valid copies left in free slots (slot -> the tenant id in its header: recovery's
        copies of namespaces the config does not know), for `retire_kept`."""
        assert not any(self._slots.is_allocated(slot) for slot in copies)
        self._kept.update(copies)

    @property
    def num_kept(self) -> int:
        """The noted copies still in their free slots (no allocation has taken them)."""
        return len(self._kept)

    def retire_kept(self, tenants: Collection[str] | None) -> tuple[int, int]:
        """Retire durably the noted copies of `tenants` (of every tenant when None) that are
        still in their free slots, and forget them; return (how many, how many of them the
        disk refused to retire or sync: those may come back at the next start)."""
        slots = [s for s, t in self._kept.items() if tenants is None or t in tenants]
        for slot in slots:
            del self._kept[slot]
        if not slots:
            return 0, 0
        return len(slots), len(slots) if self._closed else self._retirer.retire_durably(slots)

    def accepting_writes(self) -> bool:
        """False while the tier backs off after refused writes: plan no background write."""
        return self._health.accepting_writes()

    def write_status(self) -> dict[str, object]:
        """Refused writes (copies, syncs, retires) so far, the current backoff in seconds (0
        while the disk takes writes) and the last refusal, for the tier's status."""
        return self._health.write_status()

    def is_allocated(self, slot: int) -> bool:
        return self._slots.is_allocated(slot)

    def claim(self, slots: Sequence[int]) -> None:
        """Mark recovered slots as used (after `scan`, before any allocation)."""
        assert self._slots.num_used == 0
        self._slots.claim(slots)

    # ---- I/O ---------------------------------------------------------------------------------

    def write_blocks(
        self,
        slots: Sequence[int],
        blocks: torch.Tensor | Sequence[torch.Tensor],
        metas: Sequence[BlockMeta],
        encoded: bool = False,
    ) -> list[bool]:
        """Write one copy per slot and make the batch durable; True where it is. `blocks` is a
        `[n, *block_shape]` tensor or n block tensors (e.g. views of pool slots, written in
        place when they are page-aligned); with `encoded`, payloads of this tier's quantized
        codec, written as they are (a quantized host tier's). See `copies.py`."""
        self._ensure_open()
        self._unwritten = False
        return self._writer.write_blocks(slots, blocks, metas, encoded)

    def read_blocks(
        self,
        slots: Sequence[int],
        block_ids: Sequence[bytes],
        out: Sequence[torch.Tensor] | None = None,
        encoded: bool = False,
    ) -> tuple[torch.Tensor | Sequence[torch.Tensor], list[bool]]:
        """Read and verify copies into `out` (n block tensors, e.g. pool slots; a new
        `[n, *block_shape]` tensor when None) and say, per block, whether it is valid. With
        `encoded`, the payloads of this tier's quantized codec as they are (`[n,
        payload_bytes]` uint8; a copy in another codec is not valid). A destination whose copy
        failed holds garbage. See `reads.py`."""
        self._ensure_open()
        return self._reader.read_blocks(slots, block_ids, out, encoded)

    def scan(self, progress: bool | None = None) -> ScanReport:
        """Read every header region; the valid copies of this layout, and what was not valid.
        The progress goes to stderr when `progress`, or when None and stderr is a terminal.
        New copies are numbered above every copy found. See `scan.py`. A tier whose
        directory was new when it opened, and that has written nothing since, holds no copy:
        every slot is reported empty without a read."""
        self._ensure_open()
        if self._unwritten:
            return ScanReport(empty=self.num_slots)
        show = sys.stderr.isatty() if progress is None else progress
        report = scan_slots(
            self._slabs, self.header_region, self.layout.fingerprint, self._health, show
        )
        self._writer.resume_after(max((copy.header.seq for copy in report.copies), default=0))
        return report

    # ---- consistency and shutdown ----------------------------------------------------------

    def check(self) -> None:
        """Free list, bitmap and count agree (`SlotAllocator.check`), and each slab is still the
        file its path names: one deleted, moved or replaced under the running tier (an `rm` or
        `mv` by hand) keeps taking writes that the next start never sees, so every copy it
        acknowledged since is lost then; an `InvariantError` naming it (`/v1/admin/check`)."""
        self._slots.check()
        for slab in [] if self._closed else self._slab_files:
            if not slab.is_at_path():
                raise InvariantError(
                    f"disk: slab {slab.path} is no longer the file the tier writes (deleted, "
                    "moved or replaced while it ran): what it wrote since is lost at the next "
                    "start; put the file back, or stop the store"
                )

    def close(self) -> None:
        """Stop the I/O threads (what is queued runs first), close the slabs, then give the
        directory's lock up. In that order: a job still queued or running when the slabs
        closed used a descriptor number the process may have given to another file since."""
        if self._closed:
            return
        self._closed = True
        self._io.close()
        for slab in self._slab_files:
            slab.close()
        self._lock.release()

    def _ensure_open(self) -> None:
        if self._closed:
            raise ClosedError("the disk tier is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (
            f"DiskTier({self.path}, {self.num_used}/{self.num_slots} slots, direct={self.direct})"
        )
