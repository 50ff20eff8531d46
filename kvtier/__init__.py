"""kvtier: a tiered KV-cache store for LLM inference (GPU HBM, host RAM, NVMe files).

The public API is `KVStore` (in-process) with its result types and `load_config`; errors are in
`kvtier.errors`. See README.md and docs/ARCHITECTURE.md.
"""

from kvtier.config import KVTierConfig, load_config, parse_config
from kvtier.results import Lease, LeaseState, LoadResult, LookupResult, StoreResult
from kvtier.store import KVStore

__all__ = [
    "KVStore",
    "KVTierConfig",
    "Lease",
    "LeaseState",
    "LoadResult",
    "LookupResult",
    "StoreResult",
    "load_config",
    "parse_config",
]
__version__ = "0.1.0"
