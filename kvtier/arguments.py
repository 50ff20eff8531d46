"""The checks of a store's plain arguments, each an `InvalidArgumentError` naming the value and
what was expected, raised before anything changes: what `KVStore` is built from, tenants,
flags, ttls and timeouts. (Tokens are `blocks.encode_tokens`'s, KV tensors `caller_kv.py`'s.)
"""

from __future__ import annotations

import sys

from kvtier.config import KVTierConfig, PolicyConfig
from kvtier.errors import InvalidArgumentError, shown

LARGEST = sys.float_info.max
"""The largest number of seconds taken (NaN and infinities compare outside it)."""


def check_store_args(config: object, secret: object, clock: object) -> None:
    """`KVStore`'s: `config` a `KVTierConfig` or None (the defaults), `secret` bytes, `clock` a
    callable that returns a number of seconds (called once here, to see that it does)."""
    if config is not None and not isinstance(config, KVTierConfig):
        raise InvalidArgumentError(
            f"config: got {shown(config)} ({type(config).__name__}), expected a KVTierConfig "
            "(parse_config(dict), load_config(path)) or None for the defaults"
        )
    if not isinstance(secret, bytes):
        raise InvalidArgumentError(
            f"secret: got {type(secret).__name__}, expected bytes (b'' for none)"
        )
    now = clock() if callable(clock) else None
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not -LARGEST <= now <= LARGEST:
        read = f" (it read {shown(now)})" if callable(clock) else ""  # NaN: no lease ever ends
        raise InvalidArgumentError(
            f"clock: got {shown(clock)}{read}, expected a callable that returns seconds (a finite "
            "number), like time.monotonic"
        )


def check_tenant(tenant: object) -> None:
    """`InvalidArgumentError` naming `tenant` unless it is a str (a tenant id: whether it is
    one the config lists is `tenancy.Namespaces.seed`'s check)."""
    if type(tenant) is not str:
        raise InvalidArgumentError(
            f"tenant: got {shown(tenant)} ({type(tenant).__name__}), expected a tenant id (str)"
        )


def check_flags(**flags: object) -> None:
    """`InvalidArgumentError` naming the first of `flags` that is not a bool."""
    for name, flag in flags.items():
        if type(flag) is not bool:
            raise InvalidArgumentError(f"{name}: got {shown(flag)}, expected True or False")


def ttl_of(policy: PolicyConfig, ttl_s: float | None) -> float:
    """A lease's or reservation's ttl: `ttl_s` or the default, <= `policy.max_ttl_s`."""
    ttl = policy.lease_ttl_s if ttl_s is None else ttl_s
    longest = policy.max_ttl_s
    if isinstance(ttl, bool) or not (isinstance(ttl, (int, float)) and 0 < ttl <= longest):
        raise InvalidArgumentError(
            f"ttl_s: got {shown(ttl_s)}, expected a number of seconds in (0, {longest}] "
            f"(policy.max_ttl_s)"
        )
    return float(ttl)


def check_timeout(name: str, timeout_s: object) -> float:
    """`timeout_s` as seconds to wait: a finite number >= 0 (not a bool), else
    `InvalidArgumentError` naming `name`."""
    if (
        isinstance(timeout_s, (int, float))
        and not isinstance(timeout_s, bool)
        and 0 <= timeout_s <= LARGEST  # compared, never converted first: 10**400 is no float
    ):
        return float(timeout_s)
    raise InvalidArgumentError(
        f"{name}: got {shown(timeout_s)}, expected a finite number of seconds >= 0"
    )
