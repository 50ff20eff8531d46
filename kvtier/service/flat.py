"""Decoding msgpack and JSON from an untrusted peer in memory bounded by what the API needs.

    loads_msgpack(data, max_items, top=dict) -> dict (or list, for the lane's envelope)
    loads_json(data, max_items) -> dict              a request body (the server's side)
    loads_reply(data, content_type) -> Any           a reply body (the clients' side)

A general decoder builds whatever the bytes describe, and what they describe can cost far more
memory than they take: an empty array is one byte of msgpack and a 56-byte list plus a pointer,
so a 19 MiB body of nested empty arrays held 1.4 GiB of `kvtier serve` for 4.5 s (73x;
`tests/test_service_bodies.py`), and the default `max_body_bytes` is 1 GiB (a client reads
replies of as much). A document of at most `SMALL` bytes is decoded as it is (73 times 64 KiB is
under 5 MiB) and then checked; a larger one is walked, each value's extent read from its header
before it is decoded:

Requests. Every body of the data plane is *flat*: a map whose values are scalars, strings, byte
strings (the KV, packed tokens) or arrays of scalars (tokens as a list, leases to release, a
shape).
- The top level is a map (for the lane's envelope, an array) of at most `MAX_FIELDS` entries,
  its keys strings of at most `MAX_KEY_BYTES`.
- A scalar or string is decoded from its own bytes (its header gives its length); a byte string
  is a `memoryview` of the body, not a copy (a store's KV is read in place).
- An array has at most `max_items` elements (the caller passes `service.max_tokens`; more is
  `TooMany`, 413), each a number, a bool or nil: it is decoded from at most `9 * count + 5`
  bytes (the widest scalar is 9), with nested arrays, maps, strings, byte strings and extension
  types refused (`Malformed`, 400). So an array costs at most about 12 bytes of memory per byte
  of the body (a 3-byte int is a 36-byte object and its pointer), and at most `max_items`
  elements: the most a legitimate list of tokens costs, within a small factor.
- A map inside the top level, an extension type, the unused byte 0xc1 and trailing bytes are
  refused, and so is a key given twice (JSON and msgpack took the last: a proxy that checked
  the first `tokens` or `lease_id` passed a request that acts on another).
JSON (control calls, curl) carries no bytes, so a JSON body is at most `json_limit(max_items)`
bytes (413 past it: 16 bytes a token and 64 KiB), holds at most `MAX_CONTAINERS` `[` / `{`
and `MAX_QUOTES` quote characters (counted over the raw bytes, inside strings too: no field of
the API needs them), and must decode to a map of scalars and arrays of scalars.

Replies (a status, the pools, a lease, a load's KV) nest, to `MAX_DEPTH` levels: a large one is
walked with every map entry and array element counted against `MAX_REPLY_ITEMS` before it is
made (map keys are strings), an array of numbers decoded in bulk as above, any other element by
element, so a reply of any length costs at most some 60 bytes an item;
a JSON reply (the edge's refusals) is at most `MAX_JSON_REPLY` bytes of at most
`MAX_CONTAINERS_REPLY` containers. `Malformed` for anything else.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterable
from typing import Any

import msgpack  # type: ignore[import-untyped]

SMALL = 1 << 16  # decoded as it is: at most 73 times as much memory, under 5 MiB
MAX_FIELDS = 32
MAX_KEY_BYTES = 64
MAX_CONTAINERS = 16
MAX_QUOTES = 512
WIDEST_SCALAR = 9  # a float64 or a 64-bit int: one type byte and eight bytes
SCALARS = (int, float, bool, type(None))  # what a request's array may hold
MAX_DEPTH = 8
MAX_REPLY_ITEMS = 1 << 21  # a lease's slots of a prompt of `max_tokens`, a status of tenants
MAX_JSON_REPLY = 8 << 20
MAX_CONTAINERS_REPLY = 1 << 16


class Malformed(ValueError):
    """The body is not a flat map (or envelope) as the API's requests are; the message says
    what was found where."""


class TooMany(Malformed):
    """An array, or a JSON body, larger than any request needs; `field` names the array (None:
    the body)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def json_limit(max_items: int) -> int:
    """The largest JSON body a request needs: a list of `max_items` token ids (at most ten
    digits, a comma and a space each) and its other fields."""
    return 16 * max_items + (1 << 16)


def loads_json(data: bytes | bytearray, max_items: int) -> dict[str, Any]:
    """A JSON request body as a flat map (module doc)."""
    limit = json_limit(max_items)
    if len(data) > limit:
        raise TooMany(
            f"a JSON body of {len(data)} bytes, more than {limit} (16 a token of "
            f"service.max_tokens={max_items} and 64 KiB): send KV and long prompts as msgpack"
        )
    containers, quotes = data.count(b"[") + data.count(b"{"), data.count(b'"')
    if containers > MAX_CONTAINERS or quotes > MAX_QUOTES:
        raise Malformed(
            f"{containers} '[' or '{{' and {quotes} quotes, expected at most "
            f"{MAX_CONTAINERS} and {MAX_QUOTES}: a request is one map of scalars and lists"
        )
    try:
        value = json.loads(data, object_pairs_hook=_unique)
    except Malformed:
        raise
    except ValueError as exc:
        raise Malformed(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Malformed(f"got {type(value).__name__}, expected a map")
    for key, field in value.items():
        if isinstance(field, dict) or (
            isinstance(field, list) and any(isinstance(v, (list, dict)) for v in field)
        ):
            raise Malformed(f"{key[:MAX_KEY_BYTES]}: expected a scalar or a list of scalars")
        if isinstance(field, list) and len(field) > max_items:
            raise TooMany(_too_many(key, len(field), max_items), key)
    return value


def loads_reply(data: bytes | bytearray, content_type: str | None) -> Any:
    """A reply body, msgpack (`application/msgpack`) or JSON, in bounded memory (module doc)."""
    if not data:
        raise Malformed("empty")
    if (content_type or "").split(";")[0].strip().lower() != "application/msgpack":
        return _json_reply(data)
    view = memoryview(data)
    if len(view) <= SMALL:
        try:
            return msgpack.unpackb(view, raw=False)
        except Exception as exc:  # msgpack's errors share no base; a key it cannot hash
            raise Malformed(f"not msgpack ({type(exc).__name__}: {str(exc)[:80]})") from None
    value, end = _node(view, 0, "reply", [MAX_REPLY_ITEMS], MAX_DEPTH)
    if end != len(view):
        raise Malformed(f"{len(view) - end} bytes past the end of the reply")
    return value


def _json_reply(data: bytes | bytearray) -> Any:
    containers = data.count(b"[") + data.count(b"{")
    if len(data) > MAX_JSON_REPLY or containers > MAX_CONTAINERS_REPLY:
        raise Malformed(
            f"a JSON reply of {len(data)} bytes and {containers} '[' or '{{', expected at most "
            f"{MAX_JSON_REPLY} and {MAX_CONTAINERS_REPLY}"
        )
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise Malformed(f"not valid JSON: {str(exc)[:80]}") from None


def _node(view: memoryview, at: int, name: str, budget: list[int], depth: int) -> tuple[Any, int]:
    """The value at `at` of a reply and where it ends, its items counted off `budget`."""
    kind, count, start = _header(view, at)
    if kind in ("ext", "unused"):
        raise Malformed(f"{name}: a msgpack {kind}")
    if kind not in ("map", "array"):
        end = start + count
        if end > len(view):
            raise Malformed(f"{name}: cut off ({end - len(view)} bytes missing)")
        if kind == "bin":
            return view[start:end], end
        try:
            return msgpack.unpackb(view[at:end], raw=False), end
        except ValueError as exc:  # not valid UTF-8
            raise Malformed(f"{name}: {exc}") from None
    if count > budget[0] or depth == 0:
        raise TooMany(f"{name}: more than {MAX_REPLY_ITEMS} items or {MAX_DEPTH} levels in all")
    budget[0] -= count * (2 if kind == "map" else 1)
    if kind == "array":  # numbers (a lease's slots) in bulk, from 9 bytes an element at most
        with contextlib.suppress(Malformed):  # else (strings, arrays in it) element by element
            return scalar_array(view, at, start, count, name)
    items, at = [], start
    for i in range(count * (2 if kind == "map" else 1)):
        item, at = _node(view, at, f"{name}[{i // 2 if kind == 'map' else i}]", budget, depth - 1)
        items.append(item)
    if kind == "array":
        return items, at
    if not all(type(key) is str for key in items[::2]):
        raise Malformed(f"{name}: a map key that is not a string")
    return dict(zip(items[::2], items[1::2], strict=True)), at


def loads_msgpack(data: bytes | bytearray | memoryview, max_items: int, top: type = dict) -> Any:
    """A msgpack request body as a flat map, or with `top=list` a flat array (module doc)."""
    view = memoryview(data)
    if not view:
        raise Malformed("empty")
    if len(view) <= SMALL:
        try:
            value = msgpack.unpackb(view, raw=False, object_pairs_hook=_unique)
        except Malformed:
            raise
        except Exception as exc:  # msgpack's errors share no base; a key it cannot hash
            raise Malformed(f"not msgpack ({type(exc).__name__}: {str(exc)[:80]})") from None
        return _checked(value, top, max_items)
    kind, count, at = _header(view, 0)
    if kind != ("map" if top is dict else "array"):
        raise Malformed(f"got a msgpack {kind}, expected a {'map' if top is dict else 'array'}")
    if count > MAX_FIELDS:
        raise Malformed(f"{count} entries, expected at most {MAX_FIELDS}")
    items: list[Any] = []
    for i in range(count * (2 if top is dict else 1)):
        is_key = top is dict and i % 2 == 0
        name = f"entry {i}" if top is not dict else f"key {i // 2}" if is_key else items[-1]
        value, at = _field(view, at, name, max_items)
        if is_key and not (isinstance(value, str) and len(value) <= MAX_KEY_BYTES):
            raise Malformed(f"key {i // 2}: expected a string of at most {MAX_KEY_BYTES} bytes")
        if is_key and value in items[::2]:  # (at most MAX_FIELDS keys)
            raise Malformed(f"{value}: given twice, expected each field once")
        items.append(value)
    if at != len(view):
        raise Malformed(f"{len(view) - at} bytes past the end of the {kind}")
    if top is dict:
        return dict(zip(items[::2], items[1::2], strict=True))
    return items


def _field(view: memoryview, at: int, name: str, max_items: int) -> tuple[Any, int]:
    """The value starting at `at` and where it ends."""
    kind, count, start = _header(view, at)
    if kind == "array":
        if count > max_items:
            raise TooMany(_too_many(name, count, max_items), name)
        value, end = scalar_array(view, at, start, count, name)
        if not set(map(type, value)) <= set(SCALARS):
            raise Malformed(f"{name}: expected an array of numbers, bools or nils")
        return value, end
    if kind in ("map", "ext", "unused"):
        raise Malformed(f"{name}: got a msgpack {kind}, expected a scalar or an array")
    end = start + count
    if end > len(view):
        raise Malformed(f"{name}: cut off ({end - len(view)} bytes missing)")
    if kind == "bin":
        return view[start:end], end  # the body's own bytes: no copy (the KV, packed tokens)
    try:
        return msgpack.unpackb(view[at:end], raw=False), end
    except ValueError as exc:  # not valid UTF-8
        raise Malformed(f"{name}: {exc}") from None


def scalar_array(
    view: memoryview, at: int, start: int, count: int, name: str
) -> tuple[list[Any], int]:
    """The array of `count` scalars whose header is at `at` (its elements from `start`), decoded
    from no more bytes than such an array can take (no strings but empty ones), and where it
    ends; `Malformed` for a nested array or map, an extension type, a cut-off one."""
    unpacker = msgpack.Unpacker(
        raw=False, max_str_len=0, max_bin_len=0, max_ext_len=0, max_map_len=0,
        max_array_len=count, list_hook=_Nesting(name), object_hook=_refuse_map(name),
    )  # fmt: skip
    unpacker.feed(view[at : start + WIDEST_SCALAR * count])
    try:
        value = unpacker.unpack()
    except Malformed:
        raise
    except (ValueError, msgpack.OutOfData) as exc:  # its limits, a cut-off body
        raise Malformed(f"{name}: expected an array of scalars ({type(exc).__name__})") from None
    return value, at + unpacker.tell()


def _unique(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A map's pairs as a dict, `Malformed` naming a key given twice (a request's)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        twice = next(key for i, (key, _) in enumerate(pairs) if key in dict(pairs[:i]))
        raise Malformed(f"{str(twice)[:MAX_KEY_BYTES]}: given twice, expected each field once")
    return value


def _checked(value: Any, top: type, max_items: int) -> Any:
    """`value` (decoded whole: a small body) if it is what the walk accepts (module doc)."""
    fields: Iterable[tuple[Any, Any]]
    if top is dict and isinstance(value, dict):
        fields = value.items()
    elif top is list and isinstance(value, list):
        fields = ((f"entry {i}", item) for i, item in enumerate(value))
    else:
        raise Malformed(f"got {type(value).__name__}, expected a {top.__name__}")
    if len(value) > MAX_FIELDS:
        raise Malformed(f"{len(value)} entries, expected at most {MAX_FIELDS}")
    for name, field in fields:
        if not (isinstance(name, str) and len(name) <= MAX_KEY_BYTES):
            raise Malformed(f"key {name!r:.80}: expected a string of at most {MAX_KEY_BYTES}")
        if isinstance(field, list):
            if len(field) > max_items:
                raise TooMany(_too_many(name, len(field), max_items), name)
            if not set(map(type, field)) <= set(SCALARS):
                raise Malformed(f"{name}: expected an array of numbers, bools or nils")
        elif not isinstance(field, (*SCALARS, str, bytes)):
            raise Malformed(f"{name}: got a {type(field).__name__}, expected a scalar or an array")
    return value


class _Nesting:
    """A `list_hook` that refuses a second array: the first one completed is the field's own
    unless it holds another, and then that one completes first."""

    def __init__(self, name: str) -> None:
        self.name, self.seen = name, False

    def __call__(self, value: list[Any]) -> list[Any]:
        if self.seen:
            raise Malformed(f"{self.name}: an array inside an array, expected scalars")
        self.seen = True
        return value


def _refuse_map(name: str) -> Any:
    def hook(value: Any) -> Any:
        raise Malformed(f"{name}: a map inside an array, expected scalars")

    return hook


def _too_many(name: str, count: int, max_items: int) -> str:
    return f"{name}: {count} items, more than {max_items}"


# (kind, how the length is read: 0 fixed by the type byte, else the struct format's size)
_SIZED = {
    0xC4: ("bin", ">B"), 0xC5: ("bin", ">H"), 0xC6: ("bin", ">I"),
    0xD9: ("str", ">B"), 0xDA: ("str", ">H"), 0xDB: ("str", ">I"),
    0xDC: ("array", ">H"), 0xDD: ("array", ">I"), 0xDE: ("map", ">H"), 0xDF: ("map", ">I"),
}  # fmt: skip
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
          0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}  # fmt: skip


def _header(view: memoryview, at: int) -> tuple[str, int, int]:
    """(kind, n, where the value's payload starts) of the value at `at`: for "array" and "map"
    n is the number of entries, else the payload's length in bytes."""
    if at >= len(view):
        raise Malformed("cut off: a value expected past the end")
    byte = view[at]
    if byte <= 0x7F or byte >= 0xE0:
        return "scalar", 0, at + 1
    if byte <= 0x8F:
        return "map", byte & 0x0F, at + 1
    if byte <= 0x9F:
        return "array", byte & 0x0F, at + 1
    if byte <= 0xBF:
        return "str", byte & 0x1F, at + 1
    if byte in _FIXED:
        return "scalar", _FIXED[byte], at + 1
    if byte in _SIZED:
        kind, fmt = _SIZED[byte]
        size = struct.calcsize(fmt)
        if at + 1 + size > len(view):
            raise Malformed("cut off inside a header")
        (n,) = struct.unpack_from(fmt, view, at + 1)
        return kind, n, at + 1 + size
    return ("unused" if byte == 0xC1 else "ext"), 0, at + 1
