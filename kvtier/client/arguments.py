"""What both clients check of their arguments before a request is sent, as `KVStore` checks
them: a wrong one is a typed error naming it (`InvalidArgumentError`, `InvalidTokensError`,
`LeaseError`), never a raw `TypeError` or `AttributeError` from deeper in, and never a
request the server answers for another value than the one given.

- `check_options`: a constructor's arguments (a bad `timeout_s` refused there, not at every
  call after).
- `check_tokens`: tokens whose memory cannot be read (a "meta" tensor).
- `check_flag`, `check_timeout`, `ttl_field`, `lease_of`, `waited`, `reservation_of`,
  `check_tier`: a call's flags, timeouts and ttls, the lease or reservation (or its id) it
  names, and a tier's name.
- `KeyTenant`: a request made in another process than the client's maker's is refused; and
  with an API key the key decides the tenant on the server, which reads no other, so a
  call's `tenant=` naming another tenant than the key's is refused, never ignored.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.caller_kv import COPYABLE
from kvtier.client.calls import Calls
from kvtier.client.releases import ID_LIMIT
from kvtier.errors import InvalidArgumentError, InvalidTokensError, LeaseError, shown
from kvtier.results import Lease, Reservation

NO_BOUND = 1 << 32
"""What a commit by id may report at most: the tokens of its reservation are not known here
(a token count is below 2**32)."""


def check_options(
    api_key: object,
    tenant: object,
    shared_memory: object,
    timeout_s: object,
    max_reply_bytes: object,
) -> None:
    """`InvalidArgumentError` naming the first of a client's constructor arguments of the
    wrong type or range (the key itself is never shown)."""
    if api_key is not None and type(api_key) is not str:
        raise InvalidArgumentError(
            f"api_key: got a value of type {type(api_key).__name__} (not shown), expected a str "
            "or None"
        )
    if tenant is not None and type(tenant) is not str:
        raise InvalidArgumentError(f"tenant: got {shown(tenant)}, expected a str or None")
    check_flag("shared_memory", shared_memory)
    check_timeout(timeout_s, "timeout_s", optional=False)
    if type(max_reply_bytes) is not int or max_reply_bytes <= 0:
        raise InvalidArgumentError(
            f"max_reply_bytes: got {shown(max_reply_bytes)}, expected an int > 0"
        )


def check_tokens(tokens: Any) -> Any:
    """`tokens`, unless a tensor whose values cannot be read here (`InvalidTokensError`: a
    "meta" tensor has no data); their values are checked where they are packed."""
    if isinstance(tokens, torch.Tensor) and (
        tokens.device.type not in COPYABLE or tokens.layout != torch.strided
    ):
        raise InvalidTokensError(
            f"tokens: got a tensor on device {str(tokens.device)!r} in layout {tokens.layout}, "
            "expected a dense tensor in 'cpu' or 'cuda' memory (or a list of ints)"
        )
    return tokens


def check_flag(name: str, flag: object) -> None:
    """`InvalidArgumentError` unless `flag` is True or False (as `KVStore` checks `wait`)."""
    if type(flag) is not bool:
        raise InvalidArgumentError(f"{name}: got {shown(flag)}, expected True or False")


def check_timeout(timeout_s: object, name: str = "timeout_s", optional: bool = True) -> None:
    """`InvalidArgumentError` unless `timeout_s` is a finite number of seconds (>= 0; > 0 for
    a constructor's, where `optional` is False), or None where `optional`."""
    if timeout_s is None and optional:
        return
    least = 0.0 if optional else math.nextafter(0.0, 1.0)
    if type(timeout_s) not in (int, float) or not least <= timeout_s < math.inf:  # type: ignore[operator]
        most = "None or " if optional else ""
        raise InvalidArgumentError(
            f"{name}: got {shown(timeout_s)}, expected {most}a finite number of seconds "
            f"{'>= 0' if optional else '> 0'}"
        )


def ttl_field(ttl_s: object) -> float | None:
    """A prefetch's or reserve's `ttl_s` as its request carries it (None: the server's
    default), checked before anything is sent: `InvalidArgumentError` naming it unless it is
    a number of seconds > 0 (not a bool), as `KVStore` refuses it (the server bounds it by
    `policy.max_ttl_s`). Before, a `np.float32`, a tensor or an int past 2**64 raised msgpack's
    raw `TypeError` / `OverflowError`, and a prefetch or reserve owed a give-back for a request
    never sent (audit BJ)."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, (int, float)) and not isinstance(ttl_s, bool) and 0 < ttl_s < math.inf:
        with contextlib.suppress(OverflowError):  # an int past a float's range
            return float(ttl_s)
    raise InvalidArgumentError(
        f"ttl_s: got {shown(ttl_s)}, expected None or a number of seconds > 0"
    )


TIERS = ("gpu", "host", "disk", "remote")
"""The tiers a store may have, fastest first (`pool_buffer` maps at most gpu and host)."""


def check_tier(tier: object) -> str:
    """`tier`, checked to be a tier's name (`InvalidArgumentError` naming `tier`): before, a
    misspelt one was None, as a pool not mapped here is, and an unhashable one a `TypeError`."""
    if not isinstance(tier, str) or tier not in TIERS:  # (a StrEnum or np.str_ "gpu" too)
        raise InvalidArgumentError(f"tier: got {shown(tier)}, expected one of {list(TIERS)}")
    return str.__str__(tier)


def lease_of(lease: object) -> Lease:
    """`lease`, checked to be a `Lease` (`InvalidArgumentError`, as `KVStore.cancel`)."""
    if not isinstance(lease, Lease):
        raise InvalidArgumentError(f"lease: got {shown(lease)}, expected a Lease")
    return lease


def waited(lease: object, timeout_s: object) -> Lease:
    """A `wait_for`'s arguments checked (`lease_of`, `check_timeout`): the lease."""
    check_timeout(timeout_s)
    return lease_of(lease)


@dataclass(frozen=True)
class Reserved:
    """What a commit or abort sends: the reservation's id and tenant ("default": the
    client's own, for a bare id), and at most how many tokens a commit may report."""

    reservation_id: int
    tenant: str
    most_tokens: int


def reservation_of(reservation: object) -> Reserved:
    """A `Reservation` or its int id (as `KVStore.commit` and `abort` take it), checked before
    anything is sent: `InvalidArgumentError` for anything else (a bool included), `LeaseError`
    for an id no request could carry (outside [0, 2**64)), as for an unknown one."""
    if isinstance(reservation, Reservation):
        most = reservation.cached_tokens + reservation.num_tokens + reservation.dropped_tokens
        return Reserved(reservation.reservation_id, reservation.tenant, most)
    if type(reservation) is not int:
        raise InvalidArgumentError(
            f"reservation: got {shown(reservation)}, expected a Reservation or an int id"
        )
    if not 0 <= reservation < ID_LIMIT:
        raise LeaseError(f"reservation {reservation}: unknown, committed, aborted or expired")
    return Reserved(reservation, "default", NO_BOUND)


class KeyTenant:
    """What a client checks before each request for a tenant: that this is the process that
    made it (`Calls.check_process`), and the tenant of its API key, learnt once from the
    server (`/v1/status` names it to a tenant key) when a call first names a tenant of its
    own; without a key, no tenant is checked here (`RequestHeaders` checks it).

        if key.due(tenant):                  # the process checked first
            key.learn(get("/v1/status"))
        key.check(tenant)                    # (`AsyncClient`: `await key.admit(tenant, get)`)
    """

    def __init__(self, calls: Calls, has_key: bool) -> None:
        self.calls, self.has_key = calls, has_key
        self.learnt = False
        self.tenant: str | None = None  # None: the server did not say (an admin key)

    def due(self, tenant: object) -> bool:
        """`ClosedError` in another process than the maker's; else whether a call for `tenant`
        needs the key's tenant, not learnt yet (`learn`)."""
        self.calls.check_process()
        return self.has_key and not self.learnt and tenant != "default" and type(tenant) is str

    async def admit(self, tenant: object, get: Callable[[str], Awaitable[dict[str, Any]]]) -> None:
        """`due`, `learn` (from `await get("/v1/status")`) and `check`, for `AsyncClient`."""
        if self.due(tenant):
            self.learn(await get("/v1/status"))
        self.check(tenant)

    def held(self, tenant: str) -> str:
        """The tenant to send for a lease's or reservation's own `tenant` (a release, commit or
        abort): with a key, "default" (the key decides, and the server refuses another
        tenant's id as unknown: `LeaseError`), else `tenant`."""
        return "default" if self.has_key else tenant

    def reserved(self, reservation: object) -> Reserved:
        """`reservation_of(reservation)`, its tenant the one to send (`held`)."""
        asked = reservation_of(reservation)
        return Reserved(asked.reservation_id, self.held(asked.tenant), asked.most_tokens)

    def learn(self, status: dict[str, Any]) -> None:
        """Take the key's tenant out of a `/v1/status` reply (its `tenant`, if a str)."""
        named = status.get("tenant")
        self.tenant, self.learnt = named if type(named) is str else None, True

    def check(self, tenant: object) -> None:
        """`InvalidArgumentError` for a call's `tenant` that the key would overrule: with a
        key, "default" (the key's own) or the key's tenant, nothing else."""
        if not self.has_key or tenant == "default":
            return
        if type(tenant) is not str:
            raise InvalidArgumentError(f"tenant: expected a tenant id (str), got {shown(tenant)}")
        if self.learnt and self.tenant is not None and tenant != self.tenant:
            raise InvalidArgumentError(
                f"tenant: got {shown(tenant)}, but this client's api_key is of tenant "
                f"{shown(self.tenant)}, and the key decides the tenant; expected "
                f"{shown(self.tenant)} or none (a client per tenant key)"
            )
