"""The sidecar's replies, read by the client as untrusted data (`kvtier.client`).

A client writes into memory that its server names and reads slots that its server lists, so
every field it uses is checked here before it is used: its type (ints are ints, not bools or
floats), its range, and its agreement with the layout and the pools. A reply that fails is a
`ReplyError` naming the field and what was expected; the client then maps, writes and returns
nothing from it. Nothing here is ever evaluated or unpickled.

- `/v1/pools` -> `Pools`: the layout (dtype in `DTYPES`; `block_shape` five positive ints
  `[layers, 2, block_tokens, heads, dim]` agreeing with `block_bytes` and `block_tokens`), and
  per tier (`gpu`, `host`, each at most once) a bounded `num_slots`, a shared-memory name of
  ours for that tier (`tiers/shm.py` `NAME`) or none, a checked CUDA IPC description
  (`service/cuda_ipc.py`) or none; the server's `instance`.
- `instance` (`/v1/pools`, leases, reservations: `instance(body, where)`): the server process's
  id, 16 lowercase hex digits (`admission.Service`), or absent (a server before instance ids:
  None, which matches only a mapping made from a reply without one either). The client reads
  or writes a mapped pool for slots only when the reply naming them has the instance of the
  `/v1/pools` it mapped (`client/pools.py`).
- Leases and reservations: ids and counts in range, token counts in whole blocks, one distinct
  slot per block, each below the pool's `num_slots` when the pools are known.
- Lookup, store and load results: counts in range that add up; a load's KV of the layout's
  shape for exactly its `num_tokens`.
- `/v1/blocks`: a block size in range, a bounded list of topics, each with text, a sequence
  number and bytes (the event batch, which the router decodes as untrusted in its turn).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.blocks import DTYPES, KVLayout
from kvtier.errors import ReplyError, shown
from kvtier.results import (
    Lease,
    LeaseOwner,
    LeaseState,
    LookupResult,
    Reservation,
    StoreResult,
)
from kvtier.service import wire
from kvtier.service.cuda_ipc import CudaIpcDescription, parse_description
from kvtier.tiers.shm import NAME

MAX_DIM = 1 << 20
"""Bound on each of a block's five sizes."""
MAX_MODEL_CHARS = 1024
"""Bound on the length of the model's name (`pools.layout.model`)."""
MAX_POOL_BYTES = 1 << 50
"""Bound on a pool's bytes (`num_slots * block_bytes`): 1 PiB."""
MAX_COUNT = 1 << 40
"""Bound on token counts."""
MAX_ID = (1 << 64) - 1
POOL_TIERS = ("gpu", "host")
INSTANCE = re.compile(r"[0-9a-f]{16}")
"""A server instance id (`admission.Service`)."""
_STATES = tuple(state.value for state in LeaseState)
"""A tuple, not a set: a hostile state may be unhashable, and `in` compares with ==."""


@dataclass(frozen=True)
class Pool:
    """One memory pool a server offers: its slots and how to reach it, if at all."""

    tier: str
    num_slots: int
    shared_memory: str | None
    cuda_ipc: CudaIpcDescription | None


@dataclass(frozen=True)
class Pools:
    """A checked `/v1/pools` reply."""

    layout: KVLayout
    pools: tuple[Pool, ...]
    instance: str | None  # the server process that offers them (module doc)
    max_body_bytes: int | None = None  # the longest request body it reads (None: not said)

    def num_slots(self, tier: str) -> int | None:
        return next((pool.num_slots for pool in self.pools if pool.tier == tier), None)


def pools(body: dict[str, Any]) -> Pools:
    """The `/v1/pools` reply `body`, checked (module docstring)."""
    server = instance(body, "pools")
    layout = _layout(_field(body, "layout", dict, "pools"))
    offers = _field(body, "pools", list, "pools")
    if len(offers) > len(POOL_TIERS):
        raise ReplyError(f"pools.pools: {len(offers)} pools, expected at most {len(POOL_TIERS)}")
    checked: list[Pool] = []
    for i, offer in enumerate(offers):
        where = f"pools.pools[{i}]"
        if not isinstance(offer, dict):
            raise ReplyError(f"{where}: got {type(offer).__name__}, expected a map")
        tier = offer.get("tier")
        if tier not in POOL_TIERS or any(pool.tier == tier for pool in checked):
            raise ReplyError(f"{where}.tier: got {tier!r}, expected one of {POOL_TIERS}, once")
        num_slots = _int(offer, "num_slots", where, MAX_POOL_BYTES // layout.block_bytes, 1)
        name = offer.get("shared_memory")
        match = NAME.fullmatch(name) if isinstance(name, str) else None
        if name is not None and (match is None or match["tier"] != tier):
            raise ReplyError(
                f"{where}.shared_memory: got {shown(name)}, expected none or a name "
                f"<base>-<pid>-<8 hex>-{tier}"
            )
        ipc = offer.get("cuda_ipc")
        shape = layout.pool_shape(num_slots)
        described = None if ipc is None else parse_description(ipc, layout.dtype_name, shape)
        checked.append(Pool(tier, num_slots, name, described))
    limit = (
        None
        if body.get("max_body_bytes") is None
        else _int(body, "max_body_bytes", "pools", 1 << 50, 1024)
    )
    return Pools(layout, tuple(checked), server, limit)


def instance(body: dict[str, Any], where: str) -> str | None:
    """The server instance a reply (`where`: pools, lease, reservation) comes from; None for
    none (module doc); anything but an instance id is a `ReplyError` naming the field."""
    value = body.get("instance")
    if value is None:
        return None
    if not isinstance(value, str) or INSTANCE.fullmatch(value) is None:
        raise ReplyError(
            f"{where}.instance: got {shown(value)}, expected 16 lowercase hex digits (the "
            "server's instance id) or none"
        )
    return value


def lease(
    body: dict[str, Any], served: Pools | None, canceller: Callable[[Lease], None] | None
) -> Lease:
    """A lease reply, checked against the gpu pool's slots when `served` is known."""
    instance(body, "lease")  # well formed, whoever reads it (the client's pools compare it)
    state = body.get("state")
    if state not in _STATES:
        raise ReplyError(f"lease.state: got {shown(state)}, expected a lease state")
    num_tokens = _int(body, "num_tokens", "lease", MAX_COUNT)
    table = _slots(body, "block_table", "lease", num_tokens, served, "gpu")
    reason = body.get("reason", "")
    if not isinstance(reason, str):
        raise ReplyError(f"lease.reason: got {type(reason).__name__}, expected text")
    result = Lease(
        _int(body, "lease_id", "lease", MAX_ID),
        _text(body, "tenant", "lease"),
        num_tokens,
        table,
        _time(body, "expires_at", "lease"),
        num_layers=_layers(body, served, state),
        pending=state == LeaseState.PENDING.value,
        canceller=canceller,
    )
    if state not in (LeaseState.PENDING.value, LeaseState.READY.value):
        LeaseOwner(result).resolve(LeaseState(state), reason)
    return result


def _layers(body: dict[str, Any], served: Pools | None, state: str) -> int:
    """A lease's `num_layers`, as the store's lease has it (`layers_ready` of a READY lease is
    all of them): the served layout's, else what the READY reply's `layers_ready` says (checked;
    0 where the reply has none)."""
    if served is not None:
        return served.layout.num_layers
    if state != LeaseState.READY.value or "layers_ready" not in body:
        return 0
    return _int(body, "layers_ready", "lease", MAX_COUNT)


def reservation(body: dict[str, Any], served: Pools | None, sent_tokens: int) -> Reservation:
    """A reservation reply for a sequence of `sent_tokens`, checked against its tier's slots
    when `served` is known."""
    instance(body, "reservation")  # well formed, as a lease's
    tier = body.get("tier")
    if tier not in ("gpu", "host", "disk"):
        raise ReplyError(f"reservation.tier: got {shown(tier)}, expected gpu, host or disk")
    num_tokens = _int(body, "num_tokens", "reservation", MAX_COUNT)
    cached_tokens = _tokens(body, "cached_tokens", "reservation", served)
    dropped = (
        _int(body, "dropped_tokens", "reservation", MAX_COUNT) if "dropped_tokens" in body else 0
    )
    if cached_tokens + num_tokens + dropped > sent_tokens:
        more = f" and {dropped} more without room" if dropped else ""
        raise ReplyError(
            f"reservation: tokens [{cached_tokens}, {cached_tokens + num_tokens}){more} of a "
            f"{sent_tokens}-token sequence"
        )
    return Reservation(
        reservation_id=_int(body, "reservation_id", "reservation", MAX_ID),
        tenant=_text(body, "tenant", "reservation"),
        cached_tokens=cached_tokens,
        num_tokens=num_tokens,
        tier=tier,
        slots=_slots(body, "slots", "reservation", num_tokens, served, tier),
        expires_at=_time(body, "expires_at", "reservation"),
        dropped_tokens=dropped,  # absent from a server before the field: 0
    )


def lookup(body: dict[str, Any]) -> LookupResult:
    """A lookup reply: token counts, the tiers' adding up to the first (`remote_tokens` may be
    absent: a server without a remote tier's field, 0)."""
    if "remote_tokens" not in body:
        body = {**body, "remote_tokens": 0}
    counts = [_int(body, name, "lookup", MAX_COUNT) for name in LookupResult._fields]
    result = LookupResult(*counts)
    if sum(counts[1:]) != result.num_tokens:
        raise ReplyError(f"lookup: tiers {counts[1:]} do not add up to {result.num_tokens}")
    return result


def blocks(body: dict[str, Any]) -> dict[str, Any]:
    """A `/v1/blocks` reply: `{block_size, topics: [{topic, seq, events}]}`."""
    block_size = _int(body, "block_size", "blocks", 1 << 20, 1)
    topics = _field(body, "topics", list, "blocks")
    if len(topics) > 4096:
        raise ReplyError(f"blocks.topics: {len(topics)} topics, expected at most 4096")
    checked = []
    for entry in topics:
        if not isinstance(entry, dict):
            raise ReplyError(f"blocks.topics: got {type(entry).__name__}, expected a map")
        checked.append(
            {
                "topic": _text(entry, "topic", "blocks.topics"),
                "seq": _int(entry, "seq", "blocks.topics", 1 << 63),
                "events": _field(entry, "events", bytes, "blocks.topics"),
            }
        )
    return {"block_size": block_size, "topics": checked}


def reset(body: dict[str, Any]) -> dict[str, Any]:
    """A `/v1/reset` reply: `{dropped_blocks, left_blocks, remote}`."""
    names = ("dropped_blocks", "left_blocks")
    counts = {name: _int(body, name, "reset", MAX_COUNT) for name in names}
    return {**counts, "remote": _field(body, "remote", bool, "reset")}


def stored(body: dict[str, Any]) -> StoreResult:
    """A store or commit reply: token counts."""
    return StoreResult(*(_int(body, name, "store", MAX_COUNT) for name in StoreResult._fields))


def loaded(
    body: dict[str, Any], layout: KVLayout | None, start: int = 0
) -> tuple[int, torch.Tensor]:
    """A reply to a load from token `start`: `(num_tokens, kv)`, the KV `[layers, 2, tokens,
    heads, dim]` of tokens start..num_tokens (none when the prefix ends before `start`), of the
    layout's dtype when the layout is known."""
    num_tokens = _int(body, "num_tokens", "load", MAX_COUNT)
    tokens = max(0, num_tokens - start)
    try:
        kv = wire.kv_from_wire(body)
    except wire.WireError as exc:
        raise ReplyError(f"load: {exc.detail}") from None
    if layout is not None:
        layers, _, _, heads, dim = layout.block_shape
        expected = (layers, 2, tokens, heads, dim)
        if kv.dtype != layout.dtype or tuple(kv.shape) != expected:
            raise ReplyError(
                f"load.kv: got {kv.dtype} {list(kv.shape)}, expected {layout.dtype} "
                f"{list(expected)}"
            )
    elif kv.dim() != 5 or kv.shape[2] != tokens:
        raise ReplyError(f"load.kv: shape {list(kv.shape)}, expected 5 dims of {tokens} tokens")
    return num_tokens, kv


# ---- fields -----------------------------------------------------------------------------------


def _layout(data: dict[str, Any]) -> KVLayout:
    dtype = data.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ReplyError(f"pools.layout.dtype: got {shown(dtype)}, expected one of {list(DTYPES)}")
    shape = data.get("block_shape")
    if not (
        isinstance(shape, list)
        and len(shape) == 5
        and all(type(n) is int and 0 < n <= MAX_DIM for n in shape)
        and shape[1] == 2
    ):
        raise ReplyError(
            f"pools.layout.block_shape: got {shown(shape)}, expected "
            f"[layers, 2, block_tokens, heads, dim] of ints in [1, {MAX_DIM}]"
        )
    layers, _, block_tokens, heads, dim = shape
    rank, size = data.get("tp_rank", 0), data.get("tp_size", 1)  # absent: an older server
    if not (type(size) is int and 1 <= size <= 1024 and type(rank) is int and 0 <= rank < size):
        raise ReplyError(
            f"pools.layout.tp_rank / tp_size: got {shown(rank)} / {shown(size)}, expected a "
            "rank in [0, tp_size) and tp_size in [1, 1024]"
        )
    model = data.get("model", "served")  # absent: an older server
    if not (isinstance(model, str) and 0 < len(model) <= MAX_MODEL_CHARS):
        raise ReplyError(
            f"pools.layout.model: got {shown(model)}, expected a model name of 1 to "
            f"{MAX_MODEL_CHARS} characters"
        )
    layout = KVLayout(model, layers, heads, dim, dtype, block_tokens, rank, size)
    if data.get("block_tokens") != block_tokens or type(data.get("block_tokens")) is not int:
        raise ReplyError(
            f"pools.layout.block_tokens: got {shown(data.get('block_tokens'))}, expected "
            f"{block_tokens} (block_shape[2])"
        )
    if data.get("block_bytes") != layout.block_bytes or type(data.get("block_bytes")) is not int:
        raise ReplyError(
            f"pools.layout.block_bytes: got {shown(data.get('block_bytes'))}, expected "
            f"{layout.block_bytes} (block_shape and dtype)"
        )
    if layout.block_bytes > MAX_POOL_BYTES:
        raise ReplyError(f"pools.layout: {layout.block_bytes} bytes a block, over {MAX_POOL_BYTES}")
    return layout


def _slots(
    body: dict[str, Any],
    name: str,
    where: str,
    num_tokens: int,
    served: Pools | None,
    tier: str,
) -> tuple[int, ...]:
    """One distinct slot per block of `num_tokens`, each below the tier's `num_slots`."""
    slots = _field(body, name, list, where)
    limit = None if served is None else served.num_slots(tier)
    if not all(type(s) is int and 0 <= s < (MAX_ID if limit is None else limit) for s in slots):
        raise ReplyError(
            f"{where}.{name}: got {shown(slots)}, expected slot ids in "
            f"[0, {'2**64' if limit is None else limit})"
        )
    if len(set(slots)) != len(slots):
        raise ReplyError(f"{where}.{name}: got {shown(slots)}, expected distinct slots")
    if served is not None:
        block_tokens = served.layout.block_tokens
        if num_tokens != len(slots) * block_tokens:
            raise ReplyError(
                f"{where}.num_tokens: got {num_tokens}, expected {len(slots)} blocks of "
                f"{block_tokens} tokens"
            )
    return tuple(slots)


def _tokens(body: dict[str, Any], name: str, where: str, served: Pools | None) -> int:
    count = _int(body, name, where, MAX_COUNT)
    if served is not None and count % served.layout.block_tokens:
        raise ReplyError(
            f"{where}.{name}: got {count}, expected whole blocks of "
            f"{served.layout.block_tokens} tokens"
        )
    return count


def _int(data: dict[str, Any], name: str, where: str, maximum: int, minimum: int = 0) -> int:
    value = data.get(name)
    if type(value) is not int or not minimum <= value <= maximum:
        raise ReplyError(
            f"{where}.{name}: got {shown(value)}, expected an int in [{minimum}, {maximum}]"
        )
    return value


def _time(data: dict[str, Any], name: str, where: str) -> float:
    value = data.get(name)
    if not (isinstance(value, int | float) and type(value) is not bool and abs(value) < 1e300):
        raise ReplyError(
            f"{where}.{name}: got {shown(value)}, expected a finite number below 1e300"
        )
    return float(value)


def _text(data: dict[str, Any], name: str, where: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or len(value) > 256:
        raise ReplyError(f"{where}.{name}: got {shown(value)}, expected text of at most 256 chars")
    return value


def _field(data: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind):
        raise ReplyError(f"{where}.{name}: got {type(value).__name__}, expected a {kind.__name__}")
    return value
