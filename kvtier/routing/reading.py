"""Reading an event message's untrusted fields (the wire format `kvtier.events` documents,
and vLLM 0.33's tagged events: below), for every reader of them: the router's
index (`index.py`) and the vLLM connector's relay (`kvtier.integrations.vllm_events`). Each
raises `BadEvent` naming the field and what was expected; nothing here is executed or taken as
a path.

Two spellings of an event are read: the positional array kvtier sends (llm-d's documented
layout, which vLLM sent before 0.33: `["BlockStored", hashes, parent, tokens, block_size,
lora_id, medium, lora_name]`), and the tagged map vLLM 0.33 sends (`{"type": "BlockStored",
"block_hashes": ..., ...}`, msgspec's `tag=True`), which `positional` turns into the first (the
router's index does; the relay reads kvtier's arrays only); a map's fields past those are
ignored.

Bounds: a message's decode is bounded (`batch_events`: `MAX_EVENTS`, `MAX_ARRAYS`, `MAX_ITEMS`,
`MAX_MAPS`; past 20 MiB, as many entries as its bytes hold in kvtier's own wire, and a
snapshot's events and arrays alike: `Bounds`), whatever the length the subscriber let through:
a message past them is a `BadEvent` before it costs more than about 64 bytes an entry of
`MAX_ITEMS` (up to 20 MiB, as before), or past that some 9 times its bytes, 18 of one-
character non-Latin strings (measured with `tracemalloc` and maxrss: a router sizes the
snapshot client's `max_reply_bytes` for the pods it does not trust).
Fixed bounds alone refused what kvtier sends: a sidecar's `GET /v1/blocks` is one batch per
topic (a store of 70,000 one-block prompts: 70,000 events, 3.6 MB), so a router's resync
refused it and forgot every block of the pod, at each resync; and a message of
`events.max_message_bytes` raised to 64 MiB (the subscriber's raised with it) telling of a
300,000-block run was refused whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import msgpack  # type: ignore[import-untyped]


class BadEvent(ValueError):
    """An event batch or event that is not what the wire format says."""


MAX_EVENTS = 1 << 16
"""Events one message may hold (a kvtier message holds 512 at most, `events.max_batch`; a vLLM
message, one engine step's: a few per request)."""
MAX_ARRAYS = 4 * MAX_EVENTS
"""Arrays one message may hold: an event is an array and two more (hashes, tokens)."""
MAX_ITEMS = 1 << 22
"""Array entries one message may hold, all its arrays together: 4 Mi, the tokens of an 8 MiB
kvtier message of realistic ids (3-5 bytes each packed) and their hashes."""
MAX_MAPS = MAX_EVENTS + 16  # vLLM 0.33 sends each event as a map (module doc)
MAX_MAP_LEN = 64  # fields of one map (a vLLM 0.33 BlockStored has 16: room for later ones)
ITEM_BYTES = 5  # the fewest bytes of an entry of kvtier's wire: a token id (msgpack uint 32)
EVENT_BYTES = 16  # of an event: a BlockRemoved of one hash takes 28, a BlockStored more
ARRAY_BYTES = 8  # of an array: an event's three take 28 bytes at least, a clear's one 18


class Bounds(NamedTuple):
    """What one payload may make msgpack build (module doc): the fixed bounds, or, past them,
    as many entries as a payload of its length holds in kvtier's wire at the most, and for a
    snapshot (`GET /v1/blocks`: a whole topic in one batch) as many events and arrays too. Maps
    stay bounded (vLLM's events, a few per message; 1-entry maps cost 12 times their bytes)."""

    events: int
    arrays: int
    items: int
    maps: int

    @classmethod
    def of(cls, size: int, snapshot: bool = False) -> Bounds:
        """The bounds of a payload of `size` bytes (a snapshot's, with `snapshot`)."""
        items = max(MAX_ITEMS, size // ITEM_BYTES)
        if not snapshot:
            return cls(MAX_EVENTS, MAX_ARRAYS, items, MAX_MAPS)
        events, arrays = max(MAX_EVENTS, size // EVENT_BYTES), max(MAX_ARRAYS, size // ARRAY_BYTES)
        return cls(events, arrays, items, MAX_MAPS)


class _Budget:
    """Counts what msgpack builds and stops it past the bounds (`batch_events`)."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.arrays = self.items = self.maps = 0

    def array(self, value: list[Any]) -> list[Any]:
        self.arrays += 1
        self.items += len(value)
        if self.arrays > self.bounds.arrays or self.items > self.bounds.items:
            most = f"{self.bounds.arrays} arrays or {self.bounds.items} entries"
            raise BadEvent(f"payload: more than {most}")
        return value

    def map(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self.maps += 1
        if self.maps > self.bounds.maps:
            raise BadEvent(f"payload: more than {self.bounds.maps} maps")
        return value


def batch_events(payload: bytes, snapshot: bool = False) -> list[Any]:
    """The events of one message's event batch (`[ts, [events...], dp_rank]`), decoded within
    bounds (module doc): an array of more than `MAX_ITEMS` entries is refused from its header,
    before anything is built, and the arrays, entries and maps built are counted as they are,
    so that a message costs memory in proportion to what a real one holds, not 60 times its
    bytes (an empty array is one byte on the wire and 64 in Python); a longer payload, or a
    `snapshot`'s, within `Bounds.of` its length."""
    bounds = Bounds.of(len(payload), snapshot)
    budget = _Budget(bounds)
    try:
        batch = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, max_array_len=bounds.items,
            max_map_len=MAX_MAP_LEN, max_ext_len=0, list_hook=budget.array,
            object_hook=budget.map,
        )  # fmt: skip
    except BadEvent:
        raise
    except Exception as e:  # msgpack's errors share no base class
        raise BadEvent(f"payload: not msgpack ({type(e).__name__})") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise BadEvent("payload: expected an event batch [ts, [events], dp_rank]")
    if len(batch[1]) > bounds.events:
        raise BadEvent(f"payload: {len(batch[1])} events, expected at most {bounds.events}")
    return batch[1]


FIELD_NAMES = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip
"""Per kind, the fields of its positional array after the kind, by their vLLM names."""


def positional(event: Any) -> Any:
    """`event` as a positional array when it is a tagged map of a known kind (module doc);
    anything else as it came (a map of no known kind stays a map: its reader counts it bad).
    A field the map lacks is nil in the array: the reader checks each field's type."""
    if not isinstance(event, dict):
        return event
    kind = event.get("type")
    names = FIELD_NAMES.get(kind) if isinstance(kind, str) else None
    if names is None:
        return event
    return [kind, *(event.get(name) for name in names)]


def starts_cleared(payload: bytes) -> bool:
    """Does the batch's first event say AllBlocksCleared? Read from the payload's head, a few
    fields, whatever its size (a subscriber needs no recovery for a gap before it)."""
    reader = msgpack.Unpacker(raw=False, max_buffer_size=len(payload) or 1)
    reader.feed(payload)
    try:
        if reader.read_array_header() < 2:
            return False
        reader.skip()  # ts
        if reader.read_array_header() < 1:
            return False
        head = payload[reader.tell()]
        if 0x80 <= head <= 0x8F or head in (0xDE, 0xDF):  # a tagged map (vLLM 0.33)
            kind = None  # the last "type", as the map's decode keeps it (`positional`)
            for _ in range(reader.read_map_header()):
                if reader.unpack() == "type":
                    kind = reader.unpack()
                else:
                    reader.skip()
            return bool(kind == "AllBlocksCleared")
        if reader.read_array_header() < 1:
            return False
        return bool(reader.unpack() == "AllBlocksCleared")
    except Exception:  # not a batch of events: `batch_events` counts it when it is applied
        return False


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
