"""`kvtier check PATH [--fix]`: an offline consistency check of a disk tier's directory.

Reads the geometry from the superblock, then every slot whole (header and payload), and sorts
the slots into:

- `valid`: header and payload checksums pass, the codec decodes to the recorded size;
- `empty`: never written, or retired;
- `corrupt_headers` / `corrupt_payloads`: a torn or damaged copy;
- `foreign`: a valid copy of another layout than the superblock's;
- `duplicates`: older copies of a block id that a newer valid copy also holds;
- `orphans`: valid copies whose chain of parents does not reach their namespace seed.

A running store would discard or refuse every one of these anyway (at recovery or at read);
`--fix` retires them now (zeroes their header region and syncs), so that the next start does
not scan them again and `kvtier check` comes back clean. The store must not be running: the
check takes the directory's lock (`lock.py`) and is refused, naming the holder's pid, while a
store has it; like a store, it makes the directory 0700 and the slabs 0600 (`lock.py`,
`SlabFile`). The superblock is validated like any disk bytes (`slabs.read_superblock`): a
damaged one, or a slab path that is not a regular file of one link (`slabs.own_slab`), is a
`DamagedDiskError` naming the file, which `kvtier check` reports as a problem (exit status 1).
A slab is read up to `slots_per_slab` slots, so a slab longer than its geometry never sends a
retire elsewhere. A slot the file ends inside (a slab truncated mid-slot) is read as the store
reads it once it has given the slab its length back: the bytes that are there, then zeros, so
a torn header there is a corrupt header to both. Block ids are not re-hashed here (the hash
algorithm is a store setting); recovery does that.

Every header is untrusted, as at recovery: a copy is valid only as the store would take it.
A raw size larger than a block of this geometry can be (`_raw_bound`) is a corrupt payload,
never decoded (a size read off a disk never sizes an allocation); a sequence number the store's
scan refuses (`scan.MAX_SEQ`) is a corrupt header; a parent chain that runs in a cycle (a
block id equal to its namespace seed) reaches no seed, so its copies are orphans. Only the
files `slabs.slab_files` names are slabs: a stray copy beside them is never read or retired.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.blocks import KVLayout
from kvtier.errors import ConfigError
from kvtier.tiers.disk.codec import CorruptPayload, codec_for
from kvtier.tiers.disk.format import (
    BlockHeader,
    CorruptHeader,
    checksum,
    decode_header,
    empty_header,
)
from kvtier.tiers.disk.geometry import block_shape
from kvtier.tiers.disk.io import SlabFile, probe_direct, staging_buffer
from kvtier.tiers.disk.io_pool import IOPool
from kvtier.tiers.disk.lock import DirectoryLock
from kvtier.tiers.disk.scan import MAX_SEQ
from kvtier.tiers.disk.slabs import (
    SUPERBLOCK,
    DamagedDiskError,
    own_slab,
    quant_layout,
    read_superblock,
    slab_files,
)

PROBLEMS = ("corrupt_headers", "corrupt_payloads", "foreign", "duplicates", "orphans")


@dataclass
class DiskCheckReport:
    slots: int = 0
    valid: int = 0
    empty: int = 0
    corrupt_headers: int = 0
    corrupt_payloads: int = 0
    foreign: int = 0
    duplicates: int = 0
    orphans: int = 0
    retired: int = 0
    bad_slots: list[int] = field(default_factory=list)

    @property
    def problems(self) -> int:
        return sum(getattr(self, name) for name in PROBLEMS)

    @property
    def left(self) -> int:
        """The problems still there: every one without `--fix`; with it, those a retire failed
        on (an I/O error) and slots that could not be read, which no retire tries."""
        return self.problems - self.retired


def check_directory(path: Path, fix: bool = False, progress: bool | None = None) -> DiskCheckReport:
    """Check (and with `fix`, retire the bad slots of) the disk tier in `path`."""
    geometry = read_superblock(path, "PATH")
    if geometry is None:
        raise ConfigError("PATH", str(path), f"a disk tier directory (with {SUPERBLOCK})")
    lock = DirectoryLock(path, "PATH")
    try:
        return _check(path, geometry, fix, progress)
    finally:
        lock.release()


def _check(
    path: Path, geometry: dict[str, Any], fix: bool, progress: bool | None
) -> DiskCheckReport:
    slot_bytes, region = geometry["slot_bytes"], geometry["header_region"]
    per_slab, layout = geometry["slots_per_slab"], bytes.fromhex(geometry["layout"])
    itemsize = geometry["itemsize"]
    quant = _blocks(geometry)
    sizes = (slot_bytes, region, itemsize)
    paths = {n: p for n, p in slab_files(path).items() if own_slab(p, "PATH")}
    direct = probe_direct(path)
    slabs: dict[int, SlabFile] = {}
    for number, slab_path in paths.items():
        try:
            slab = SlabFile(slab_path, 0, direct=direct, create=False)
        except OSError as exc:
            for opened in slabs.values():
                opened.close()
            expected = f"a slab file it can open ({exc.strerror})"
            raise DamagedDiskError("PATH", str(slab_path), expected) from None
        slab.size = min(-(-slab.size // slot_bytes), per_slab) * slot_bytes
        slabs[number] = slab
    report = DiskCheckReport()
    valid: dict[int, BlockHeader] = {}
    show = sys.stderr.isatty() if progress is None else progress
    with IOPool() as pool:
        jobs: list[Callable[[], tuple[int, str, BlockHeader | None]]] = []
        for number, slab in slabs.items():
            for index in range(slab.size // slot_bytes):
                slot = number * per_slab + index
                jobs.append(_inspect(slab, index * slot_bytes, slot, sizes, layout, quant))
        for start in range(0, len(jobs), 256):
            for result in pool.run(jobs[start : start + 256]):
                if isinstance(result, OSError):
                    report.corrupt_headers += 1
                    continue
                slot, verdict, header = result
                report.slots += 1
                if verdict == "valid":
                    assert header is not None
                    valid[slot] = header
                else:
                    setattr(report, verdict, getattr(report, verdict) + 1)
                    if verdict != "empty":
                        report.bad_slots.append(slot)
            if show:
                print(
                    f"\rkvtier check: {min(start + 256, len(jobs))}/{len(jobs)} slots",
                    end="",
                    file=sys.stderr,
                )
        if show:
            print(file=sys.stderr)
        _sort_valid(valid, report)
        if fix and report.bad_slots:
            blank = empty_header(region)
            retire = [
                _retire(slabs[s // per_slab], s % per_slab * slot_bytes, blank)
                for s in report.bad_slots
            ]
            report.retired = sum(not isinstance(r, OSError) for r in pool.run(retire))
            for slab in slabs.values():
                slab.sync()
    for slab in slabs.values():
        slab.close()
    return report


def _blocks(geometry: dict[str, Any]) -> KVLayout | None:
    """The shape and dtype of the directory's blocks, which decoding a quantized copy needs:
    its `quant` entry, else (a lossless tier) its `model`, as a store decodes by its layout
    whatever codec a copy records (a lossless tier's quantized copies were corrupt here, and
    `--fix` retired them, while the store served them); None for an older superblock without
    either, whose quantized copies cannot be decoded here."""
    if "quant" in geometry:
        return quant_layout(geometry["quant"])
    model = geometry.get("model")
    if model is None:
        return None
    shape, dtype = block_shape(model), model["dtype"]
    return quant_layout({"codec": "fp8", "block_shape": shape, "dtype": dtype})


def _raw_bound(payload_region: int, quant: KVLayout | None) -> int:
    """The most raw bytes a copy in a slot of `payload_region` bytes can stand for: a lossless
    copy's block fills the payload region (less its sector padding), a quantized one is a
    block of the superblock's `quant` layout."""
    return max(payload_region, quant.block_bytes if quant is not None else 0)


def _inspect(
    slab: SlabFile,
    offset: int,
    slot: int,
    geometry: tuple[int, int, int],
    layout: bytes,
    quant: KVLayout | None,
) -> Callable[[], tuple[int, str, BlockHeader | None]]:
    """One slot's verdict. `quant`: the shape and dtype of the tier's blocks (`_blocks`),
    without which a quantized copy cannot be decoded, so is corrupt."""
    slot_bytes, region, itemsize = geometry

    def job() -> tuple[int, str, BlockHeader | None]:
        image = staging_buffer(slot_bytes)
        got = slab.readv(offset, [image])
        if got < slot_bytes:  # a slot cut short reads as recovery reads it: zeros after
            image[got:] = bytes(slot_bytes - got)
        try:
            header = decode_header(image[:region])
        except CorruptHeader:
            return slot, "corrupt_headers", None
        if header is None:
            return slot, "empty", None
        if header.seq > MAX_SEQ:  # the store's scan refuses it (`scan.py`)
            return slot, "corrupt_headers", None
        if header.payload_nbytes > slot_bytes - region:
            return slot, "corrupt_payloads", header
        if header.raw_nbytes > _raw_bound(slot_bytes - region, quant):
            return slot, "corrupt_payloads", header
        stored = image[region : region + header.payload_nbytes]
        if checksum(stored) != header.payload_checksum:
            return slot, "corrupt_payloads", header
        try:
            decoded = codec_for(header.codec, quant).decode(stored, header.raw_nbytes, itemsize)
        except (CorruptPayload, ValueError):
            return slot, "corrupt_payloads", header
        if len(decoded) != header.raw_nbytes:
            return slot, "corrupt_payloads", header
        return slot, "valid" if header.layout == layout else "foreign", header

    return job


def _sort_valid(valid: dict[int, BlockHeader], report: DiskCheckReport) -> None:
    """Count duplicates (older copies of one id) and orphans among the valid copies, as
    recovery does: a copy hangs only from a parent of its own namespace, and one whose id is
    its namespace seed hangs from nothing (no hash gives the seed; its children would be the
    seed's, a cycle). So ids are unique, each copy has one parent and none is a seed: the walk
    pushes each copy once."""
    newest: dict[bytes, int] = {}
    for slot, header in valid.items():
        held = newest.get(header.block_id)
        if held is None or header.seq > valid[held].seq:
            if held is not None:
                report.duplicates += 1
                report.bad_slots.append(held)
            newest[header.block_id] = slot
        else:
            report.duplicates += 1
            report.bad_slots.append(slot)
    children: dict[tuple[bytes, bytes], list[int]] = {}
    hung = [slot for slot in newest.values() if valid[slot].block_id != valid[slot].namespace]
    for slot in hung:
        children.setdefault((valid[slot].namespace, valid[slot].parent_id), []).append(slot)
    reached: set[int] = set()
    stack = [slot for slot in hung if valid[slot].parent_id == valid[slot].namespace]
    while stack:
        slot = stack.pop()
        reached.add(slot)
        stack.extend(children.get((valid[slot].namespace, valid[slot].block_id), ()))
    for slot in newest.values():
        if slot not in reached:
            report.orphans += 1
            report.bad_slots.append(slot)
    report.valid = len(reached)


def _retire(slab: SlabFile, offset: int, blank: bytes) -> Callable[[], None]:
    def job() -> None:
        buffer = staging_buffer(len(blank))
        buffer[:] = blank
        slab.write(offset, [buffer])

    return job
