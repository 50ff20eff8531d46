"""Slot pools, one per tier: `SlotPool` (the shared bookkeeping), `GpuPool`, `HostPool` (and
`NoHostPool`, the host tier of a store without one).

A pool allocates, frees, reads and writes whole blocks and accounts for its bytes exactly; it
never decides what to evict. `memory` holds the free-memory probes used to size pools.
"""

from kvtier.tiers.gpu import GpuPool
from kvtier.tiers.host import HostPool, NoHostPool
from kvtier.tiers.memory import available_host_bytes, free_device_bytes
from kvtier.tiers.pool import SlotPool

__all__ = [
    "GpuPool",
    "HostPool",
    "NoHostPool",
    "SlotPool",
    "available_host_bytes",
    "free_device_bytes",
]
