"""The `tenants` section: who shares the store, the keys that act as each, and how much each
may hold (quotas) or keep against the others (floors).

Contract:
- `Tenants` is a plain dict (so that configs pickle; treat it as read-only) of at least one
  tenant id matching `[A-Za-z0-9_.-]{1,64}` to its `TenantConfig`; an invalid one is shown in
  its error only as `fields.shown_key` shows a key (one with `=`, `:` etc., a secrets line
  read as an id, is not).
- Per-tier quotas and floors are sizes or fractions of the tier; unset ones are resolved by
  `shares.py` against the tiers' sizes, never here. That the floors of a tier fit in it, and
  that a quota holds a block, is checked there too.
- API keys are literal keys of at least 16 characters or `env:NAME`; errors never show them
  (`loading.py`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated

from pydantic import BeforeValidator

from kvtier.config.fields import (
    InvalidValue,
    KeyRef,
    MemoryCapacity,
    NotASection,
    Section,
    int_in,
    shown_key,
)

_TENANT_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class QuotaConfig(Section):
    """The most a tenant holds at once (`shares.py`). `gpu`, `host`: blocks that its leases and
    reservation pins lock (counted against gpu) plus the slots its reservations hold, per tier,
    as a size ('64MiB') or a fraction of the tier (0.5); unset: its equal share of the tier when
    several tenants are configured, the whole tier for a single one. `leases`: its live leases."""

    gpu: MemoryCapacity | None = None
    host: MemoryCapacity | None = None
    leases: Annotated[int, int_in(1, 1 << 20)] = 4096


class FloorConfig(Section):
    """A tenant's fair-share eviction floor per tier (`index/eviction.py`): while it holds no
    more than this in a tier, no other tenant's call takes its blocks there. A size or a
    fraction of the tier; unset: its equal share when several tenants are configured, none
    for a single one. The floors of a tier must fit in it."""

    gpu: MemoryCapacity | None = None
    host: MemoryCapacity | None = None
    disk: MemoryCapacity | None = None


def _key_list(value: object) -> tuple[object, ...]:
    """`api_keys` as a tuple: a list (one key alone, `api_keys: KEY`, is refused naming the list
    it belongs in, not shown; pydantic said "Input should be a valid tuple")."""
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise InvalidValue(value, "a list of API keys ([KEY, ...], or [env:NAME])")


class TenantConfig(Section):
    """Per-tenant settings: the API keys that act as this tenant (literal, or 'env:NAME'), its
    quota and its floors."""

    api_keys: Annotated[tuple[KeyRef, ...], BeforeValidator(_key_list)] = ()
    quota: QuotaConfig = QuotaConfig()
    floor: FloorConfig = FloorConfig()


def _tenant_ids(value: object) -> object:
    expected = "a mapping of at least one tenant id to its settings"
    if not isinstance(value, Mapping):
        raise NotASection(value, expected)
    if not value:
        raise InvalidValue(value, expected)
    for key in value:
        if not isinstance(key, str) or not _TENANT_ID.fullmatch(key):
            raise InvalidValue(shown_key(key), "a tenant id matching [A-Za-z0-9_.-]{1,64}")
    return dict(value)


Tenants = Annotated[dict[str, TenantConfig], BeforeValidator(_tenant_ids)]
