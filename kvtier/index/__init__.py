"""The radix index: token prefixes -> blocks -> per-tier residency; pure Python, no I/O."""

from kvtier.index.leases import LeaseRecord, LeaseTable
from kvtier.index.node import Node
from kvtier.index.radix import RadixIndex
from kvtier.index.results import BlockRef, InsertResult, LeaseId, Match, PrefixHit

__all__ = [
    "BlockRef",
    "InsertResult",
    "LeaseId",
    "LeaseRecord",
    "LeaseTable",
    "Match",
    "Node",
    "PrefixHit",
    "RadixIndex",
]
