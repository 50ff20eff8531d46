"""JSON schemas of the sidecar's bodies, for its OpenAPI document (`/openapi.json`).

The data-plane routes read raw bodies (msgpack or JSON, `wire.py`) rather than pydantic
models, to keep a lookup well under a millisecond; these schemas describe the JSON form, so
that the document is exact and a schema-driven tester (schemathesis, in the tests) can exercise
every route. Binary msgpack fields (packed tokens, KV bytes) have no JSON form; in JSON, tokens
are a list of ints.
"""

from __future__ import annotations

from typing import Any

from kvtier.service.wire import MAX_RELEASES

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
# the server process's random id (`admission.Service`), in every reply that names slots
_INSTANCE = {"type": "string", "pattern": "^[0-9a-f]{16}$"}
_TOKENS = {
    "type": "array",
    "minItems": 1,  # an empty one is 400 `invalid_tokens`
    "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
}
_TTL = {"type": "number", "exclusiveMinimum": 0}  # at most policy.max_ttl_s (400 past it)
_WAIT = {"type": "number", "minimum": 0}  # bounded by service.prefetch_wait_s
# in a body, null is the field absent (`wire.number_field`): the policy's ttl, the bound's wait
_TTL_OR_NULL = {**_TTL, "type": ["number", "null"]}
_WAIT_OR_NULL = {**_WAIT, "type": ["number", "null"]}
_START = {"type": "integer", "minimum": 0}  # a multiple of block_tokens within the tokens
# what a request's map holds besides its fields (ignored): scalars, strings or lists of
# scalars (of strings too, in JSON); a nested map or list is 400 (`flat.py`)
_SCALAR = {"type": ["number", "boolean", "null"]}
_OTHER = {"anyOf": [_SCALAR, {"type": "string"}, {"type": "array", "items": _SCALAR}]}
_ANY_SCALAR = {"type": ["number", "boolean", "null", "string"]}
_OTHER_JSON = {"anyOf": [_ANY_SCALAR, {"type": "array", "items": _ANY_SCALAR}]}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


def _request(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A request's flat map (`flat.py`): its fields, and others ignored."""
    return {**_obj(properties, required), "additionalProperties": _OTHER}


TOKENS = _request({"tokens": _TOKENS}, ("tokens",))
LOAD = _request({"tokens": _TOKENS, "start": _START}, ("tokens",))  # start: as STORE's
# lease ids a client is done with, released first (`wire.release_field`)
_RELEASE = {
    "type": "array",
    "maxItems": MAX_RELEASES,
    "items": {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},
}
# a token the client drew, naming what its prefetch or reserve is granted (`grants.py`)
_REQUEST = {"type": "string", "pattern": "^[0-9a-f]{16}$"}
PREFETCH = _request(
    {
        "tokens": _TOKENS,
        "ttl_s": _TTL_OR_NULL,
        "wait_s": _WAIT_OR_NULL,
        "release": _RELEASE,
        "request": _REQUEST,
        "as_load": {"type": "boolean"},  # a shared-memory load: counted as a load (`wire.py`)
    },
    ("tokens",),
)
RESERVE = _request(
    {"tokens": _TOKENS, "ttl_s": _TTL_OR_NULL, "release": _RELEASE, "request": _REQUEST},
    ("tokens",),
)
RESERVATION_ID = _request({"reservation_id": _INT}, ("reservation_id",))


def _by_id_or_request(id_field: str) -> dict[str, Any]:
    """By id, or by the request token of the prefetch / reserve (either, not both: 400)."""
    return {
        **_request({id_field: _INT, "request": _REQUEST}),
        "oneOf": [{"required": [id_field]}, {"required": ["request"]}],
    }


RELEASE = _by_id_or_request("lease_id")
ABORT = _by_id_or_request("reservation_id")
STORE = _request(
    {
        "tokens": _TOKENS,
        "kv": _STR,
        "dtype": _STR,
        "shape": {"type": "array", "items": _INT},
        "start": _START,  # kv holds tokens[start:] (a multiple of block_tokens; default 0)
    },
    ("tokens", "kv", "dtype", "shape"),
)
EMPTY = _obj({})
# the body of a route that reads none (`/v1/reset`): a field is 400 (`guard.fieldless`), and
# the body may be left out (an empty POST)
NO_FIELDS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
OK = _obj({"ok": {"type": "boolean"}}, ("ok",))
READY = _obj({"ok": {"type": "boolean"}, "remote": _STR}, ("ok",))  # remote: with tiers.remote
ANY_OBJECT: dict[str, Any] = {"type": "object"}
_LOOKUP_FIELDS = ("num_tokens", "gpu_tokens", "host_tokens", "disk_tokens", "remote_tokens")
LOOKUP = _obj({k: _INT for k in _LOOKUP_FIELDS}, _LOOKUP_FIELDS)
LEASE = _obj(
    {
        "lease_id": _INT,
        "tenant": _STR,
        "num_tokens": _INT,
        "block_table": {"type": "array", "items": _INT},
        "expires_at": _NUM,
        "ttl_s": _NUM,  # a prefetch's: its ttl from its grant (`client/held.py`)
        "state": {"enum": ["pending", "ready", "released", "cancelled", "expired", "failed"]},
        "layers_ready": _INT,
        "reason": _STR,
        "instance": _INSTANCE,
    },
    ("lease_id", "num_tokens", "block_table", "state", "instance"),
)
STORED = _obj(
    {k: _INT for k in ("cached_tokens", "stored_tokens", "dropped_tokens", "pending_tokens")},
    ("cached_tokens", "stored_tokens", "dropped_tokens"),
)
LOADED = _obj(
    {"num_tokens": _INT, "kv": {}, "dtype": _STR, "shape": {"type": "array", "items": _INT},
     "truncated": {"type": "boolean"}},  # more may be cached: ask again from num_tokens
    ("num_tokens", "dtype", "shape"),
)  # fmt: skip
RESERVATION = _obj(
    {
        "reservation_id": _INT,
        "tenant": _STR,
        "cached_tokens": _INT,
        "num_tokens": _INT,
        "tier": _STR,
        "slots": {"type": "array", "items": _INT},
        "expires_at": _NUM,
        "dropped_tokens": _INT,  # room for the first blocks only: the rest, dropped at commit
        "instance": _INSTANCE,
    },
    ("reservation_id", "num_tokens", "tier", "slots", "instance"),
)
POOLS = _obj(
    {
        "layout": ANY_OBJECT,
        "pools": {"type": "array", "items": ANY_OBJECT},
        "lane": {"type": ["string", "null"]},  # the local lane's name (`lane.py`)
        "lane_max_frame_bytes": _INT,  # a longer call goes over HTTP (`frames.longest`)
        "instance": _INSTANCE,
        "max_body_bytes": _INT,  # a longer store goes in pieces (`client/pages.py`)
    },
    ("layout", "pools", "instance"),
)
CLEARED = _obj({"dropped_blocks": _INT}, ("dropped_blocks",))
RESET = _obj(
    {"dropped_blocks": _INT, "left_blocks": _INT, "remote": {"type": "boolean"}},
    ("dropped_blocks", "left_blocks", "remote"),
)
PERSISTED = _obj(
    {"persisted_blocks": _INT, "left_blocks": _INT}, ("persisted_blocks", "left_blocks")
)
CHECKED = _obj({"ok": {"type": "boolean"}, "detail": _STR}, ("ok",))
ERROR = _obj({"error": _STR, "detail": _STR}, ("error", "detail"))

_REASONS = {
    400: "malformed body or argument",
    401: "no API key",
    403: "unknown API key, not the admin key, or (without auth) an unknown x-kvtier-tenant",
    404: "unknown lease or reservation (or another tenant's), or a tenant an admin call names",
    408: "the body did not arrive within service.body_timeout_s",
    409: "a reservation committed with slots its writer did not write",
    413: "too many tokens, or too large a body",
    415: "a body that is neither application/json nor application/msgpack",
    421: "a Host header that does not name this server",
    422: "KV of the wrong dtype or shape",
    429: "the tenant's quota of leased or reserved blocks",
    503: "not ready (recovering), closing, or the disk refused a durable write",
    507: "the gpu tier cannot hold the prefix beside what is leased",
}

EDGE = (400, 415, 421)
"""What every route can answer before it runs (`guard.py`): 400 a header that decides who or
where given twice, or a request HTTP's parser refuses (`protocol.py`)."""
POST_STATUSES = (400, 401, 403, 404, 408, 409, 413, 422, 429, 503, 507, *EDGE)
"""The data-plane routes: a body read (400, 408, 413), auth, and any store error."""
GET_STATUSES = (401, 403, 503, *EDGE)
"""/v1/status and /v1/pools: auth and readiness; no body is read."""
LEASE_STATUSES = (400, 401, 403, 404, 503, *EDGE)
ADMIN_GET = (401, 403, *EDGE)
"""/v1/config and /metrics: the admin key, with auth on."""
ADMIN = (400, 403, 503, *EDGE)
"""/v1/admin/*: a body or a query parameter it does not read (`guard.py`); the admin key; not
ready, or (clear, persist) the disk refused."""

LEASE_PARAMETERS: dict[str, Any] = {
    "parameters": [
        {
            "name": "lease_id",
            "in": "path",
            "required": True,
            "schema": {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},
        },
        {"name": "wait_s", "in": "query", "required": False, "schema": _WAIT},
    ]
}
"""`GET /v1/leases/{lease_id}`: parsed by the route itself, after auth (a bad id is 400)."""


JSON_ONLY = ("application/json",)
EITHER = ("application/json", "application/msgpack")
"""Response formats: a route that reads its body answers in the request's format."""


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def responses(
    ok: dict[str, Any], *errors: int, formats: tuple[str, ...] = JSON_ONLY
) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=`: the 200 body, and `{error, detail}` for each error status, in
    each of `formats`."""
    out: dict[int | str, dict[str, Any]] = {
        200: {"description": "OK", "content": {f: {"schema": ok} for f in formats}}
    }
    for status in errors:
        content = {f: {"schema": ERROR} for f in formats}
        out[status] = {"description": _REASONS[status], "content": content}
    return out


def metrics_responses() -> dict[int | str, dict[str, Any]]:
    """`/metrics`: Prometheus text, or `{error, detail}` in JSON."""
    out = responses(ANY_OBJECT, *ADMIN_GET)
    out[200] = {"description": "OK", "content": {"text/plain": {"schema": _STR}}}
    return out


def _in_json(schema: dict[str, Any]) -> dict[str, Any]:
    """A request's schema in JSON, whose lists of other fields may hold strings too."""
    if schema.get("additionalProperties") is not _OTHER:
        return schema
    return {**schema, "additionalProperties": _OTHER_JSON}


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI `openapi_extra=` for a route that reads its body itself."""
    return {
        "requestBody": {
            "required": schema is not NO_FIELDS,
            "content": {**_json(_in_json(schema)), "application/msgpack": {"schema": schema}},
        }
    }
