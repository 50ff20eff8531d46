"""The store's status as plain data (DESIGN "Status and metrics").

Every figure is read from the live objects when asked: capacity and use from the pools,
residency from the index, leases from the lease table, bytes moved from the executor; only
event counts (hits, demotions, ...) are counters, because events leave no other trace.
Field names are the API of `GET /v1/status` (issue 6): add fields, never rename them. A store
without a host tier (`tiers.host: null`) has no `host` entry in `tiers` (nor in /metrics, which
reads this), and no path to or from host.

Two views (`KVStore.status(tenant)`):
- `store_status`: the global figures, for the admin;
- `tenant_status`: one tenant's own figures and nothing else: its blocks per tier (its
  namespace's copies), what it holds against its quota, its floors, its leases, and its own
  operation counters (`TenantCounters`). Nothing in it moves with another tenant's activity
  (no used bytes, free slots, mover or path figures, global hits), with one exception that
  every shared cache has: its blocks above its floor may be evicted for another tenant, and
  its block counts then fall, as its own lookups would show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.tiers.quantized import QuantPool
from kvtier.transfer.shared import TENANT_OPS

if TYPE_CHECKING:
    from kvtier.assembly import Parts


@dataclass
class TenantCounters:
    """One tenant's events since start: `ops` (TENANT_OPS); `hits[t]`, the blocks its
    lookups found whose fastest copy was in tier t; `cleared[t]`, its blocks a reset or an
    admin clear dropped whose fastest copy was in tier t (the global `cleared` is their sum
    over tenants). The store adds to these and to the global counters in the same call."""

    num_tiers: int
    ops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENANT_OPS, 0))
    hits: list[int] = field(init=False)
    cleared: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.hits = [0] * self.num_tiers
        self.cleared = [0] * self.num_tiers


def store_status(parts: Parts) -> dict[str, Any]:
    index = parts.state.index
    # leases of clients only: the mover's pins are its own business (mover.in_flight)
    leased_blocks = [
        index.leases.locked_blocks(tier, pins=False) for tier in range(len(parts.pools))
    ]
    tiers = {}
    for tier, (pool, counters) in enumerate(zip(parts.pools, parts.state.counters, strict=True)):
        if tier not in parts.state.present:  # no host tier: nothing to report
            continue
        moved_out = sum(n for (src, _), n in parts.executor.bytes_moved.items() if src == pool.name)
        moved_in = sum(n for (_, dst), n in parts.executor.bytes_moved.items() if dst == pool.name)
        tiers[pool.name] = {
            "location": pool.location,
            "capacity_bytes": pool.capacity_bytes,
            "used_bytes": pool.used_bytes,
            "slots": pool.num_slots,
            "free_slots": pool.num_free,
            "blocks": index.resident(tier),
            **_held_slots(parts, tier),
            "dirty_blocks": index.residency.only_in(tier),
            "leased_blocks": leased_blocks[tier],
            "hits": counters.hits,
            "promotions": counters.promotions,
            "demotions": counters.demotions,
            "evictions": counters.evictions,
            "cleared": sum(own.cleared[tier] for own in parts.tenant_counters.values()),
            "bytes_in": moved_in,
            "bytes_out": moved_out,
        }
    paths = {
        f"{src}->{dst}": {
            "bytes": nbytes,
            "recent_bytes_per_s": round(parts.executor.recent_bandwidth((src, dst))),
        }
        for (src, dst), nbytes in sorted(parts.executor.bytes_moved.items())
    }
    host = parts.state.host
    if host.name in tiers:
        tiers[host.name]["codec"] = host.codec.id if isinstance(host, QuantPool) else "none"
    if parts.state.disk is not None:
        tiers["disk"]["direct_io"] = parts.state.disk.direct
        tiers["disk"]["codec"] = parts.state.disk.codec.name
        tiers["disk"]["faults"] = dict(parts.state.disk.faults)
        # copies of namespaces the config does not know, in free slots (not in used_bytes)
        tiers["disk"]["kept_blocks"] = parts.state.disk.num_kept
        tiers["disk"].update(
            parts.state.disk.write_status()
        )  # refused_writes, backoff_s, last error
        # reads and writes share the device: together, over the time either ran, is it busy?
        disk = parts.state.disk.name
        disk_paths = [path for path in parts.executor.bytes_moved if disk in path]
        tiers["disk"]["recent_bytes_per_s"] = round(
            parts.executor.recent_bandwidth(*disk_paths) if disk_paths else 0.0
        )
    lookups = parts.state.ops["lookup_tokens"]
    extra: dict[str, Any] = {}  # sections of the parts a config may leave out
    if parts.remote is not None:
        extra["remote"] = parts.remote.status()
    if parts.events is not None:  # KV events: what routers were told, and what was lost
        extra["events"] = {"topic": parts.events.topic, **parts.events.stats()}
    return {
        **extra,
        "layout": _layout(parts),
        "tiers": tiers,
        "paths": paths,
        "index": {
            "blocks": index.num_blocks,
            "nodes": index.num_nodes,
            "namespaces": index.num_namespaces,
            "tenants": len(parts.config.tenants),
            "leases": len(parts.mover.book.ids()),  # clients' (not the pins of reservations)
            "reservations": len(parts.reservations),  # live ones
        },
        "policy": {"write": parts.policy.name},
        "mover": {
            **parts.mover.status(),
            "backpressure_drops": parts.demoter.backpressure_drops,
            # how the store's in-call memory copies move, per kind of copy (transfer/planner.py)
            "copy_choices": {
                str(key): name for key, name in parts.executor.copier.planner.choices.items()
            },
        },
        "recovery": dict(parts.recovery),
        "ops": dict(parts.state.ops),
        "hit_rate": parts.state.ops["hit_tokens"] / lookups if lookups else 0.0,
    }


def tenant_status(parts: Parts, tenant: str, namespace: bytes) -> dict[str, Any]:
    """`tenant`'s own figures (module doc); `namespace` is its namespace. Store lock held."""
    index = parts.state.index
    limits = parts.shares.limits[tenant]
    counters = parts.tenant_counters[tenant]
    held = index.leases.held_blocks(namespace)
    tiers: dict[str, dict[str, Any]] = {}
    for tier, pool in enumerate(parts.pools):
        if tier not in parts.state.present:
            continue
        reserved = parts.reservations.held(tier, tenant) if tier < len(parts.memory) else 0
        quota = limits.quota[tier]
        tiers[pool.name] = {
            "capacity_bytes": pool.capacity_bytes,
            "slots": pool.num_slots,
            "blocks": index.resident_in(namespace, tier),
            "reserved_blocks": reserved,
            "held_blocks": reserved + (held if tier == 0 else 0),
            "quota_blocks": quota,
            "floor_blocks": limits.floor[tier],
            "hits": counters.hits[tier],
            "cleared": counters.cleared[tier],
        }
    ops = dict(counters.ops)
    lookups = ops["lookup_tokens"]
    return {
        "tenant": tenant,
        "layout": _layout(parts),
        "tiers": tiers,
        "leases": {"live": parts.mover.book.leases_of(tenant), "quota": limits.leases},
        "locked_blocks": held,  # what its leases and reservation pins lock (counted on gpu)
        "ops": ops,
        "hit_rate": ops["hit_tokens"] / lookups if lookups else 0.0,
    }


def _held_slots(parts: Parts, tier: int) -> dict[str, int]:
    """The slots of `tier` in use that hold no block of the index: `reserved_slots`, those of
    reservations (live ones and `quarantined_slots`, those of expired ones until their grace
    ends), and `in_flight_slots`, those of the mover's copies not yet in the index. So
    `slots - free_slots == blocks + reserved_slots + in_flight_slots` (read under the store's
    lock), and `used_bytes == (slots - free_slots) * slot_bytes`."""
    memory = tier < len(parts.memory)  # reservations hold memory tiers only
    reservations = parts.reservations
    return {
        "slot_bytes": parts.pools[tier].capacity_bytes // max(1, parts.pools[tier].num_slots),
        "reserved_slots": reservations.held(tier) if memory else 0,
        "quarantined_slots": reservations.quarantined(tier) if memory else 0,
        "in_flight_slots": parts.mover.reserved(tier),
    }


def _layout(parts: Parts) -> dict[str, Any]:
    layout = parts.config.layout
    return {
        "model": layout.model_name,
        "block_tokens": layout.block_tokens,
        "block_bytes": layout.block_bytes,
        "dtype": layout.dtype_name,
    }
