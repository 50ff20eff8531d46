"""Slot pools, one per tier: `SlotPool` (the shared bookkeeping), `GpuPool`, `HostPool`.

A pool allocates, frees, reads and writes whole blocks and accounts for its bytes exactly; it
never decides what to evict. `memory` holds the free-memory probes used to size pools.
"""

from kvtier.tiers.gpu import GpuPool
from kvtier.tiers.host import HostPool
from kvtier.tiers.memory import available_host_bytes, free_device_bytes
from kvtier.tiers.pool import SlotPool

__all__ = ["GpuPool", "HostPool", "SlotPool", "available_host_bytes", "free_device_bytes"]
