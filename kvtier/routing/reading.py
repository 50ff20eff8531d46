"""Reading an event message's untrusted fields (the wire format `kvtier.events` documents:
vLLM's, which kvtier's and vLLM's publishers send), for every reader of them: the router's
index (`index.py`) and the vLLM connector's relay (`kvtier.integrations.vllm_events`). Each
raises `BadEvent` naming the field and what was expected; nothing here is executed or taken as
a path."""

from __future__ import annotations

from typing import Any, Protocol

import msgpack  # type: ignore[import-untyped]


class BadEvent(ValueError):
    """An event batch or event that is not what the wire format says."""


def batch_events(payload: bytes) -> list[Any]:
    """The events of one message's event batch (`[ts, [events...], dp_rank]`)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack's errors share no base class
        raise BadEvent(f"payload: not msgpack ({type(e).__name__})") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise BadEvent("payload: expected an event batch [ts, [events], dp_rank]")
    return batch[1]


def block_hash(value: Any) -> Any:
    """A block hash as the wire has it: a uint64 (kvtier, vLLM's int hashes) or bytes."""
    if type(value) is int and 0 <= value < 1 << 64:
        return value
    if isinstance(value, bytes) and 0 < len(value) <= 64:
        return value
    raise BadEvent(f"block hash: got {type(value).__name__}, expected a uint64 or bytes")


def block_hashes(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise BadEvent("block_hashes: expected a list")
    return [block_hash(v) for v in value]


def medium(value: Any) -> str:
    if value is None:
        return "GPU"  # vLLM's events before media were named come from its GPU cache
    if not isinstance(value, str) or not 0 < len(value) <= 32:
        raise BadEvent("medium: expected a short string or nil")
    return value


class Sink(Protocol):
    """What a `Subscriber` feeds, one topic (`source`) at a time: the router's `PrefixIndex`,
    or the vLLM connector's relay. `apply` and `reset` raise `BadEvent` for a payload that is
    no event batch; `orphans` only grows, and its growth on an `apply` makes a subscriber with
    a snapshot resync the publisher."""

    def apply(self, source: str, payload: bytes) -> int: ...

    def reset(self, source: str, payload: bytes) -> int: ...

    def clear(self, source: str) -> None: ...

    def orphans(self) -> int: ...
