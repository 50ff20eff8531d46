"""The sidecar's OpenAPI document, exercised by schemathesis against a live `kvtier serve`.

Every operation of `/openapi.json` gets generated requests, valid and invalid, with JSON and
msgpack bodies (schemathesis's default phases, `MAX_EXAMPLES` fuzzed cases each), sent with the
admin key so that the admin routes are reached too (data-plane requests act as tenant
`default`: no tenant has a key). Each response must be no 5xx, have a documented status code
and content type, and match the schema of that status and content type.

The cases come from the document as the app builds it in this process (schemathesis generates
them when pytest collects, before any server runs); the first test holds the live server's
`/openapi.json` to that document. (`schemathesis.pytest.from_fixture`, which would load it from
the live server, fails under pytest 9: it sets `request.node._nodeid`, which pytest 9 lacks.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from service_server import ADMIN_KEY, Server, running, write_config

from kvtier.config import KVTierConfig
from kvtier.service.app import create_app
from kvtier.store import KVStore

MAX_EXAMPLES = 15
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("schema"), service={"max_tokens": 256, "prefetch_wait_s": 1.0}
    )
    with running(config) as server:
        yield server


def openapi_document() -> dict[str, Any]:
    """The document as the app builds it, without starting a store (that happens at start-up):
    the tests are generated from it at collection, and the live server is held to it."""
    app = create_app(KVTierConfig(), lambda: KVStore(KVTierConfig()))
    return app.openapi()


@schemathesis.serializer("application/msgpack")
def to_msgpack(context: schemathesis.SerializationContext, value: Any) -> bytes:
    """The body in msgpack; an int beyond 64 bits (negative cases) has no msgpack form, so
    such a body goes as the byte msgpack never uses (malformed: the server must say 400)."""
    try:
        packed = msgpack.packb(value, use_bin_type=True)
    except OverflowError:
        return b"\xc1"
    assert isinstance(packed, bytes)
    return packed


@schemathesis.deserializer("application/msgpack")
def from_msgpack(context: schemathesis.DeserializationContext, response: Any) -> Any:
    return msgpack.unpackb(response.content)


DOCUMENT = openapi_document()
schema = schemathesis.openapi.from_dict(
    DOCUMENT,
    config=schemathesis.Config.from_dict(
        {
            "headers": {"Authorization": f"Bearer {ADMIN_KEY}"},
            "generation": {"max-examples": MAX_EXAMPLES},
        }
    ),
)


def test_the_live_server_serves_the_document_the_cases_come_from(live: Server) -> None:
    response = live.get("/openapi.json")
    assert response.status_code == 200
    assert response.json() == DOCUMENT


@schema.parametrize()
def test_every_response_is_documented_and_no_request_is_a_server_error(
    case: schemathesis.Case[Any], live: Server
) -> None:
    case.call_and_validate(base_url=live.url, checks=CHECKS)


def test_a_null_ttl_or_wait_is_in_the_document_and_taken_by_the_server(live: Server) -> None:
    """`ttl_s: null` and `wait_s: null` are the fields left out (`wire.number_field`): the
    document must allow what the server takes, or a client generated from it refuses them."""
    tokens = list(range(64))
    for path, fields in (("/v1/prefetch", ("ttl_s", "wait_s")), ("/v1/reserve", ("ttl_s",))):
        schema = DOCUMENT["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        body = {"tokens": tokens, **dict.fromkeys(fields)}
        for field in fields:
            assert "null" in schema["schema"]["properties"][field]["type"], (path, field)
        response = live.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
