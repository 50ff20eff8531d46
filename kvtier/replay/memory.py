"""The host memory a replay's stores map at once, checked against what is available before any
of them opens.

A memory tier's buffer is an anonymous mapping that the kernel commits page by page as blocks
are written (`tiers/pool.py`); a store refuses tiers that do not fit the memory available
together (`preflight.py`), but each store alone. A fleet of N replicas (`--replicas N`,
`replicas.py`), each within memory, opened all the same, and the replay then filled them until
the kernel killed a process (the replay's or a neighbour's). `check_memory` refuses that up
front, naming the sizes; it counts what the tiers may hold, as a single store's own check does,
not what a given trace will write.
"""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.errors import InvalidArgumentError
from kvtier.sizes import format_size
from kvtier.tiers.gpu import resolve_device
from kvtier.tiers.memory import available_host_bytes


def host_bytes(config: KVTierConfig) -> int:
    """The host memory one store of `config` maps: its host tier, and its gpu tier when that
    lives on the CPU (capacities in bytes, as `runner.replay_config` gives them)."""
    tiers = config.tiers
    total = 0
    if tiers.host is not None:
        total += tiers.host.capacity.nbytes or 0
    if resolve_device(tiers.gpu.device).type == "cpu":
        total += tiers.gpu.capacity.nbytes or 0
    return total


def check_memory(config: KVTierConfig, stores: int = 1) -> None:
    """`InvalidArgumentError` unless `stores` stores of `config`, open at once, map at most
    the host memory available now (module doc)."""
    each = host_bytes(config)
    available = available_host_bytes()
    if each * stores > available:
        many = f"{stores} stores x " if stores > 1 else ""
        raise InvalidArgumentError(
            f"--gpu / --host{' / --replicas' if stores > 1 else ''}: got memory tiers of "
            f"{many}{format_size(each)} ({each * stores} bytes of host memory, open at once), "
            f"expected at most the {format_size(available)} available here (smaller tiers, "
            "--block-bytes" + (" or fewer --replicas)" if stores > 1 else ")")
        )
