"""The recovery scan: every slot's header region read once at start, sorted into what it holds.

    slot header region  ->  empty    (never written, or retired: zeroed)
                            corrupt  (torn or damaged header, or a failed read)
                            foreign  (a valid header of another layout)
                            a copy   (`ScannedCopy`: the slot and its header)

Contract:
- `scan_slots` reads the header regions only (never a payload) in batches of `SCAN_BATCH`
  slots, in parallel, in slot order, and changes nothing on disk; a failed read counts as
  corrupt (and in the tier's `read_errors`).
- The copies it returns are valid headers of this layout; their payloads are checked when read
  (`copies.py`). The store rebuilds its index from them (`index/restore.py`) and hands
  back the slots it keeps (`DiskTier.claim`).
- A header numbered above `MAX_SEQ` counts as corrupt: the tier numbers its next copies above
  the newest one found, and a header holds at most 2**64-1, so one planted copy numbered near
  that would have every later write refused (the disk tier silently taking nothing more).
  No tier writes 2**63 copies (at a million a second, 292,000 years).
- `count_past(path, slots, ...)` counts the valid headers (any layout) in the slots at and past
  `slots` of the slab files in `path`, reading header regions only and changing nothing: the
  copies a capacity lowered to `slots` cuts when the tier opens (`slabs.open_slabs`), for
  `status()["recovery"]["cut"]`: one header read a slot, at most `MAX_COUNTED` of them (a
  lower bound past that, so that a cut of a huge tier does not hold start-up), a slab that
  cannot be read counted as far as it could be; it never raises.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import KVTierError
from kvtier.tiers.disk.format import BlockHeader, CorruptHeader, decode_header
from kvtier.tiers.disk.io import aligned_buffer
from kvtier.tiers.disk.slab_set import DiskHealth, SlabSet
from kvtier.tiers.disk.slabs import regular_file, slab_files

SCAN_BATCH = 1024
MAX_SEQ = 2**63 - 1
"""The highest copy number a scan takes (module doc); `kvtier check` agrees (`check.py`)."""
MAX_COUNTED = 2**18
"""`count_past` reads at most this many header regions (about a second or two of reads)."""


@dataclass(frozen=True, slots=True)
class ScannedCopy:
    """A valid header of this layout found in `slot` (its payload is checked when read)."""

    slot: int
    header: BlockHeader


@dataclass
class ScanReport:
    """What the scan found in every slot: the copies, and how many slots held none."""

    copies: list[ScannedCopy] = field(default_factory=list)
    empty: int = 0
    corrupt: int = 0  # torn or damaged headers
    foreign: int = 0  # another layout's copies


def scan_slots(
    slabs: SlabSet, header_region: int, layout: bytes, health: DiskHealth, show: bool
) -> ScanReport:
    """Read every header region of `slabs`; the valid copies of the layout whose fingerprint
    is `layout`, and what was not valid. `show` prints the progress on stderr."""
    report = ScanReport()
    total = slabs.num_slots
    for start in range(0, total, SCAN_BATCH):
        slots = range(start, min(start + SCAN_BATCH, total))
        # one mapping for the batch: a mapping a slot cost a third of a 50,000-slot scan
        batch = aligned_buffer(header_region * len(slots))
        jobs = [
            _header_job(slabs, s, batch[k * header_region : (k + 1) * header_region])
            for k, s in enumerate(slots)
        ]
        for slot, result in zip(slots, slabs.run(jobs), strict=True):
            if isinstance(result, OSError):
                health.count("read_errors", 1)
                report.corrupt += 1
                continue
            try:
                header = decode_header(result)
            except CorruptHeader:
                report.corrupt += 1
                continue
            if header is None:
                report.empty += 1
            elif header.seq > MAX_SEQ:
                report.corrupt += 1
            elif header.layout != layout:
                report.foreign += 1
            else:
                report.copies.append(ScannedCopy(slot, header))
        if show:
            done = min(start + SCAN_BATCH, total)
            print(
                f"\rkvtier: recovering disk tier {done}/{total} slots",
                end="" if done < total else "\n",
                file=sys.stderr,
            )
    return report


def _header_job(slabs: SlabSet, slot: int, buf: memoryview) -> Callable[[], memoryview]:
    """Read `slot`'s header region into `buf` (zero-filled, aligned, its own: the part of a
    slot a cut slab no longer holds reads as zeros)."""
    slab, offset = slabs.where(slot)

    def job() -> memoryview:
        slab.read_into(offset, buf)
        return buf

    return job


def count_past(path: Path, slots: int, slot_bytes: int, slots_per_slab: int, header: int) -> int:
    """Valid headers (of any layout) in slots `slots` and above of the slabs in `path`, whose
    slots are `slot_bytes` long with `header`-byte header regions, `slots_per_slab` a slab; at
    most `MAX_COUNTED` slots read (a lower bound past them), a slab that cannot be read counted
    as far as it could be (never raises: the count is a figure, not a check)."""
    found, left = 0, MAX_COUNTED
    for number, slab in sorted(slab_files(path).items()):
        first = min(slots_per_slab, max(0, slots - number * slots_per_slab))
        try:
            if not regular_file(slab, "tiers.disk.path"):  # a link: refused when slabs open
                continue
            fd = os.open(slab, os.O_RDONLY | os.O_NOFOLLOW)
        except (OSError, KVTierError):
            continue
        try:
            end = min(slots_per_slab, os.fstat(fd).st_size // slot_bytes, first + left)
            for local in range(first, end):
                left -= 1
                try:
                    found += decode_header(os.pread(fd, header, local * slot_bytes)) is not None
                except CorruptHeader:
                    continue
        except OSError:
            pass  # a read error: the rest of this slab uncounted
        finally:
            os.close(fd)
    return found
