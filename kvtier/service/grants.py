"""`Grants`: which lease or reservation each request token was granted, per tenant, so that a
client whose reply was lost can still give it back.

A prefetch or reserve may carry `request`, a token the client drew (16 lowercase hex chars,
`wire.request_field`). When its reply is lost (a client timeout, a reset connection, a task
cancelled, the client closed) the server has created a lease or reservation whose id the
client never learned: it held its slots to its ttl. With the token the client gives it back
all the same: `/v1/release {request}` or `/v1/abort {request}` (`plane.py`).

    grant(kind, tenant, token, id, tenants)  remember id for the token; False: the token was
                                             withdrawn first (its give-back came before its
                                             request was done), so the caller ends what it
                                             made at once
    withdraw(kind, tenant, token, tenants)   the id granted, forgotten; None: nothing granted
      -> id | None                           (yet); either way the token is remembered as
                                             withdrawn, so a request carrying it that grants
                                             later (a late one, or a prefetch's next attempt
                                             after a FAILED lease) grants nothing that
                                             outlives it
    check()                                  the invariants; `KVTierError` if one fails

`tenants` is the configured ones (`store.namespaces.seeds`): a `tenant` not among them is an
`UnknownTenantError` (403 `unknown_tenant`, as any call of an unconfigured tenant), and nothing is
created for it.

Contract and invariants:
- `kind` is "lease" or "reservation"; the two never share an entry.
- Per tenant: a token is looked up in its own tenant's table only. Another tenant's token is
  not found (a withdrawal records a tombstone in the caller's table, acting on nothing else).
- Bounded: at most `MAX_PER_TENANT` entries (grants and tombstones together) per (kind,
  tenant); past it the oldest is dropped (its lease or reservation then ends at its ttl, as
  before tokens). A table is made only for a tenant among `tenants`, checked before it is made,
  so the whole table is bounded too: by the configured tenants, never by the names callers send.
- A token names one id: a second grant of the same token (a prefetch tried again after a
  FAILED lease) replaces the first.
- Thread-safe (the HTTP routes' worker threads and the lane's threads share one table).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection

from kvtier.errors import KVTierError, UnknownTenantError, shown
from kvtier.service import wire

MAX_PER_TENANT = 4096
"""The most tokens remembered per (kind, tenant); the oldest is dropped past it."""

KINDS = ("lease", "reservation")
WITHDRAWN = -1
"""A tombstone: the token's give-back came before any grant."""


class Grants:
    def __init__(self, bound: int = MAX_PER_TENANT) -> None:
        self.bound = bound
        self._lock = threading.Lock()
        self._tables: dict[tuple[str, str], OrderedDict[str, int]] = {}

    def _table(self, kind: str, tenant: str, tenants: Collection[str]) -> OrderedDict[str, int]:
        if kind not in KINDS:
            raise ValueError(f"kind: got {shown(kind)}, expected one of {KINDS}")
        if tenant not in tenants:  # before a table is made: never one per name a caller sends
            raise UnknownTenantError(
                f"tenant {shown(tenant)}: unknown, expected one of {sorted(tenants)}"
            )
        return self._tables.setdefault((kind, tenant), OrderedDict())

    def _put(self, table: OrderedDict[str, int], token: str, value: int) -> None:
        table[token] = value
        table.move_to_end(token)
        while len(table) > self.bound:
            table.popitem(last=False)

    def grant(
        self, kind: str, tenant: str, token: str, granted: int, tenants: Collection[str]
    ) -> bool:
        with self._lock:
            table = self._table(kind, tenant, tenants)
            held = table.get(token)
            if held == WITHDRAWN:
                del table[token]
                return False
            self._put(table, token, granted)
            return True

    def withdraw(self, kind: str, tenant: str, token: str, tenants: Collection[str]) -> int | None:
        with self._lock:
            table = self._table(kind, tenant, tenants)
            held = table.pop(token, None)
            # a tombstone even after a grant: a prefetch tries again after a FAILED lease under
            # the same token (`plane.py`), and its next lease, granted after this give-back,
            # must end at once (before, it was granted and held its slots to its ttl)
            self._put(table, token, WITHDRAWN)
            return None if held == WITHDRAWN else held

    def size(self, kind: str, tenant: str) -> int:
        with self._lock:
            return len(self._tables.get((kind, tenant), ()))

    def check(self) -> None:
        with self._lock:
            for (kind, tenant), table in self._tables.items():
                if kind not in KINDS:
                    raise KVTierError(f"grants: unknown kind {kind!r}")
                if len(table) > self.bound:
                    raise KVTierError(
                        f"grants: {len(table)} entries of {kind} for tenant {tenant!r}, "
                        f"more than the bound {self.bound}"
                    )
                for token, granted in table.items():
                    if not wire.is_request_token(token):
                        raise KVTierError(f"grants: a malformed token {shown(token)}")
                    if type(granted) is not int or granted < WITHDRAWN:
                        raise KVTierError(f"grants: token {token} -> {granted!r}")
