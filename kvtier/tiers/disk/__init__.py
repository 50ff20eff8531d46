"""The disk tier: self-describing block copies in preallocated slab files.

`format.py` (the slot header), `codec.py` (payload codecs), `io.py` (aligned, parallel,
O_DIRECT file I/O), `slabs.py` (the validated superblock, the slab files), `lock.py` (one
process per directory), `backoff.py` (waiting out a disk that refuses writes), `tier.py`
(`DiskTier`: slots, group commit, verified reads, the recovery scan), `check.py` (the offline
`kvtier check`).
"""

from kvtier.tiers.disk.tier import BlockMeta, DiskTier, ScannedCopy, ScanReport

__all__ = ["BlockMeta", "DiskTier", "ScanReport", "ScannedCopy"]
