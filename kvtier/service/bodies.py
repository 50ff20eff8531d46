"""Response bodies built from the store's objects: a lease, the pools a same-host client may
map, the configuration as given with its keys redacted, the store's checks, an admin clear
and persist.

A lease and the pools carry `instance`, the server's instance id (`admission.Service`), as a
reservation does (`plane.py`): a client reads or writes a mapped pool for slots only when the
reply that names them has the instance of the `/v1/pools` it mapped (`client/pools.py`)."""

from __future__ import annotations

from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError, UnknownTenantError
from kvtier.results import Lease
from kvtier.service import frames
from kvtier.service.cuda_ipc import export_pool
from kvtier.service.grants import Grants
from kvtier.service.wire import WireError
from kvtier.store import KVStore


def checked(store: KVStore, grants: Grants | None = None) -> dict[str, Any]:
    """What `/v1/admin/check` answers: every invariant check of the store (and of the request
    tokens' table, `grants.py`), run now."""
    try:
        store.check()
        if grants is not None:
            grants.check()
    except KVTierError as exc:
        return {"ok": False, "detail": str(exc)}
    return {"ok": True, "detail": ""}


def cleared(store: KVStore, tenant: str | None) -> dict[str, Any]:
    """What `/v1/admin/clear[?tenant=]` answers; `WireError` 404 `unknown_tenant` for a
    `tenant` the configuration does not list (and the disk holds no copy under: a removed
    tenant's are retired, `KVStore.clear`): a value the admin named, not who the caller is
    (the 403 of a data-plane call whose own tenant is unknown)."""
    try:
        return {"dropped_blocks": store.clear(tenant)}
    except UnknownTenantError as exc:  # `tenant` is the only tenant a clear names
        raise WireError(404, "unknown_tenant", f"?tenant=: {exc}") from None


def persisted(store: KVStore) -> dict[str, Any]:
    """What `/v1/admin/persist` answers: `persisted_blocks` written now, and `left_blocks`
    still without a durable disk copy (a disk smaller than the cache, or writes it refused): a
    restart would not recover those."""
    written = store.persist()
    return {"persisted_blocks": int(written), "left_blocks": written.left_blocks}


def lease(lease: Lease, instance: str, ttl_s: float | None = None) -> dict[str, Any]:
    """A lease as `/v1/prefetch` and `/v1/leases/{id}` answer it, from server `instance`; a
    prefetch's says the `ttl_s` it was granted for, counted from its grant (the client's proof
    that the lease held through a copy: `client/held.py`)."""
    return {
        "lease_id": lease.lease_id,
        "tenant": lease.tenant,
        "num_tokens": lease.num_tokens,
        "block_table": list(lease.block_table),
        "expires_at": lease.expires_at,
        "state": lease.state.value,
        "layers_ready": lease.layers_ready,
        "reason": lease.reason,
        "instance": instance,
        **({} if ttl_s is None else {"ttl_s": ttl_s}),
    }


def pools(
    store: KVStore,
    share: bool,
    lane: str | None = None,
    same_user: bool = False,
    instance: str | None = None,
) -> dict[str, Any]:
    """What a same-host client may map, from server `instance` (the app always names it). With
    `service.shared_memory` off nothing is offered, a CUDA pool's IPC handle included; so is
    `lane`, the name of the local lane the small calls may take (`lane.py`; None: not
    listening). Whoever opens the handle reads and writes every
    tenant's gpu pages, and CUDA checks no Unix user, so it goes only to a peer known to run as
    the server's user (`same_user`, `peer.py`), as the 0600 /dev/shm files do."""
    layout = store.layout
    return {
        "max_body_bytes": store.config.service.max_body_bytes,  # a store in the body: pieces
        "layout": {
            "model": layout.model_name,  # an engine checks it (`kvtier.model`), as the geometry
            "dtype": layout.dtype_name,
            "block_shape": list(layout.block_shape),
            "block_bytes": layout.block_bytes,
            "block_tokens": layout.block_tokens,
            "tp_rank": layout.tp_rank,
            "tp_size": layout.tp_size,
        },
        "pools": [
            {
                "tier": pool.name,
                "device": str(pool.device),
                "num_slots": pool.num_slots,
                "shared_memory": pool.shared_name,
                "cuda_ipc": export_pool(pool.buffer) if share and same_user else None,
            }
            for pool in store.memory
        ],
        "lane": lane,
        "lane_max_frame_bytes": frames.longest(store.config.service.max_tokens),
        "instance": instance,
    }


def redacted(config: KVTierConfig) -> dict[str, Any]:
    """The configuration as given (a value computed at start, such as
    `service.max_inflight_bytes`, stays null: the values in force are in the status), every
    API key and secret (the admin key, tenants' keys, the remote tier's `secret` and
    `password`) replaced by a placeholder, `env:` references too."""
    data = config.to_dict()
    secrets = [(data["service"], "admin_key")]
    if data["tiers"].get("remote") is not None:
        secrets += [(data["tiers"]["remote"], "secret"), (data["tiers"]["remote"], "password")]
    for section, key in secrets:
        if section.get(key) is not None:
            section[key] = "<redacted>"
    for tenant in data["tenants"].values():
        tenant["api_keys"] = ["<redacted>"] * len(tenant.get("api_keys", ()))
    return data
