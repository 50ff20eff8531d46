"""A chunked body's trailer fields never act as request headers (RFC 9110 6.5.1), against a
real `kvtier serve`: uvicorn appended them to the request's headers, so a request whose head
carries no key, sent whole in one write with `Authorization: Bearer <key>` in its trailer, was
served as that key's tenant (200), and `X-Kvtier-Tenant` or `Content-Type` could be swapped
the same way past a proxy that vets the head (audit AZ)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from service_server import Server, running, write_config

KEY = "trailer-tenant-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("trailers"), tenants={"alice": {"api_keys": [KEY]}}
    )
    with running(config) as live:
        yield live


def chunked(server: Server, head: str, body: bytes, trailer: str) -> tuple[int, dict[str, Any]]:
    """One POST /v1/lookup sent in a single write, its body chunked with `trailer` after the
    last chunk: the status and the JSON reply."""
    where = urlsplit(server.url)
    request = (
        (
            f"POST /v1/lookup HTTP/1.1\r\nHost: {where.netloc}\r\n{head}"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        ).encode()
        + f"{len(body):x}\r\n".encode()
        + body
        + f"\r\n0\r\n{trailer}\r\n".encode()
    )
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(payload)


def test_a_key_in_a_trailer_is_no_key(server: Server) -> None:
    body = json.dumps({"tokens": [1, 2, 3, 4]}).encode()
    head = "Content-Type: application/json\r\n"
    status, reply = chunked(server, head, body, f"Authorization: Bearer {KEY}\r\n")
    assert status == 401, reply  # before: 200, served as alice
    status, reply = chunked(server, head + f"Authorization: Bearer {KEY}\r\n", body, "")
    assert status == 200 and reply["num_tokens"] == 0, reply  # the same call, keyed in its head


def test_a_content_type_in_a_trailer_changes_nothing(server: Server) -> None:
    body = json.dumps({"tokens": [1, 2, 3, 4]}).encode()
    head = f"Content-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
    trailer = "Content-Type: application/msgpack\r\nX-Kvtier-Tenant: bob\r\n"
    status, reply = chunked(server, head, body, trailer)
    assert status == 200 and reply["num_tokens"] == 0, reply  # read as the head's JSON
    server.admin("/v1/admin/check")
