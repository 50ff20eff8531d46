"""The disk tier: self-describing block copies in preallocated slab files.

`format.py` (the slot header), `codec.py` (payload codecs), `io.py` (aligned, parallel,
O_DIRECT file I/O), `slabs.py` (the validated superblock, the slab files), `lock.py` (one
process per directory), `tier.py` (`DiskTier`, the tier's front: slots, and each path handed
to its part), `slab_set.py` (the slabs as one array of slots; fault counts and the backoff from
a disk that refuses writes), `copies.py` (group-commit writes and checked reads), `retire.py`
(freeing copies durably), `scan.py` (the recovery scan), `check.py` (the offline `kvtier
check`).
"""

from kvtier.tiers.disk.copies import BlockMeta
from kvtier.tiers.disk.scan import ScannedCopy, ScanReport
from kvtier.tiers.disk.tier import DiskTier

__all__ = ["BlockMeta", "DiskTier", "ScanReport", "ScannedCopy"]
