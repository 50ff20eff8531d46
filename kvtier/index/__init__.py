"""The radix index: token prefixes -> blocks -> per-tier residency; pure Python, no I/O."""

from kvtier.index.leases import LeaseRecord, LeaseTable, push_expiry
from kvtier.index.node import BlockRef, InsertResult, LeaseId, Match, Node, PrefixHit
from kvtier.index.radix import RadixIndex

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
    "push_expiry",
]
