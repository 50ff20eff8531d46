"""The disk tier: block copies in fixed slots of preallocated slab files on local NVMe.

    <path>/kvtier-disk.json      geometry: slot size, slots per slab, layout fingerprint
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
  and the directory itself. A filesystem that cannot hold the configured capacity gives fewer
  slabs (counted in `faults["enospc"]`), never a write that fails later for lack of space.
- `write_blocks` is a group commit: all copies of the batch are written in parallel, then each
  touched slab is synced once (`fsync: batch`; `fsync: none` skips the sync and accepts losing
  the tail on power loss). A copy is reported durable only after its sync returned. A failed
  write or sync makes that copy fail (counted), never raises.
- `read_blocks` verifies each copy (header checksum, expected block id, layout, payload
  checksum, codec); a copy that fails is reported so and counted, never returned.
- `scan()` reads every header region and returns the valid copies; the store rebuilds its index
  from them (`index/restore.py`) and hands back the slots it keeps.
- The directory is private and the tier's alone: created 0700 (one any group or other user can
  write is refused, `private_files.private_dir`), locked for the tier's life (`lock.py`: a
  second store on it is refused, naming the holder's pid), its files opened without following
  links; a damaged superblock or slab path is a `DamagedDiskError` naming the file.
- `free` retires copies as it frees their slots (a failed retire is counted: the copy is still
  verified when read); `free_durably` also syncs them and says how many may still come back at
  the next start (a clear needs to know).
- A refused write (copy, sync or retire) starts a backoff (`backoff.py`): `accepting_writes()`
  is False while it lasts, and the mover plans no background write to this tier meanwhile.
  `write_status()` reports the refused writes, the current backoff and the last error.
The tier does not decide what to evict; the index and the demoter do.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import ClosedError, ConfigError
from kvtier.layout import KVLayout
from kvtier.private_files import private_dir
from kvtier.tiers.disk import slabs
from kvtier.tiers.disk.backoff import WriteBackoff
from kvtier.tiers.disk.codec import CorruptPayload, get_codec
from kvtier.tiers.disk.format import (
    BlockHeader,
    CorruptHeader,
    checksum,
    decode_header,
    encode_header,
    header_region_size,
    slot_size,
)
from kvtier.tiers.disk.io import IOPool, SlabFile, aligned_buffer, probe_direct, staging_buffer
from kvtier.tiers.disk.lock import DirectoryLock
from kvtier.tiers.disk.slabs import check_superblock, open_slabs
from kvtier.tiers.slots import SlotAllocator

ALIGN = 4096


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a disk copy records about its block besides the payload."""

    block_id: bytes
    parent_id: bytes
    namespace: bytes
    tenant: str
    tokens: bytes


@dataclass(frozen=True, slots=True)
class ScannedCopy:
    slot: int
    header: BlockHeader


@dataclass
class ScanReport:
    copies: list[ScannedCopy] = field(default_factory=list)
    empty: int = 0
    corrupt: int = 0  # torn or damaged headers
    foreign: int = 0  # another layout's copies


class DiskTier:
    name = "disk"

    def __init__(
        self,
        layout: KVLayout,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        compression: str = "none",
        fsync: str = "batch",
        workers: int = 8,  # I/O in flight; deeper queues keep NVMe (and this VM's disk) busy
    ) -> None:
        self.layout = layout
        self.codec = get_codec(compression)
        self.fsync = fsync
        self.header_region = header_region_size(layout.block_tokens, 32)
        self.slot_bytes = slot_size(self.header_region, layout.block_bytes)
        fit = capacity_bytes // self.slot_bytes
        if fit < 1:
            raise ConfigError(
                "tiers.disk.capacity",
                capacity_bytes,
                f"at least one slot of {self.slot_bytes} bytes",
            )
        # fixed by the geometry alone, so a change of capacity never changes where slots are
        self.slots_per_slab = max(1, slabs.SLAB_TARGET_BYTES // self.slot_bytes)
        self.faults: dict[str, int] = dict.fromkeys(
            (
                "enospc",
                "write_errors",
                "sync_errors",
                "retire_errors",
                "read_errors",
                "corrupt_reads",
            ),
            0,
        )
        self.backoff = WriteBackoff()
        # copies run on mover threads beside the store's calls: `_seq` and `faults` are shared
        self._count_lock = threading.Lock()
        self._seq = 0
        self.path = private_dir(path, "tiers.disk.path")
        self._lock = DirectoryLock(self.path, "tiers.disk.path")  # before anything is read
        self._io = IOPool(workers)
        self._closed = False
        self._slabs: list[SlabFile] = []
        try:
            self.direct = probe_direct(self.path)
            geometry = {
                "format": 1,
                "slot_bytes": self.slot_bytes,
                "header_region": self.header_region,
                "slots_per_slab": self.slots_per_slab,
                "layout": self.layout.fingerprint.hex(),
                "itemsize": self.layout.itemsize,
            }
            check_superblock(self.path, geometry)
            self._slabs = open_slabs(
                self.path, fit, self.slot_bytes, self.slots_per_slab, self.direct, self.faults
            )
            self.num_slots = sum(slab.size // self.slot_bytes for slab in self._slabs)
            if self.num_slots == 0:
                raise ConfigError("tiers.disk.path", str(self.path), "room for at least one slab")
        except BaseException:
            self.close()  # the lock too: a failed start leaves the directory to the next one
            raise
        self._slots = SlotAllocator("disk", self.num_slots)

    # ---- geometry and files ---------------------------------------------------------------

    def _where(self, slot: int) -> tuple[SlabFile, int]:
        slab, index = divmod(slot, self.slots_per_slab)
        return self._slabs[slab], index * self.slot_bytes

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
        return self._slots.num_used * self.layout.block_bytes

    def can_allocate(self, n: int) -> bool:
        return self._slots.can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        self._ensure_open()
        return self._slots.allocate(n)

    def free(self, slots: Sequence[int]) -> None:
        """Free slots and retire their copies: the header region is zeroed, so that a restart
        does not bring back a block the store dropped (evicted, or found corrupt). Not synced:
        a copy that comes back after a power loss is still a valid copy of its block."""
        self._slots.validate(slots, "free")
        if not self._closed:
            self._retire(slots)  # a copy left behind is verified when read
        self._slots.free(slots)

    def free_durably(self, slots: Sequence[int]) -> int:
        """Free slots, retire their copies and sync the retirement (`fsync: batch`); return
        how many copies the disk refused to retire (or to sync): those blocks may come back at
        the next start. 0 means that the drop is durable."""
        self._slots.validate(slots, "free")
        left = len(slots)
        if not self._closed:
            retired = [slot for slot, ok in zip(slots, self._retire(slots), strict=True) if ok]
            left -= len(retired) - self._sync_slabs_of(retired)
        self._slots.free(slots)
        return left

    def _retire(self, slots: Sequence[int]) -> list[bool]:
        """Zero the header regions of `slots`; True where the write was done."""
        blank = aligned_buffer(self.header_region)
        results = self._io.run([self._retire_job(slot, blank) for slot in slots])
        self._fault("retire_errors", sum(isinstance(r, OSError) for r in results))
        self._note_writes(results)
        return [not isinstance(r, OSError) for r in results]

    def _sync_slabs_of(self, slots: Sequence[int]) -> int:
        """Sync the slabs that hold `slots` (`fsync: batch`); how many of `slots` lie in a
        slab whose sync failed."""
        if self.fsync != "batch":
            return 0
        touched = sorted({slot // self.slots_per_slab for slot in slots})
        synced = self._io.run([self._slabs[i].sync for i in touched])
        failed = {i for i, r in zip(touched, synced, strict=True) if isinstance(r, OSError)}
        self._fault("sync_errors", len(failed))
        self._note_writes(synced)
        return sum(slot // self.slots_per_slab in failed for slot in slots)

    def _note_writes(self, results: Sequence[object]) -> None:
        """Start (or lengthen) the backoff after a batch with a refused write (an `OSError`
        among the I/O `results`); end it after a batch done whole; no batch, no news."""
        error = next((r for r in results if isinstance(r, OSError)), None)
        if error is not None:
            self.backoff.refused(error)
        elif results:
            self.backoff.written()

    def accepting_writes(self) -> bool:
        """False while the tier backs off after refused writes: plan no background write."""
        return not self.backoff.waiting()

    def write_status(self) -> dict[str, object]:
        """Refused writes (copies, syncs, retires) so far, the current backoff in seconds (0
        while the disk takes writes) and the last refusal, for the tier's status."""
        with self._count_lock:
            refused = sum(self.faults[k] for k in ("write_errors", "sync_errors", "retire_errors"))
        return {
            "refused_writes": refused,
            "backoff_s": self.backoff.delay_s,
            "last_write_error": self.backoff.last_error,
        }

    def _fault(self, kind: str, count: int) -> None:
        with self._count_lock:
            self.faults[kind] += count

    def _retire_job(self, slot: int, blank: memoryview) -> Callable[[], None]:
        slab, offset = self._where(slot)
        return lambda: slab.write(offset, [blank])

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
    ) -> list[bool]:
        """Write one copy per slot and make the batch durable; True where it is. `blocks` is a
        `[n, *block_shape]` tensor or n block tensors (e.g. views of pool slots, written in
        place when they are page-aligned)."""
        self._ensure_open()
        assert len(slots) == len(metas) == len(blocks)
        raw = [block.contiguous().view(torch.uint8).reshape(-1) for block in blocks]
        jobs: list[Callable[[], None]] = []
        with self._count_lock:
            first = self._seq + 1
            self._seq += len(slots)
        for seq, (slot, meta, data) in enumerate(zip(slots, metas, raw, strict=True), first):
            jobs.append(self._write_job(slot, meta, data, seq))
        results: list[object] = list(self._io.run(jobs))
        ok = [not isinstance(r, OSError) for r in results]
        self._fault("write_errors", ok.count(False))
        if self.fsync == "batch":
            touched = sorted(
                {slot // self.slots_per_slab for slot, good in zip(slots, ok, strict=True) if good}
            )
            synced = self._io.run([self._slabs[i].sync for i in touched])
            failed = {i for i, r in zip(touched, synced, strict=True) if isinstance(r, OSError)}
            self._fault("sync_errors", len(failed))
            results += synced
            ok = [
                good and slot // self.slots_per_slab not in failed
                for slot, good in zip(slots, ok, strict=True)
            ]
        self._note_writes(results)
        return ok

    def _write_job(
        self, slot: int, meta: BlockMeta, data: torch.Tensor, seq: int
    ) -> Callable[[], None]:
        """One slot's write, run on an I/O thread: encode, checksum, header, one `pwritev`.
        A plain payload whose memory is sector-aligned (a pool slot or a gathered batch of
        whole blocks of 4 KiB multiples) is written in place; anything else is first copied
        into an aligned buffer, as O_DIRECT requires."""
        slab, offset = self._where(slot)
        region = self.header_region

        def job() -> None:
            raw = data.numpy().data
            encoded = self.codec.encode(raw, self.layout.itemsize)
            codec_name = self.codec.name
            if len(encoded) >= len(raw):  # incompressible: store it plain
                encoded, codec_name = raw, "none"
            header = BlockHeader(
                block_id=meta.block_id,
                parent_id=meta.parent_id,
                namespace=meta.namespace,
                tenant=meta.tenant,
                layout=self.layout.fingerprint,
                tokens=meta.tokens,
                codec=codec_name,
                raw_nbytes=len(raw),
                payload_nbytes=len(encoded),
                payload_checksum=checksum(encoded),
                seq=seq,
            )
            if encoded is raw and _aligned(data):
                head = staging_buffer(region)
                head[:] = encode_header(header, region)
                slab.write(offset, [head, raw])
                return
            image = staging_buffer(region + len(encoded))
            image[:region] = encode_header(header, region)
            np.frombuffer(image, dtype=np.uint8)[region : region + len(encoded)] = np.frombuffer(
                encoded, dtype=np.uint8
            )
            slab.write(offset, [image])

        return job

    def read_blocks(
        self,
        slots: Sequence[int],
        block_ids: Sequence[bytes],
        out: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | Sequence[torch.Tensor], list[bool]]:
        """Read and verify copies into `out` (n block tensors, e.g. pool slots; a new
        `[n, *block_shape]` tensor when None) and say, per block, whether it is valid. Plain
        payloads land in place when the destination is page-aligned; others go through an
        aligned staging buffer. A destination whose copy failed holds garbage."""
        self._ensure_open()
        dest: torch.Tensor | Sequence[torch.Tensor] = (
            out
            if out is not None
            else torch.empty((len(slots), *self.layout.block_shape), dtype=self.layout.dtype)
        )
        flat = [block.view(torch.uint8).reshape(-1) for block in dest]
        jobs = [self._read_job(slot, flat[i], block_ids[i]) for i, slot in enumerate(slots)]
        ok = []
        for result in self._io.run(jobs):
            if isinstance(result, OSError):
                self._fault("read_errors", 1)
                ok.append(False)
            elif not result:
                self._fault("corrupt_reads", 1)
                ok.append(False)
            else:
                ok.append(True)
        return dest, ok

    def _read_job(self, slot: int, dest: torch.Tensor, block_id: bytes) -> Callable[[], bool]:
        slab, offset = self._where(slot)
        region, payload_region = self.header_region, self.slot_bytes - self.header_region

        def job() -> bool:
            target = dest.numpy().data
            if _aligned(dest) and len(target) == payload_region:
                head = staging_buffer(region)
                slab.readv(offset, [head, target])
                payload = target
            else:
                image = staging_buffer(region + payload_region)
                slab.readv(offset, [image])
                head, payload = image[:region], image[region:]
            decoded = self._verify(head, payload, block_id)
            if decoded is None:
                return False
            if decoded is not target:
                np.frombuffer(target, dtype=np.uint8)[:] = np.frombuffer(decoded, dtype=np.uint8)
            return True

        return job

    def _verify(
        self, head: memoryview, payload: memoryview, block_id: bytes
    ) -> bytes | memoryview | None:
        """The decoded payload of a slot if every check passes, else None."""
        try:
            header = decode_header(head)
        except CorruptHeader:
            return None
        if (
            header is None
            or header.block_id != block_id
            or header.layout != self.layout.fingerprint
            or header.raw_nbytes != self.layout.block_bytes
            or header.payload_nbytes > len(payload)
        ):
            return None
        stored = payload[: header.payload_nbytes]
        if checksum(stored) != header.payload_checksum:
            return None
        if header.codec == "none":
            return stored if len(stored) == self.layout.block_bytes else None
        try:
            decoded = get_codec(header.codec).decode(
                stored, header.raw_nbytes, self.layout.itemsize
            )
        except (CorruptPayload, ValueError):
            return None
        return bytes(decoded) if len(decoded) == self.layout.block_bytes else None

    def scan(self, progress: bool | None = None) -> ScanReport:
        """Read every header region; the valid copies of this layout, and what was not valid."""
        self._ensure_open()
        report = ScanReport()
        show = sys.stderr.isatty() if progress is None else progress
        batch = 1024
        for start in range(0, self.num_slots, batch):
            slots = range(start, min(start + batch, self.num_slots))
            for slot, result in zip(
                slots, self._io.run([self._header_job(s) for s in slots]), strict=True
            ):
                if isinstance(result, OSError):
                    self._fault("read_errors", 1)
                    report.corrupt += 1
                    continue
                try:
                    header = decode_header(result)
                except CorruptHeader:
                    report.corrupt += 1
                    continue
                if header is None:
                    report.empty += 1
                elif header.layout != self.layout.fingerprint:
                    report.foreign += 1
                else:
                    report.copies.append(ScannedCopy(slot, header))
                    self._seq = max(self._seq, header.seq)
            if show:
                done = min(start + batch, self.num_slots)
                print(
                    f"\rkvtier: recovering disk tier {done}/{self.num_slots} slots",
                    end="" if done < self.num_slots else "\n",
                    file=sys.stderr,
                )
        return report

    def _header_job(self, slot: int) -> Callable[[], memoryview]:
        slab, offset = self._where(slot)

        def job() -> memoryview:
            buf = aligned_buffer(self.header_region)
            slab.read_into(offset, buf)
            return buf

        return job

    # ---- consistency and shutdown ----------------------------------------------------------

    def check(self) -> None:
        """Free list, bitmap and count agree (`SlotAllocator.check`)."""
        self._slots.check()

    def close(self) -> None:
        """Close the slabs and the I/O threads, then give the directory's lock up."""
        if self._closed:
            return
        self._closed = True
        for slab in self._slabs:
            slab.close()
        self._io.close()
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


def _aligned(tensor: torch.Tensor) -> bool:
    """Whether a tensor's memory can be handed to O_DIRECT as it is."""
    return tensor.data_ptr() % ALIGN == 0 and tensor.numel() * tensor.element_size() % ALIGN == 0
