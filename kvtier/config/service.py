"""The `service` section: the sidecar (`kvtier serve`) — where it listens, where it keeps its
state, its limits, and the host names a request may use.

Contract:
- `allowed_hosts` is a tuple of lower-cased host names or IP addresses, no ports, no
  wildcards; the bound address and loopback names are always allowed besides them.
- `max_inflight_bytes` (the bodies and load replies held at once) is at least
  `max_body_bytes`; unset, 4 GiB or four times `max_body_bytes`, the larger (`inflight_bytes`).
- `admin_key` is a literal key of at least 16 characters or `env:NAME`; errors never show it
  (`loading.py`).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import BeforeValidator, model_validator

from kvtier.config.fields import (
    FilePath,
    HostText,
    InvalidValue,
    KeyRef,
    Section,
    bytes_in,
    int_in,
    number_in,
    one_of,
)
from kvtier.sizes import MAX_SIZE, format_size

MOST_BODY_BYTES = 1 << 50
"""The largest `max_body_bytes` (1PiB): the most a client takes a server's `/v1/pools` to say."""

_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def _host_names(value: object) -> tuple[str, ...]:
    """`service.allowed_hosts`: host names (or IP addresses) that a request's `Host` may name
    besides the bound address and loopback, lower-cased; no ports, no wildcards."""
    expected = "a list of host names or IP addresses (no port, no wildcard)"
    if not isinstance(value, (list, tuple)):
        raise InvalidValue(value, expected)
    for i, name in enumerate(value):
        if not (isinstance(name, str) and len(name) <= 253 and _is_host_name(name.lower())):
            raise InvalidValue(
                name, "a host name or an IP address (no port, no wildcard)", key=str(i)
            )
    return tuple(name.lower() for name in value)


def _is_host_name(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return _HOST_NAME.fullmatch(name) is not None
    return True


class ServiceConfig(Section):
    """The sidecar (`kvtier serve`): where it listens, where it keeps its state, its limits.
    Auth is on when any tenant has an API key; without auth only a loopback address is served."""

    host: HostText = "127.0.0.1"
    port: Annotated[int, int_in(1, 65535)] = 8750
    state_dir: FilePath = "./kvtier-state"  # the server secret that keys tenant salts (0600)
    shared_memory: Annotated[bool, one_of((True, False))] = True
    max_tokens: Annotated[int, int_in(1, 1 << 24)] = 1 << 20
    # bounded: a larger one (10**30) passed, and `/v1/pools`, which names it in msgpack (64-bit
    # integers), was a 500 that no client could connect past; a client takes at most
    # MOST_BODY_BYTES there (`service/replies.py`), the budget at most a size (1024PiB)
    max_body_bytes: Annotated[int, bytes_in(1024, MOST_BODY_BYTES)] = 1 << 30
    max_inflight_bytes: Annotated[int, bytes_in(2048, MAX_SIZE)] | None = None  # `inflight_bytes`
    prefetch_wait_s: Annotated[float, number_in(0.0, 3600.0, "seconds in (0, 3600]")] = 30.0
    body_timeout_s: Annotated[float, number_in(0.0, 3600.0, "seconds in (0, 3600]")] = 30.0
    allowed_hosts: Annotated[tuple[str, ...], BeforeValidator(_host_names)] = ()
    admin_key: KeyRef | None = None

    @model_validator(mode="after")
    def _inflight_holds_a_body(self) -> ServiceConfig:
        inflight = self.max_inflight_bytes
        if inflight is not None and inflight < self.max_body_bytes:
            raise InvalidValue(
                inflight,
                f"at least max_body_bytes ({format_size(self.max_body_bytes)}, "
                f"{self.max_body_bytes} bytes): the largest body or load reply must fit",
                "max_inflight_bytes",
            )
        return self

    @property
    def inflight_bytes(self) -> int:
        """What requests may hold in memory at once (`service/budget.py`): the setting, else
        4 GiB or four times `max_body_bytes`, the larger."""
        if self.max_inflight_bytes is not None:
            return self.max_inflight_bytes
        return max(4 << 30, 4 * self.max_body_bytes)
