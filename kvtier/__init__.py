"""kvtier: a tiered KV-cache store for LLM inference (GPU HBM, host RAM, NVMe files).

The public API is `KVStore` (in-process) with its result types and `load_config`; errors are in
`kvtier.errors`. See README.md and docs/ARCHITECTURE.md.

The names below load on first use (PEP 562), not with the package: `import kvtier.errors` or
the `kvtier` program (`program.py`) imports no torch until a module that needs it does, so that
a Ctrl-C in the seconds torch takes to load is answered as the program answers one later.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig, load_config, parse_config
    from kvtier.results import Lease, LeaseState, LoadResult, LookupResult, StoreResult
    from kvtier.store import KVStore

_HOMES = {
    "KVStore": "kvtier.store",
    "KVTierConfig": "kvtier.config",
    "Lease": "kvtier.results",
    "LeaseState": "kvtier.results",
    "LoadResult": "kvtier.results",
    "LookupResult": "kvtier.results",
    "StoreResult": "kvtier.results",
    "load_config": "kvtier.config",
    "parse_config": "kvtier.config",
}
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


def __getattr__(name: str) -> Any:
    """`kvtier.KVStore` and the other public names, imported from their modules at first use
    (then kept in the package, as an eager import would)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
