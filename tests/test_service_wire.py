"""The sidecar's HTTP surface under hostile requests, against a real `kvtier serve` (issue 11,
points 4, 5, 7 and 9's corrupt disk block through the sidecar).

- Route auth: with keys on, `/metrics` and `/v1/config` need the admin key, `/v1/status` with a
  tenant key shows that tenant only; a rejected key is never echoed.
- Cross-site: only JSON and msgpack bodies are read (a web page can send neither without a
  CORS preflight, which is refused); a `Host` that does not name the server (DNS rebinding) is
  421 on every route.
- The wire: hostile values are 4xx `{error, detail}`, never a 500; a half-sent body times out
  (408); a client that hangs up mid-body is counted, not logged; a lease id is parsed after
  auth; the last line of defence answers an unexpected exception with a well-formed 500.
- A corrupt disk block: prefetch and load through the sidecar return the intact leading part.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack  # type: ignore[import-untyped]
import pytest
from conftest import DISK_HEADER_BYTES, DISK_SLOT_BYTES, same, slab_headers
from prometheus_client.parser import text_string_to_metric_families
from service_server import ADMIN_KEY, Server, kv_of, running, tokens_of, write_config
from starlette.testclient import TestClient

from kvtier.client import Client
from kvtier.config import KVTierConfig, parse_config
from kvtier.results import LeaseState, StoreResult
from kvtier.service import bodies
from kvtier.service.app import create_app
from kvtier.service.guard import HostCheck
from kvtier.store import KVStore

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-9876543210"
REJECTED = "rejected-key-a1b2c3d4e5f6"
JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": "application/msgpack"}
BODY_TIMEOUT_S = 1.0
POSTS = ["/v1/lookup", "/v1/prefetch", "/v1/release", "/v1/store", "/v1/load", "/v1/reserve",
         "/v1/commit", "/v1/abort", "/v1/admin/clear", "/v1/admin/check",
         "/v1/admin/persist"]  # fmt: skip
GETS = ["/healthz", "/readyz", "/v1/status", "/v1/config", "/metrics", "/v1/pools",
        "/v1/leases/1", "/openapi.json", "/docs"]  # fmt: skip


def admin(key: str = ADMIN_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def msgpack_body(data: dict[str, Any]) -> bytes:
    packed = msgpack.packb(data, use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The `{error, detail}` body of a refusal, in its content type; asserts its shape."""
    if response.headers["content-type"] == "application/msgpack":
        body = msgpack.unpackb(response.content)
    else:
        assert response.headers["content-type"] == "application/json", response.headers
        body = response.json()
    assert set(body) == {"error", "detail"} and body["detail"], body
    assert isinstance(body, dict)
    return body


def disconnects(server: Server) -> float:
    found = [
        sample.value
        for family in text_string_to_metric_families(server.get("/metrics").text)
        for sample in family.samples
        if sample.name == "kvtier_client_disconnects_total"
    ]
    assert len(found) == 1
    return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Keyless (tenant `default`), a short body timeout, one allowed extra host name."""
    config = write_config(
        tmp_path_factory.mktemp("wire"),
        service={
            "max_tokens": 64,
            "max_body_bytes": 64 * 1024,
            "body_timeout_s": BODY_TIMEOUT_S,
            "allowed_hosts": ["kv.internal"],
        },
    )
    with running(config) as live:
        yield live


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("wire-auth"),
        tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
    )
    with running(config) as live:
        yield live


# ---- route auth ---------------------------------------------------------------------------------


def test_metrics_and_config_need_the_admin_key_when_keys_are_on(auth_server: Server) -> None:
    for path in ("/metrics", "/v1/config"):
        for headers, status, kind in [
            ({}, 401, "unauthorized"),
            (admin(KEY_A), 403, "forbidden"),
            (admin(REJECTED), 403, "forbidden"),
        ]:
            response = auth_server.get(path, headers=headers)
            assert response.status_code == status, (path, response.text)
            assert error_of(response)["error"] == kind
        assert auth_server.get(path, headers=admin()).status_code == 200
    config = auth_server.get("/v1/config", headers=admin()).json()
    assert {tenant: c["api_keys"] for tenant, c in config["tenants"].items()} == {
        "a": ["<redacted>"],
        "b": ["<redacted>"],
    }
    assert "kvtier_tier_used_bytes" in auth_server.get("/metrics", headers=admin()).text


def test_the_config_hides_the_remote_tiers_secret_and_password() -> None:
    """/v1/config (and the status page's summary) show neither the cluster secret nor the AUTH
    password, literal or `env:` reference; the rest of the remote section stays readable."""
    secret, password = "cluster-secret-0123456789", "auth-password-0123456789"
    for given in ((secret, password), ("env:KVTIER_S", "env:KVTIER_P")):
        remote = {"nodes": ["10.0.0.1:7000"], "secret": given[0], "password": given[1]}
        shown = bodies.redacted(parse_config({"tiers": {"remote": remote}}))
        assert shown["tiers"]["remote"]["secret"] == "<redacted>"
        assert shown["tiers"]["remote"]["password"] == "<redacted>"
        assert shown["tiers"]["remote"]["nodes"] == ("10.0.0.1:7000",)
        assert not any(value in repr(shown) for value in given)


def test_without_keys_metrics_and_config_stay_open(server: Server) -> None:
    assert server.get("/metrics").status_code == 200
    assert server.get("/v1/config").json()["service"]["allowed_hosts"] == ["kv.internal"]


def test_a_tenants_status_shows_none_of_another_tenants_activity(auth_server: Server) -> None:
    def status(key: str) -> dict[str, Any]:
        response = auth_server.get("/v1/status", headers=admin(key))
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    b_before = status(KEY_B)
    tokens, kv = tokens_of(100, 16), kv_of(16, seed=1)
    with Client(auth_server.url, api_key=KEY_A) as a:
        assert a.store(tokens, kv) == StoreResult(16, 16, 0)
        for _ in range(5):
            assert a.lookup(tokens).num_tokens == 16
        a.release(a.prefetch(tokens))
    b_after = status(KEY_B)
    assert b_after["ops"] == b_before["ops"]
    assert b_after["tiers"]["gpu"]["blocks"] == b_before["tiers"]["gpu"]["blocks"] == 0
    a_after, everyone = status(KEY_A), status(ADMIN_KEY)
    assert a_after["ops"]["lookups"] >= 5 and a_after["tiers"]["gpu"]["blocks"] == 4
    assert everyone["ops"]["lookups"] >= a_after["ops"]["lookups"]


def test_a_rejected_key_is_never_echoed(auth_server: Server) -> None:
    for path in POSTS:  # an admin route takes no body (400 before the key is looked at)
        body = b"" if path.startswith("/v1/admin/") else b'{"tokens": [1]}'
        response = auth_server.post(path, content=body, headers={**JSON, **admin(REJECTED)})
        assert response.status_code in (401, 403) and REJECTED not in response.text
    for path in GETS:
        assert REJECTED not in auth_server.get(path, headers=admin(REJECTED)).text
    assert REJECTED not in auth_server.output()


# ---- cross-site ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_a_body_a_web_page_could_send_is_refused_before_it_is_read(
    server: Server, content_type: str | None
) -> None:
    tokens = tokens_of(500, 8)
    content = json.dumps({"tokens": tokens}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    reserve = server.post("/v1/reserve", content=content, headers=headers)
    assert reserve.status_code == 415 and error_of(reserve)["error"] == "unsupported_media"
    commit = server.post("/v1/commit", content=b'{"reservation_id": 1}', headers=headers)
    assert commit.status_code == 415
    assert "access-control-allow-origin" not in reserve.headers
    again = server.post("/v1/reserve", content=content, headers=JSON)  # nothing was reserved
    assert again.status_code == 200 and again.json()["num_tokens"] == 8
    assert server.post("/v1/abort", json={"reservation_id": again.json()["reservation_id"]})


def test_a_bodiless_post_is_read_as_an_empty_map(server: Server) -> None:
    response = server.post("/v1/lookup")
    assert response.status_code == 400 and error_of(response)["error"] == "invalid_tokens"
    assert server.post("/v1/admin/check", headers=admin()).json() == {"ok": True, "detail": ""}


def test_no_cors_is_granted_and_a_preflight_is_refused(server: Server) -> None:
    preflight = httpx.options(
        server.url + "/v1/reserve",
        headers={
            "origin": "http://evil.example",
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type",
        },
    )
    assert preflight.status_code == 405 and error_of(preflight)["error"] == "method_not_allowed"
    lookup = server.post(
        "/v1/lookup", json={"tokens": [1]}, headers={"origin": "http://evil.example"}
    )
    assert lookup.status_code == 200
    for response in (preflight, lookup):
        assert not any(name.startswith("access-control-") for name in response.headers)


FOREIGN_HOSTS = ("evil.example", "evil.example:80", "localhost.evil.example", "127.0.0.1.nip.io")


@pytest.mark.parametrize("path", [*POSTS, *GETS])
def test_a_foreign_host_is_refused_on_every_route(server: Server, path: str) -> None:
    for host in FOREIGN_HOSTS:
        headers = {**admin(), "host": host}
        if path in POSTS:
            response = server.post(path, json={"tokens": [1, 2, 3, 4]}, headers=headers)
        else:
            response = server.get(path, headers=headers)
        assert response.status_code == 421, (host, response.status_code, response.content[:100])
        assert error_of(response)["error"] == "bad_host"


def test_a_rebound_name_gets_no_kv_and_an_allowed_one_does(server: Server) -> None:
    tokens, kv = tokens_of(600, 8), kv_of(8, seed=6)
    with Client(server.url, shared_memory=False) as client:
        assert client.store(tokens, kv) == StoreResult(8, 8, 0)
    body = msgpack_body({"tokens": b"".join(t.to_bytes(4, "little") for t in tokens)})
    rebound = server.post("/v1/load", content=body, headers={**MSGPACK, "host": "evil.example"})
    assert rebound.status_code == 421 and len(rebound.content) < 300
    allowed = server.post("/v1/load", content=body, headers={**MSGPACK, "host": "kv.internal"})
    assert allowed.status_code == 200 and msgpack.unpackb(allowed.content)["num_tokens"] == 8


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1", "[::1]", "kv.internal", "KV.Internal:1"]
)
def test_the_bound_address_loopback_names_and_allowed_hosts_are_served(
    server: Server, host: str
) -> None:
    assert server.get("/healthz", headers={"host": host}).status_code == 200


def test_host_check_on_a_wildcard_bind_takes_ip_literals_but_no_foreign_name() -> None:
    hosts = HostCheck("0.0.0.0", ["kv.internal"])
    assert [hosts.refusal(h) for h in ("10.1.2.3:8750", "[fe80::1]", "kv.internal")] == [None] * 3
    assert hosts.refusal("evil.example") is not None and hosts.refusal(None) is not None
    assert HostCheck("127.0.0.1", []).refusal("10.1.2.3") is not None


# ---- the wire -----------------------------------------------------------------------------------


STORE = {"tokens": bytes(16), "kv": bytes(8)}
HOSTILE: list[tuple[str, str, bytes, dict[str, str], int, str]] = [
    ("unhashable dtype", "/v1/store", msgpack_body({**STORE, "dtype": [1], "shape": [4]}),
     MSGPACK, 422, "invalid_kv"),
    ("shape overflows int64", "/v1/store",
     msgpack_body({**STORE, "kv": b"", "dtype": "float16", "shape": [2**62, 4]}),
     MSGPACK, 400, "invalid_kv"),
    ("empty, a size past int64", "/v1/store",
     msgpack_body({**STORE, "kv": b"", "dtype": "float16", "shape": [0, 2**63]}), MSGPACK, 400,
     "invalid_kv"),
    ("empty, strides past int64", "/v1/store",
     msgpack_body({**STORE, "kv": b"", "dtype": "float16", "shape": [0, 2**40, 2**40, 2]}),
     MSGPACK, 400, "invalid_kv"),
    ("shape of 100 dims", "/v1/store",
     msgpack_body({**STORE, "kv": bytes(2), "dtype": "float16", "shape": [1] * 100}), MSGPACK,
     400, "invalid_kv"),
    ("JSON nested 20k deep", "/v1/lookup", b"[" * 20_000 + b"]" * 20_000, JSON, 400,
     "malformed_body"),
    ("msgpack nested 20k deep", "/v1/lookup", b"\x91" * 20_000 + b"\xc0", MSGPACK, 400,
     "malformed_body"),
    ("booleans as tokens", "/v1/lookup", b'{"tokens": [true, false]}', JSON, 400, "invalid_tokens"),
    ("ttl of 400 digits", "/v1/prefetch", b'{"tokens": [1], "ttl_s": 1' + b"0" * 400 + b"}", JSON,
     400, "invalid_argument"),
    ("wait_s NaN", "/v1/prefetch", b'{"tokens": [1], "wait_s": NaN}', JSON, 400,
     "invalid_argument"),
    ("wait_s negative", "/v1/prefetch", b'{"tokens": [1], "wait_s": -1}', JSON, 400,
     "invalid_argument"),
    ("a map as a map key", "/v1/lookup", b"\x81\x81\x01\x02\x03", MSGPACK, 400, "malformed_body"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "content", "headers", "status", "kind"),
    [case[1:] for case in HOSTILE],
    ids=[case[0] for case in HOSTILE],
)
def test_a_hostile_value_is_a_typed_refusal_never_a_500(
    server: Server, path: str, content: bytes, headers: dict[str, str], status: int, kind: str
) -> None:
    response = server.post(path, content=content, headers=headers)
    assert response.status_code == status, response.content[:200]
    assert error_of(response)["error"] == kind


def test_a_lease_id_is_parsed_after_auth(auth_server: Server, server: Server) -> None:
    for bad in ("abc", "-1", "1.5", str(2**64), "9" * 400):
        anonymous = auth_server.get(f"/v1/leases/{bad}")
        assert anonymous.status_code == 401 and error_of(anonymous)["error"] == "unauthorized"
        keyed = auth_server.get(f"/v1/leases/{bad}", headers=admin(KEY_A))
        assert keyed.status_code == 400 and error_of(keyed)["error"] == "invalid_argument"
        assert server.get(f"/v1/leases/{bad}").status_code == 400
    unknown = auth_server.get(f"/v1/leases/{2**64 - 1}", headers=admin(KEY_A))
    assert unknown.status_code == 404 and error_of(unknown)["error"] == "unknown_lease"
    for wait in ("nan", "inf", "-1", "soon"):
        waited = server.get("/v1/leases/1", params={"wait_s": wait})
        assert waited.status_code == 400 and error_of(waited)["error"] == "invalid_argument"


def raw_request(server: Server, head: bytes) -> socket.socket:
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head)
    return sock


HALF_SENT = (
    b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b'Content-Length: 100\r\n\r\n{"tokens": [1,'
)


def test_a_half_sent_body_times_out_with_408(server: Server) -> None:
    started = time.monotonic()
    with raw_request(server, HALF_SENT) as sock:
        sock.settimeout(10 * BODY_TIMEOUT_S)
        answer = sock.recv(65536)
        waited = time.monotonic() - started
        while chunk := sock.recv(65536):  # the head and the body may come in two segments
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    assert b'"error": "body_timeout"' in answer and b"connection: close" in answer.lower()
    assert BODY_TIMEOUT_S * 0.9 <= waited < BODY_TIMEOUT_S + 5


def test_a_client_hanging_up_mid_body_is_counted_not_logged(server: Server) -> None:
    before = disconnects(server)
    with raw_request(server, HALF_SENT):
        time.sleep(0.2)  # the server is reading the body
    deadline = time.monotonic() + 5
    while disconnects(server) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert disconnects(server) == before + 1
    assert "Traceback" not in server.output() and "ClientDisconnect" not in server.output()


def test_the_last_line_of_defence_answers_an_unexpected_error_with_a_json_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The app as `kvtier serve` builds it, plus a route that raises (none of kvtier's does:
    the other tests and the fuzz assert no 5xx), in process: a well-formed 500, logged once
    with its traceback."""

    async def broken() -> None:
        raise KeyError("an unexpected bug")

    app = create_app(KVTierConfig(), lambda: KVStore(KVTierConfig()))  # lifespan not run
    app.add_api_route("/broken", broken)
    client = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR):
        response = client.get("/broken")
    assert response.status_code == 500
    assert response.json() == {
        "error": "internal",
        "detail": "an unexpected KeyError; the server's log has the traceback",
    }
    assert response.headers["connection"] == "close"
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is not None


# ---- a corrupt disk block through the sidecar ---------------------------------------------------


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_prefetch_and_load_return_the_intact_part_before_a_corrupt_disk_block(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, disk="1MiB")
    tokens, kv = tokens_of(7000, 32), kv_of(32, seed=70)
    with running(config) as first, Client(first.url) as client:
        assert client.store(tokens, kv) == StoreResult(32, 32, 0)
        first.admin("/v1/admin/persist")
    slot, _ = slab_headers(tmp_path / "disk")[tuple(tokens[16:20])]  # the fifth block of eight
    with open(tmp_path / "disk" / "slab-00000.kvt", "r+b") as slab:
        rng = random.Random(70)
        for at in rng.sample(range(DISK_HEADER_BYTES), 3):  # its payload, after its header
            slab.seek(slot * DISK_SLOT_BYTES + DISK_HEADER_BYTES + at)
            byte = slab.read(1)[0]
            slab.seek(-1, 1)
            slab.write(bytes([byte ^ rng.randrange(1, 256)]))
    with running(config) as second, Client(second.url) as client:
        assert client.lookup(tokens).disk_tokens == 32
        lease = client.prefetch(tokens)
        assert (lease.state, lease.num_tokens) == (LeaseState.READY, 16)
        client.release(lease)
        loaded = client.load(tokens)
        assert loaded.num_tokens == 16 and same(loaded.kv, kv[:, :, :16])
        with Client(second.url, shared_memory=False) as body:
            assert same(body.load(tokens).kv, kv[:, :, :16])
