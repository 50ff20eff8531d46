"""Multi-tenant audit D on a real `kvtier serve` (three tenants with keys, an admin key).

A data-plane POST reads its arguments from its body alone, and FastAPI passed over a query
parameter no route declared: `/v1/load?start=16` answered the KV from token 0 (bytes of other
tokens than the caller asked for), and `/v1/reset?tenant=b` reset the caller's own tenant (a
keyless sidecar's `default`); an admin POST likewise took `/v1/admin/clear?tenants=a` (a
typo) or a body `{"tenant": "a"}` as a clear of every tenant. Each is now 400
`invalid_argument` naming the parameter, in the request's format, before anything runs
(`service/guard.py`).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack  # type: ignore[import-untyped]
import pytest
from service_server import ADMIN_KEY, Server, kv_of, running, tokens_of, write_config

from kvtier.client import Client

KEYS = {t: f"audit-d-tenant-{t}-key-0123456789" for t in ("a", "b", "c")}
PROMPT = tokens_of(500, 16)  # 4 blocks, stored by each tenant under its own namespace


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory: Path = tmp_path_factory.mktemp("audit_d")
    tenants = {t: {"api_keys": [key]} for t, key in KEYS.items()}
    with running(write_config(directory, tenants=tenants)) as live:
        yield live


def headers(tenant: str, media: str = "application/json") -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}", "content-type": media, "accept": media}


def cached(server: Server, store: bool = False) -> dict[str, int]:
    """Tokens of PROMPT each tenant finds cached (after storing its own KV, with `store`)."""
    found = {}
    for tenant, key in KEYS.items():
        with Client(server.url, api_key=key, shared_memory=False) as kv:
            if store:
                kv.store(PROMPT, kv_of(len(PROMPT), seed=ord(tenant)))
            found[tenant] = kv.lookup(PROMPT).num_tokens
    return found


def refused(response: httpx.Response, name: str, packed: bool = False) -> None:
    assert response.status_code == 400, response.content
    body = msgpack.unpackb(response.content) if packed else response.json()
    assert response.headers["content-type"].startswith(
        "application/msgpack" if packed else "application/json"
    )
    assert body["error"] == "invalid_argument" and repr(name) in body["detail"], body


def test_a_reset_naming_a_tenant_in_its_query_is_refused_and_resets_nothing(
    server: Server,
) -> None:
    assert cached(server, store=True) == {"a": 16, "b": 16, "c": 16}
    refused(server.post("/v1/reset?tenant=b", headers=headers("a"), content=b"{}"), "tenant")
    assert cached(server) == {"a": 16, "b": 16, "c": 16}  # before: a's prefix was dropped
    done = httpx.post(server.url + "/v1/reset", headers=headers("a"), content=b"{}", timeout=30)
    assert done.status_code == 200 and cached(server) == {"a": 0, "b": 16, "c": 16}


def test_a_load_with_its_start_in_the_query_is_refused_not_served_from_token_0(
    server: Server,
) -> None:
    assert cached(server, store=True) == {"a": 16, "b": 16, "c": 16}
    body = msgpack.packb({"tokens": PROMPT})
    media = "application/msgpack"
    response = server.post("/v1/load?start=8", headers=headers("b", media), content=body)
    refused(response, "start", packed=True)  # before: 200, the KV of tokens 0..16
    whole = msgpack.unpackb(server.post("/v1/load", headers=headers("b", media), content=body)
                            .content)  # fmt: skip
    assert whole["num_tokens"] == 16  # the body's own `start` is still how to ask
    for path in ("/v1/lookup?x=1", "/v1/prefetch?ttl_s=1", "/v1/store?start=0&start=4"):
        name = path.split("?")[1].split("=")[0]
        refused(server.post(path, headers=headers("c"), content=b"{}"), name)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert server.get("/v1/status?x=1", headers=admin).status_code == 200  # GETs: their own
    assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}


def test_an_admin_clear_takes_one_tenant_in_its_query_and_no_body(server: Server) -> None:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    json_body = {**admin, "content-type": "application/json"}
    assert cached(server, store=True) == {"a": 16, "b": 16, "c": 16}
    # before: each answered 200 and cleared every tenant (or only the last named)
    refused(server.post("/v1/admin/clear?tenants=a", headers=admin), "tenants")
    refused(server.post("/v1/admin/clear?tenant=a&tenant=b", headers=admin), "tenant")
    check = server.post("/v1/admin/check?tenant=a", headers=admin)
    refused(check, "tenant")
    assert "body" not in check.json()["detail"]  # an admin route takes none either
    body = server.post("/v1/admin/clear", headers=json_body, content=b'{"tenant": "a"}')
    assert body.status_code == 400 and "takes no body" in body.json()["detail"]
    assert cached(server) == {"a": 16, "b": 16, "c": 16}  # nothing was cleared
    assert server.admin("/v1/admin/clear", params={"tenant": "a"}).json()["dropped_blocks"] == 4
    assert cached(server) == {"a": 0, "b": 16, "c": 16}


def test_an_admin_post_with_a_zero_length_however_written_has_no_body(server: Server) -> None:
    # HTTP allows "Content-Length: 00"; it was taken for a body (415, or 400 "takes no body")
    host, port = server.url.removeprefix("http://").split(":")
    for length in ("0", "00", "000"):
        request = (
            f"POST /v1/admin/check HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {ADMIN_KEY}\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(request)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200 "), (length, reply[:300])
        assert b'"ok":true' in reply.replace(b" ", b"")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # one byte is a body
        sock.sendall(request.replace(b"Content-Length: 000", b"Content-Length: 01") + b"x")
        assert sock.recv(65536).startswith(b"HTTP/1.1 415 ")
