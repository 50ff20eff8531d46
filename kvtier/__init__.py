"""kvtier: a tiered KV-cache store for LLM inference (GPU HBM, host RAM, NVMe files).

The public API is `KVStore` (in-process) with its result types and `load_config`; errors are in
`kvtier.errors`. See README.md and docs/ARCHITECTURE.md.

The names below load on first use (PEP 562), not with the package: `import kvtier.errors` or
the `kvtier` program (`program.py`) imports no torch until a module that needs it does, so that
a Ctrl-C in the seconds torch takes to load is answered as the program answers one later. A
submodule is an attribute of the package as it was when the package imported them all
(`kvtier.errors.KVTierError` after `import kvtier`), and type checkers see the names' own
types (the lazy lookup is hidden from them: a misspelt name is still an error to mypy).
"""

from __future__ import annotations

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

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
_HELPERS = {"annotations", "TYPE_CHECKING"}  # this module's own imports, no API

if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        """`kvtier.KVStore` and the other public names, imported from their modules at first
        use, or a submodule of that name (`kvtier.errors`); then kept in the package, as an
        eager import would."""
        home = _HOMES.get(name)
        if home is not None:
            value = getattr(_import_module(home), name)
        elif name.isidentifier() and not name.startswith("_"):
            try:
                value = _import_module(f"kvtier.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"kvtier.{name}":
                    raise  # a module of kvtier that failed to import one of its own
                raise AttributeError(f"module 'kvtier' has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(n for n in globals() if not n.startswith("_"))} - _HELPERS)
