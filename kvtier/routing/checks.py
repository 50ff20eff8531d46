"""The routing API's argument checks (`PrefixIndex`, `Router`, `Subscriber`): each raises
`InvalidArgumentError` naming the argument, the value and what was expected, at construction or
call, before anything changes (a NaN weight or slack otherwise scored a pod holding a whole
prompt 0, or made `choose` fail later with a bare `ValueError`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvtier.config.events import is_peer_address
from kvtier.errors import InvalidArgumentError, shown

MAX_PUBLISHERS = 256
"""Publishers one `Subscriber` hears at once: 3 ZMQ sockets each, of ZMQ's 1,023 a context."""


def number(name: str, value: object, least: float, integer: bool = False) -> float:
    """`value` when it is a finite number (an int with `integer`; never a bool) >= `least`."""
    kinds = (int,) if integer else (int, float)
    if (
        not isinstance(value, kinds)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < least
    ):
        kind = "an int" if integer else "a finite number"
        raise InvalidArgumentError(f"{name}: got {shown(value)}, expected {kind} >= {least:g}")
    return value


def weights(value: object) -> dict[str, float]:
    """`value` as a table of medium name -> weight, each a finite number >= 0."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"weights: got {shown(value)}, expected a mapping")
    for medium in value:
        if not isinstance(medium, str):
            raise InvalidArgumentError(f"weights: got key {shown(medium)}, expected a medium name")
        number(f"weights[{medium!r}]", value[medium], 0.0)
    return {medium: float(weight) for medium, weight in value.items()}


def name(argument: str, value: object) -> str | None:
    """`value` when it is a string or None."""
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentError(f"{argument}: got {shown(value)}, expected a string or None")
    return value


def sizes(**values: object) -> tuple[int, ...]:
    """Each of `values` (by argument name) when it is an int >= 1: a bound in bytes or items
    (`max_message_bytes=0` divided by zero in the subscriber's thread)."""
    return tuple(int(number(name, value, 1, integer=True)) for name, value in values.items())


def address(name: str, value: object) -> str:
    """`value` when it is a ZMQ address to connect to (`tcp://HOST:PORT`, no `*`, or
    `ipc://PATH`: `kvtier.config.events.is_peer_address`)."""
    if not is_peer_address(value):
        expected = "a ZMQ address to connect to: tcp://HOST:PORT (no *) or ipc://PATH"
        raise InvalidArgumentError(f"{name}: got {shown(value)}, expected {expected}")
    assert isinstance(value, str)
    return value


def another(name: str, value: object, heard: int) -> None:
    """Whether a `Subscriber` that hears `heard` publishers may add the one at `value`: at most
    `MAX_PUBLISHERS` (past 341, ZMQ had no socket left, and those added went unheard silently)."""
    if heard >= MAX_PUBLISHERS:
        raise InvalidArgumentError(
            f"{name}: got {shown(value)}, but this subscriber hears {MAX_PUBLISHERS} publishers "
            "already, the most it takes: remove one, or use another Subscriber"
        )
