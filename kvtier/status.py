"""The store's status as plain data (DESIGN "Status and metrics").

Every figure is read from the live objects when asked: capacity and use from the pools,
residency from the index, leases from the lease table, bytes moved from the executor; only
event counts (hits, demotions, ...) are counters, because events leave no other trace.
Field names are the API of `GET /v1/status` (issue 6): add fields, never rename them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.store import KVStore


def store_status(store: KVStore) -> dict[str, Any]:
    index = store.index
    # leases of clients only: the mover's pins are its own business (mover.in_flight)
    leased_blocks = [
        index.leases.locked_blocks(tier, pins=False) for tier in range(len(store.pools))
    ]
    tiers = {}
    for tier, (pool, counters) in enumerate(zip(store.pools, store.counters, strict=True)):
        moved_out = sum(n for (src, _), n in store.executor.bytes_moved.items() if src == pool.name)
        moved_in = sum(n for (_, dst), n in store.executor.bytes_moved.items() if dst == pool.name)
        tiers[pool.name] = {
            "location": pool.location,
            "capacity_bytes": pool.capacity_bytes,
            "used_bytes": pool.used_bytes,
            "slots": pool.num_slots,
            "free_slots": pool.num_free,
            "blocks": index.resident(tier),
            "leased_blocks": leased_blocks[tier],
            "hits": counters.hits,
            "promotions": counters.promotions,
            "demotions": counters.demotions,
            "evictions": counters.evictions,
            "bytes_in": moved_in,
            "bytes_out": moved_out,
        }
    paths = {
        f"{src}->{dst}": {
            "bytes": nbytes,
            "recent_bytes_per_s": round(store.executor.recent_bandwidth((src, dst))),
        }
        for (src, dst), nbytes in sorted(store.executor.bytes_moved.items())
    }
    if store.disk is not None:
        tiers["disk"]["direct_io"] = store.disk.direct
        tiers["disk"]["compression"] = store.disk.codec.name
        tiers["disk"]["faults"] = dict(store.disk.faults)
    lookups = store.ops["lookup_tokens"]
    return {
        "layout": {
            "model": store.layout.model_name,
            "block_tokens": store.layout.block_tokens,
            "block_bytes": store.layout.block_bytes,
            "dtype": store.layout.dtype_name,
        },
        "tiers": tiers,
        "paths": paths,
        "index": {
            "blocks": index.num_blocks,
            "nodes": index.num_nodes,
            "namespaces": index.num_namespaces,
            "tenants": len(store.config.tenants),
            "leases": len(index.leases),
        },
        "policy": {"write": store.policy.name},
        "mover": {
            **store.mover.status(),
            "backpressure_drops": store.demoter.backpressure_drops,
            # how the store's in-call memory copies move, per kind of copy (transfer/planner.py)
            "copy_choices": {
                str(key): name for key, name in store.executor.copier.planner.choices.items()
            },
        },
        "recovery": dict(store.recovery),
        "ops": dict(store.ops),
        "hit_rate": store.ops["hit_tokens"] / lookups if lookups else 0.0,
    }
