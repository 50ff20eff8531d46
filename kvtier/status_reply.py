"""A sidecar's `/v1/status` reply checked before `kvtier status` prints it as a table.

`check_status(reply)` returns `reply` when every field the table reads is there with the type
it needs, else raises `ReplyError` naming the first bad field by its dotted path (`status.
layout.model`), the value got (`shown`) and what was expected; nothing has been printed then.
The shapes are `GLOBAL` (the admin's or a keyless server's figures) and `TENANT` (a tenant key's,
told by its `tenant` field), as tables of fields; a `Maybe` field may be absent (a server from
before it), and `inflight`'s global figures are read only when it has `busy`. Counts are
integers in [0, 2**63) (a bigger one has no decimal text Python prints fast), rates and times
finite numbers (an integer one within 2**63 of 0: a bigger one has no float; not NaN nor
Infinity, which JSON has not but Python's parser takes: they printed as `nan%`, `inf ms`); text
is any string (printed escaped). Fields the table does not read are not checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvtier.errors import ReplyError, shown
from kvtier.text import printable

MAX_COUNT = 2**63
"""Counts are below this."""

NAME_CHARS = 80
"""What an error keeps of a name the server chose (a tier's, a path's)."""


@dataclass(frozen=True)
class Field:
    """A leaf of a reply: `kinds` its JSON types, `expected` what the error says."""

    kinds: tuple[type, ...]
    expected: str
    nullable: bool = False
    counted: bool = False  # an int in [0, MAX_COUNT); else an int is in (-MAX_COUNT, MAX_COUNT)

    def accepts(self, value: object) -> bool:
        if value is None:
            return self.nullable
        if type(value) not in self.kinds:
            return False
        if type(value) is int:  # no decimal text or float of its own past these
            return (0 if self.counted else 1 - MAX_COUNT) <= value < MAX_COUNT
        return type(value) is not float or math.isfinite(value)  # no NaN, no Infinity


@dataclass(frozen=True)
class Each:
    """A JSON object of any names, each value of `spec` (a tier, a path)."""

    spec: Spec


@dataclass(frozen=True)
class Maybe:
    """A field that may be absent (a server from before it); when there, of `spec`."""

    spec: Spec


Spec: TypeAlias = Field | Each | Maybe | dict[str, "Spec"]

COUNT = Field((int,), "an integer in [0, 2**63)", counted=True)
CELL = Field((int,), "an integer in [0, 2**63) or null", nullable=True, counted=True)
NUMBER = Field((int, float), "a finite number (an integer one within 2**63 of 0)")
TEXT = Field((str,), "a string")
FLAG = Field((bool,), "true or false")

LAYOUT: Spec = {"model": TEXT, "dtype": TEXT, "block_tokens": COUNT, "block_bytes": COUNT}

GLOBAL: dict[str, Spec] = {
    "layout": LAYOUT,
    "policy": {"write": TEXT},
    "tiers": Each({
        "location": TEXT, "capacity_bytes": COUNT, "slots": COUNT, "used_bytes": COUNT,
        "blocks": COUNT, "reserved_slots": Maybe(COUNT),
    }),
    "mover": {
        "in_flight": COUNT, "queued_transfers": COUNT, "failed_flights": COUNT,
        "backpressure_drops": COUNT, "prefetch_to_ready_s": {"p50": NUMBER, "p99": NUMBER},
    },
    "ops": {"lookups": COUNT, "stores": COUNT, "prefetches": COUNT},
    "hit_rate": NUMBER,
    "index": {"leases": COUNT, "reservations": Maybe(COUNT)},
    "paths": Each({"bytes": COUNT, "recent_bytes_per_s": NUMBER}),
    "inflight": Maybe({}),
    "remote": Maybe({
        "connected": FLAG, "hits": COUNT, "misses": COUNT, "verify_failures": COUNT,
        "errors": COUNT, "filled_blocks": COUNT, "writer_written_blocks": COUNT,
        "writer_dropped_blocks": COUNT, "writer_pending_bytes": COUNT,
    }),
    "events": Maybe({
        "unsynced_topics": COUNT, "events": COUNT, "messages": COUNT, "topic": TEXT,
        "dropped_events": COUNT, "resyncs": COUNT, "retells": COUNT, "queued": COUNT,
    }),
}  # fmt: skip
"""The global reply; `remote.last_error` is read only when not connected (any value)."""

HELD: dict[str, Spec] = {"held_bytes": COUNT, "limit_bytes": COUNT}
GLOBAL_HELD: dict[str, Spec] = {**HELD, "share_bytes": Maybe(COUNT), "waits": COUNT, "busy": COUNT}

TENANT: dict[str, Spec] = {
    "tenant": TEXT,
    "layout": LAYOUT,
    "tiers": Each({
        "capacity_bytes": COUNT, "blocks": CELL, "reserved_blocks": CELL, "held_blocks": CELL,
        "quota_blocks": CELL, "floor_blocks": CELL, "hits": CELL,
    }),
    "ops": {"lookups": COUNT, "stores": COUNT, "loads": COUNT, "prefetches": COUNT},
    "leases": {"live": COUNT, "quota": COUNT},
    "locked_blocks": COUNT,
    "hit_rate": NUMBER,
    "inflight": Maybe(HELD),
}  # fmt: skip
"""A tenant key's reply."""


def check_status(reply: object) -> dict[str, Any]:
    """`reply` if `kvtier status` can print it as a table (module doc), else `ReplyError`."""
    tenant = isinstance(reply, dict) and "tenant" in reply
    _check(reply, TENANT if tenant else GLOBAL, "status")
    assert isinstance(reply, dict)
    if not tenant and "busy" in reply.get("inflight", {}):
        _check(reply["inflight"], GLOBAL_HELD, "status.inflight")
    remote = {} if tenant else reply.get("remote", {})
    if remote and not remote["connected"] and "last_error" not in remote:
        raise ReplyError("status.remote.last_error: missing; expected the error text")
    return reply


def _check(value: object, spec: Spec, where: str) -> None:
    if isinstance(spec, Maybe):
        _check(value, spec.spec, where)
        return
    if isinstance(spec, Field):
        if not spec.accepts(value):
            raise ReplyError(f"{where}: got {shown(value)}, expected {spec.expected}")
        return
    if not isinstance(value, dict):
        raise ReplyError(f"{where}: got {shown(value)}, expected a JSON object")
    if isinstance(spec, Each):
        for name, item in value.items():
            _check(item, spec.spec, f"{where}.{printable(name, NAME_CHARS)}")
        return
    for name, field in spec.items():
        if name in value:
            _check(value[name], field, f"{where}.{name}")
        elif not isinstance(field, Maybe):
            raise ReplyError(f"{where}.{name}: missing; expected {_expected(field)}")


def _expected(spec: Spec) -> str:
    return spec.expected if isinstance(spec, Field) else "a JSON object"
