"""The REST API as a hostile tenant meets it (audit AH), against a real `kvtier serve` with two
tenant keys and the admin key: each test fails on the code before its fix.

- `POST /v1/reset` with a field in its body (`{"tenant": "b"}`) is 400 naming the field, and
  drops nothing (before: it reset the caller's own tenant, as `?tenant=b` once did).
- A request with `Host`, `Authorization`, `X-Kvtier-Tenant` or `Content-Type` twice is 400
  naming the header, and stores nothing (before: the edge checked the last `Host` and the
  routes took the first key, so `Host: evil.com` then `Host: 127.0.0.1` passed, and two keys
  acted as the first).
- A request the HTTP parser refuses is `400 {error: "bad_request", detail}` naming what it met
  (before: uvicorn's plain-text line); a 405 says `Allow` (RFC 9110); an `Upgrade: websocket`
  request passes the edge's checks (before: a WebSocket scope skipped them, then 403 unbodied).
- The OpenAPI document refuses what the server refuses: an empty token list, a `ttl_s` of 0, a
  negative `wait_s` or `start`, a release by id and request token together, a nested map
  among the fields; and a bodiless `/v1/reset`, which the server takes, needs no body.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema_rs  # (schemathesis's validator)
import msgpack  # type: ignore[import-untyped]
import pytest
from service_server import ADMIN_KEY, Server, kv_of, running, tokens_of, write_config

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
A = {"authorization": f"Bearer {KEY_A}"}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tenants = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
    config = write_config(tmp_path_factory.mktemp("api_ah"), tenants=tenants)
    with running(config) as server:
        yield server


def _store(server: Server, base: int) -> list[int]:
    tokens = tokens_of(base, 8)
    kv = kv_of(8, base)
    body = {"tokens": tokens, "kv": kv.numpy().tobytes(), "dtype": "float16",
            "shape": list(kv.shape)}  # fmt: skip
    headers = {**A, "content-type": "application/msgpack"}
    response = server.post("/v1/store", content=msgpack.packb(body), headers=headers)
    assert response.status_code == 200, response.content
    return tokens


def _cached(server: Server, tokens: list[int]) -> int:
    response = server.post("/v1/lookup", json={"tokens": tokens}, headers=A)
    assert response.status_code == 200, response.text
    return int(response.json()["num_tokens"])


def _raw(server: Server, head: bytes, body: bytes = b"") -> tuple[bytes, bytes]:
    """Send a request as given; the reply's status line (with headers) and body."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + b"\r\n" + body)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status, _, rest = reply.partition(b"\r\n\r\n")
    return status, rest


def test_a_reset_whose_body_names_a_field_is_refused_and_drops_nothing(live: Server) -> None:
    tokens = _store(live, 1000)
    for body in ({"tenant": "b"}, {"tokens": tokens}):
        response = live.post("/v1/reset", json=body, headers=A)
        assert response.status_code == 400, response.text
        assert response.json()["error"] == "invalid_argument"
        assert repr(next(iter(body))) in response.json()["detail"]
        assert _cached(live, tokens) == 8
    response = live.post("/v1/reset", headers=A)  # no body: what the document says it takes
    assert response.status_code == 200 and response.json()["dropped_blocks"] == 2
    assert _cached(live, tokens) == 0


@pytest.mark.parametrize(
    "repeated",
    [
        (b"host: evil.com", b"host: 127.0.0.1"),
        (f"authorization: Bearer {KEY_B}".encode(), f"authorization: Bearer {KEY_A}".encode()),
        (b"x-kvtier-tenant: a", b"x-kvtier-tenant: b"),
        (b"content-type: text/plain", b"content-type: application/json"),
    ],
    ids=["host", "authorization", "tenant", "content-type"],
)
def test_a_header_that_decides_who_or_where_given_twice_is_refused(
    live: Server, repeated: tuple[bytes, bytes]
) -> None:
    body = json.dumps({"tokens": tokens_of(2000, 8)}).encode()
    head = {
        b"host": b"host: 127.0.0.1",
        b"authorization": f"authorization: Bearer {KEY_A}".encode(),
        b"content-type": b"content-type: application/json",
    }
    name = repeated[0].split(b":")[0]
    lines = [value for key, value in head.items() if key != name] + list(repeated)
    request = b"POST /v1/reserve HTTP/1.1\r\n" + b"".join(line + b"\r\n" for line in lines)
    request += b"content-length: %d\r\n" % len(body)
    status, reply = _raw(live, request, body)
    assert status.startswith(b"HTTP/1.1 400"), (status, reply)
    error = json.loads(reply)
    assert error["error"] == "invalid_argument"
    assert repr(name.decode()) in error["detail"] and KEY_A not in error["detail"]
    status_a = httpx.get(live.url + "/v1/status", headers=A).json()
    assert status_a["tiers"]["gpu"]["reserved_blocks"] == 0  # nothing reserved


def test_a_request_the_parser_refuses_is_a_typed_error(live: Server) -> None:
    head = b"POST /v1/lookup HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: -1\r\n"
    status, reply = _raw(live, head, b"{}")
    assert status.startswith(b"HTTP/1.1 400") and b"application/json" in status
    error = json.loads(reply)
    assert error["error"] == "bad_request" and "Content-Length" in error["detail"]


def test_a_405_says_which_methods_are_allowed(live: Server) -> None:
    response = httpx.request("TRACE", live.url + "/v1/lookup", headers=A)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"] == "method_not_allowed"


def test_a_websocket_upgrade_passes_the_edge_checks(live: Server) -> None:
    head = (b"GET /v1/status HTTP/1.1\r\nhost: evil.com\r\nupgrade: websocket\r\n"
            b"connection: upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"sec-websocket-version: 13\r\n")  # fmt: skip
    status, reply = _raw(live, head)
    assert status.startswith(b"HTTP/1.1 421"), (status, reply)
    assert json.loads(reply)["error"] == "bad_host"
    # and the log tells the operator nothing false (uvicorn's: "install a WebSocket library")
    assert "WebSocket library" not in live.output()
    assert "Unsupported upgrade request" not in live.output()


def _schema(document: dict[str, Any], path: str) -> tuple[dict[str, Any], bool]:
    body = document["paths"][path]["post"]["requestBody"]
    return body["content"]["application/json"]["schema"], body["required"]


REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("/v1/lookup", {"tokens": []}),
    ("/v1/prefetch", {"tokens": [1], "ttl_s": 0}),
    ("/v1/prefetch", {"tokens": [1], "wait_s": -1}),
    ("/v1/reserve", {"tokens": [1], "ttl_s": -1}),
    ("/v1/load", {"tokens": [1, 2, 3, 4], "start": -4}),
    ("/v1/release", {"lease_id": 1, "request": "0123456789abcdef"}),
    ("/v1/abort", {"reservation_id": 1, "request": "0123456789abcdef"}),
    ("/v1/lookup", {"tokens": [1], "extra": {"a": 1}}),
    ("/v1/reset", {"tenant": "b"}),
]


@pytest.mark.parametrize("path,body", REFUSED, ids=[f"{p}-{'-'.join(b)}" for p, b in REFUSED])
def test_the_document_refuses_what_the_server_refuses(
    live: Server, path: str, body: dict[str, Any]
) -> None:
    document = live.get("/openapi.json").json()
    schema, _ = _schema(document, path)
    response = live.post(path, json=body, headers=A)
    assert response.status_code == 400, response.text
    assert not jsonschema_rs.Draft202012Validator(schema).is_valid(body)


def test_the_document_says_a_reset_needs_no_body(live: Server) -> None:
    _, required = _schema(live.get("/openapi.json").json(), "/v1/reset")
    assert required is False
    assert live.post("/v1/reset", headers=A).status_code == 200
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert live.post("/v1/admin/check", headers=admin).json()["ok"] is True


def test_every_route_documents_the_edges_400(live: Server) -> None:
    document = live.get("/openapi.json").json()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "400" in operation["responses"], (method, path)
    status, reply = _raw(live, b"GET /healthz HTTP/1.1\r\nhost: evil.com\r\nhost: 127.0.0.1\r\n")
    assert status.startswith(b"HTTP/1.1 400") and json.loads(reply)["error"] == "invalid_argument"


def test_a_post_to_a_path_that_takes_none_is_405_or_404_with_a_query_too(live: Server) -> None:
    """The query check is of a POST route's parameters: a POST to `/v1/status` (GET only) is
    405 naming GET with a query string as without (before: 400 "takes none"), an unknown path
    404; a POST route's unread parameter is still 400."""
    for query in ("", "?x=1"):
        response = live.post(f"/v1/status{query}", json={}, headers=A)
        assert response.status_code == 405, (query, response.text)
        assert response.headers["allow"] == "GET"
        assert live.post(f"/v1/nowhere{query}", json={}, headers=A).status_code == 404
    response = live.post("/v1/lookup?x=1", json={"tokens": [1]}, headers=A)
    assert response.status_code == 400 and "'x'" in response.json()["detail"]
