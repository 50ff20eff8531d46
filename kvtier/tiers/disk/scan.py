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
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.tiers.disk.format import BlockHeader, CorruptHeader, decode_header
from kvtier.tiers.disk.io import aligned_buffer
from kvtier.tiers.disk.slab_set import DiskHealth, SlabSet

SCAN_BATCH = 1024
MAX_SEQ = 2**63 - 1
"""The highest copy number a scan takes (module doc); `kvtier check` agrees (`check.py`)."""


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
        jobs = [_header_job(slabs, header_region, s) for s in slots]
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


def _header_job(slabs: SlabSet, header_region: int, slot: int) -> Callable[[], memoryview]:
    slab, offset = slabs.where(slot)

    def job() -> memoryview:
        buf = aligned_buffer(header_region)
        slab.read_into(offset, buf)
        return buf

    return job
