"""The sidecar's wire format: request and response bodies, shared by server and client.

Bodies are msgpack (`application/msgpack`) or JSON (`application/json`, for control calls and
curl); a response comes in the request's format. Token ids travel as packed little-endian
unsigned 32-bit ints (msgpack `bin`; the same bytes as int32 for ids below 2**31) or, in JSON,
as a list of ints. A KV payload is `{"kv": bytes, "dtype": "bfloat16", "shape": [...]}`, the
tensor's raw bytes in C order (msgpack only; JSON has no bytes).

    POST /v1/lookup    {tokens}                       -> {num_tokens, gpu_tokens, host_tokens,
                                                          disk_tokens, remote_tokens}
    POST /v1/prefetch  {tokens, ttl_s?, wait_s?,      -> lease
                        release?, request?, as_load?}
    POST /v1/release   {lease_id} or {request}        -> {}
    POST /v1/store     {tokens, kv, dtype, shape}     -> {cached_tokens, stored_tokens, ...}
    POST /v1/load      {tokens, start?}               -> {num_tokens, kv, dtype, shape,
                                                          truncated?}  (at most max_body_bytes
                                                          of KV: ask again from num_tokens)
    POST /v1/reserve   {tokens, ttl_s?, release?,     -> reservation
                        request?}
    POST /v1/commit    {reservation_id}               -> store result
    POST /v1/abort     {reservation_id} or {request}  -> {}

`as_load`: true for a client's load over shared memory (a lease it reads and releases): counted
in `ops.loads` / `loaded_tokens` (the tokens leased), not `prefetches`; a server before it
ignores the field (unknown fields are), counting a prefetch.
`request`: a token the client drew for a prefetch or reserve; a release or abort by it gives
back what that request was granted even when its reply was lost (`service/grants.py`).

Every failure is `{"error": <kind>, "detail": <message>}` with a status code (`ERRORS`).
Every byte of a request is untrusted: a body is decoded as a flat map in bounded memory
(`decode_request`, `flat.py`), each field is checked for its type, range and size here (or by
the store) and refused with `WireError` or a kvtier error naming the bad value; nothing a client
sends reaches a `hash()`, a recursion without a bound, or an arithmetic that overflows. `decode`
reads a reply (the client's side).
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any, TypeGuard

import msgpack  # type: ignore[import-untyped]
import numpy as np
import torch

from kvtier.blocks import DTYPES
from kvtier.errors import (
    CapacityError,
    ClosedError,
    InvalidArgumentError,
    InvalidKVError,
    InvalidTokensError,
    KVTierError,
    LeaseError,
    NotWrittenError,
    QuotaError,
    StorageError,
    UnknownTenantError,
    shown,
)
from kvtier.service import flat

MSGPACK = "application/msgpack"
JSON = "application/json"
MEDIA_TYPES = (JSON, MSGPACK)
"""The request bodies the service reads; any other is refused (415) before the body is read."""

MAX_KV_DIMS = 8
"""A KV `shape` of more dimensions is refused before its size is computed."""

ERRORS: dict[type[KVTierError], tuple[int, str]] = {
    QuotaError: (429, "quota"),  # before CapacityError, its base: the first match wins
    NotWrittenError: (409, "not_written"),
    StorageError: (503, "storage"),
    InvalidTokensError: (400, "invalid_tokens"),
    InvalidArgumentError: (400, "invalid_argument"),
    InvalidKVError: (422, "invalid_kv"),
    LeaseError: (404, "unknown_lease"),
    UnknownTenantError: (403, "unknown_tenant"),  # who the caller is; a named one: 404 (bodies)
    CapacityError: (507, "capacity"),
    ClosedError: (503, "closed"),
}
"""kvtier errors -> (HTTP status, error kind). Others are 500s, which tests forbid."""


def classify(exc: KVTierError) -> tuple[int, str]:
    """(status, kind) of a kvtier error: its class's, or its nearest base's in `ERRORS`."""
    for cls, found in ERRORS.items():
        if isinstance(exc, cls):
            return found
    return 400, "invalid_argument"


class WireError(Exception):
    """A request the service refuses before it reaches the store."""

    def __init__(self, status: int, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.kind, self.detail = status, kind, detail


def media_type(content_type: str | None) -> str:
    """The bare, lower-case media type of a `Content-Type` header ('' for none)."""
    return (content_type or "").split(";")[0].strip().lower()


def is_msgpack(content_type: str | None) -> bool:
    return media_type(content_type) == MSGPACK


def decode(body: bytes, content_type: str | None) -> dict[str, Any]:
    """A reply body as a dict, in bounded memory (`flat.loads_reply`); `WireError(400)` if it
    is not one."""
    try:
        data = flat.loads_reply(body, content_type)
    except flat.Malformed as exc:
        raise WireError(400, "malformed_body", f"body is not a reply: {exc}") from None
    if not isinstance(data, dict):
        raise WireError(400, "malformed_body", f"body: got {type(data).__name__}, expected a map")
    return data


MAX_LIST = 4096
"""The longest list a request has but its tokens (leases to release: `MAX_RELEASES`)."""


def decode_request(
    body: bytes | bytearray, content_type: str | None, max_tokens: int
) -> dict[str, Any]:
    """A request body as a flat map, decoded in memory bounded by what a request needs
    (`flat.py`): `WireError` 400 if it is not one; 413 for a list longer than `max_tokens`
    (`service.max_tokens`) and `MAX_LIST` (`too_many_tokens` for the tokens), or a JSON body
    longer than any request needs."""
    items = max(max_tokens, MAX_LIST)
    try:
        if is_msgpack(content_type):
            return flat.loads_msgpack(body, items)  # type: ignore[no-any-return]
        return flat.loads_json(body, items)
    except flat.TooMany as exc:
        if exc.field == "tokens":
            raise WireError(
                413, "too_many_tokens", f"tokens: more than service.max_tokens={max_tokens}"
            ) from None
        raise WireError(413, "body_too_large", f"body: {exc}") from None
    except flat.Malformed as exc:
        raise WireError(400, "malformed_body", f"body is not a request: {exc}") from None


def encode_parts(data: dict[str, Any], msgpack_body: bool) -> list[bytes | memoryview]:
    """`encode`, in parts that make the body one after the other: a msgpack reply's `kv`
    payload (a load's) stays where it lies, its last part, not copied into the body."""
    kv = data.get("kv")
    if not (msgpack_body and isinstance(kv, memoryview)):
        return [encode(data, msgpack_body)]
    packer = msgpack.Packer(use_bin_type=True)
    head = [packer.pack_map_header(len(data))]
    head += [packer.pack(key) + packer.pack(value) for key, value in data.items() if key != "kv"]
    head += [packer.pack("kv"), b"\xc6" + len(kv).to_bytes(4, "big")]  # bin 32, then the bytes
    return [b"".join(head), kv]


def encode(data: dict[str, Any], msgpack_body: bool) -> bytes:
    """A response body; `WireError` 400 for bytes (a load's KV) in JSON, which has none."""
    if msgpack_body:
        return msgpack.packb(data, use_bin_type=True)  # type: ignore[no-any-return]
    try:
        return json.dumps(data).encode()
    except TypeError:
        raise no_bytes_in_json() from None


def no_bytes_in_json() -> WireError:
    """The 400 of a reply of bytes asked for in JSON: a route whose reply always carries
    bytes (a load's KV, /v1/blocks' events) answers it before it runs, so that the refused
    call changes nothing (`app.call`)."""
    return WireError(
        400,
        "invalid_argument",
        "the response carries KV bytes, which JSON cannot: send the request as application/msgpack",
    )


def tokens_field(data: dict[str, Any], max_tokens: int) -> np.ndarray | list[int]:
    """The `tokens` of a request: packed uint32 bytes or a list of ints (validated later by the
    store, which names bad ids); `WireError` 400 if missing or of the wrong kind, 413 if too
    many."""
    value = data.get("tokens")
    if isinstance(value, bytes | memoryview):
        if len(value) % 4:
            raise WireError(
                400, "invalid_tokens", f"tokens: {len(value)} bytes, expected a multiple of 4"
            )
        count = len(value) // 4
        tokens: np.ndarray | list[int] = np.frombuffer(value, dtype="<u4")
    elif isinstance(value, list):
        count, tokens = len(value), value
        if count <= max_tokens and bool in set(map(type, value)):
            at = next(i for i, v in enumerate(value) if type(v) is bool)
            raise WireError(
                400, "invalid_tokens", f"tokens[{at}]: got {shown(value[at])}, expected an int"
            )
    else:
        raise WireError(
            400,
            "invalid_tokens",
            f"tokens: got {type(value).__name__}, expected packed uint32 bytes or a list of ints",
        )
    if count > max_tokens:
        raise WireError(
            413, "too_many_tokens", f"tokens: {count}, more than service.max_tokens={max_tokens}"
        )
    return tokens


def number_field(data: dict[str, Any], name: str, default: float | None) -> float | None:
    """`data[name]` as a finite float (`default` when absent); `WireError` 400 for anything
    else: a bool, a string, nan, inf, an int too large for a float."""
    value = data.get(name, default)
    if value is None:
        return None
    if type(value) in (int, float):
        with contextlib.suppress(OverflowError):
            number = float(value)
            if math.isfinite(number):
                return number
    raise WireError(
        400, "invalid_argument", f"{name}: got {shown(value)}, expected a finite number"
    )


def wait_field(data: dict[str, Any], bound: float) -> float:
    """The `wait_s` of a request: a finite number of seconds >= 0, cut to `bound` (absent or
    null: `bound`); `WireError` 400 otherwise."""
    wait_s = number_field(data, "wait_s", bound)
    if wait_s is None:
        return bound
    if wait_s < 0:
        raise WireError(
            400, "invalid_argument", f"wait_s: got {shown(wait_s)}, expected seconds >= 0"
        )
    return min(wait_s, bound)


def bool_field(data: dict[str, Any], name: str) -> bool:
    """`data[name]` as a bool (False when absent); `WireError` 400 for anything else (0, "true",
    null: a closed, typed field)."""
    value = data.get(name, False)
    if type(value) is not bool:
        detail = f"{name}: got {shown(value)}, expected true or false"
        raise WireError(400, "invalid_argument", detail)
    return value


def int_field(data: dict[str, Any], name: str) -> int:
    value = data.get(name)
    if type(value) is not int:
        raise WireError(400, "invalid_argument", f"{name}: got {shown(value)}, expected an integer")
    return value


def kv_to_wire(kv: torch.Tensor) -> dict[str, Any]:
    kv = kv.detach().to("cpu").contiguous()
    return {
        "kv": kv.view(torch.uint8).reshape(-1).numpy().data,  # packed without a copy
        "dtype": str(kv.dtype).removeprefix("torch."),
        "shape": list(kv.shape),
    }


def kv_from_wire(data: dict[str, Any]) -> torch.Tensor:
    """The `kv` payload of a request; `WireError` 400 if malformed, 422 for an unknown dtype
    (the store itself refuses a dtype or shape that is not its layout's, with InvalidKVError)."""
    raw, dtype, shape = data.get("kv"), data.get("dtype"), data.get("shape")
    if not isinstance(raw, bytes | memoryview):
        raise WireError(400, "invalid_kv", "kv: expected the tensor's raw bytes (msgpack bin)")
    if not (isinstance(dtype, str) and dtype in DTYPES):
        raise WireError(
            422, "invalid_kv", f"dtype: got {shown(dtype)}, expected one of {list(DTYPES)}"
        )
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_KV_DIMS
        and all(type(n) is int and n >= 0 for n in shape)
        and math.prod(max(n, 1) for n in shape) < 2**62  # strides in int64, even of 0 bytes
    ):
        raise WireError(
            400,
            "invalid_kv",
            f"shape: got {shown(shape)}, expected a list of at most {MAX_KV_DIMS} sizes whose "
            "nonzero ones multiply to less than 2**62",
        )
    torch_dtype = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(raw) != expected:  # exact integers: a product too large for int64 is just unequal
        raise WireError(400, "invalid_kv", f"kv: {len(raw)} bytes, expected {expected}")
    if not raw:
        return torch.empty(0, dtype=torch_dtype).view(shape)
    if isinstance(raw, memoryview) and not raw.readonly:  # the request body's own bytes
        values = torch.frombuffer(raw, dtype=torch.uint8)
        if values.data_ptr() % itemsize:
            values = values.clone()  # each element where its type wants it: a copy
    else:
        values = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return values.view(torch_dtype).view(shape)


MAX_LEASE_ID = 2**64 - 1


def lease_id_text(text: str) -> int:
    """A lease id of a URL path: decimal digits of an unsigned 64-bit int; `WireError` 400."""
    if not (text.isascii() and text.isdigit() and len(text) <= 20 and int(text) <= MAX_LEASE_ID):
        raise WireError(
            400, "invalid_argument", f"lease id: got {shown(text)}, expected an unsigned 64-bit int"
        )
    return int(text)


MAX_RELEASES = 256
"""The most lease ids one prefetch or reserve may release on its way (`release_field`)."""


def release_field(data: dict[str, Any]) -> list[int]:
    """The `release` field of a prefetch or reserve: the ids of leases the client is done with
    (its last loads'), released before the call does its own work, so that a load costs one
    round trip. Absent: none. A list of at most `MAX_RELEASES` unsigned 64-bit ints, else
    `WireError` 400 (and nothing is released)."""
    value = data.get("release", [])
    if type(value) is not list or len(value) > MAX_RELEASES:
        raise WireError(
            400,
            "invalid_argument",
            f"release: got {shown(value)}, expected a list of at most {MAX_RELEASES} lease ids",
        )
    for item in value:
        if type(item) is not int or not 0 <= item <= MAX_LEASE_ID:
            raise WireError(
                400,
                "invalid_argument",
                f"release: got {shown(item)}, expected a lease id (an unsigned 64-bit int)",
            )
    return value


def query_number(text: str) -> float | str:
    """A query parameter as a number, or left a string for `number_field` and the like to
    refuse by name."""
    try:
        return float(text)
    except ValueError:
        return text


REQUEST_TOKEN_CHARS = 16
"""A request token's length: 16 lowercase hex chars (`service/grants.py`)."""


def request_field(data: dict[str, Any]) -> str | None:
    """The `request` token of a prefetch, reserve, release or abort: 16 lowercase hex chars
    the client drew, naming the lease or reservation that request is granted (`grants.py`);
    absent or null: None. Anything else is `WireError` 400 (and nothing is done)."""
    value = data.get("request")
    if value is None:
        return None
    if not is_request_token(value):
        raise WireError(
            400,
            "invalid_argument",
            f"request: got {shown(value)}, expected a token of {REQUEST_TOKEN_CHARS} lowercase "
            "hex chars",
        )
    return value


def is_request_token(value: object) -> TypeGuard[str]:
    """Whether `value` is a request token: `REQUEST_TOKEN_CHARS` lowercase hex chars."""
    return (
        type(value) is str
        and len(value) == REQUEST_TOKEN_CHARS
        and all(c in "0123456789abcdef" for c in value)
    )
