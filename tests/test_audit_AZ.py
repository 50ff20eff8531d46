"""Audit AZ: the sidecar's REST API against callers without a key or naming no tenant of the
config, over real HTTP to a real `kvtier serve`.

- `GET /v1/pools` looked up the caller's Unix user (the kernel's TCP tables, read whole) before
  its key was looked at: a caller without a key made the server read them for a 401, 33-83 ms
  of a worker thread per call with 900-2,500 sockets open, against 1-1.4 ms for any other
  refusal. Now the lookup comes after admission (`app.py`).
- Without keys, a data-plane call naming a tenant the config does not list was refused (403
  `unknown_tenant`) only once its body was read, holding its bytes in
  `service.max_inflight_bytes` meanwhile (up to `max_body_bytes` a call, for `body_timeout_s`).
  Now it is refused at admission, before its body (`admission.py`).
"""

from __future__ import annotations

import resource
import socket
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest
from service_server import ADMIN_KEY, Server, running, write_config

ALICE = "alice-key-0123456789abcdef"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _check(server: Server) -> None:
    reply = server.admin("/v1/admin/check").json()
    assert reply == {"ok": True, "detail": ""}, reply


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tenants = {"alice": {"api_keys": [ALICE]}, "bob": {}}
    with running(write_config(tmp_path_factory.mktemp("keyed"), tenants=tenants)) as server:
        yield server


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    service = {"max_body_bytes": 1 << 20, "max_inflight_bytes": 2 << 20, "body_timeout_s": 20}
    path = write_config(
        tmp_path_factory.mktemp("keyless"), tenants={"alice": {}, "bob": {}}, service=service
    )
    with running(path) as server:
        yield server


def _mean_ms(client: httpx.Client, path: str, calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        reply = client.get(path)
        times.append(time.perf_counter() - started)
        assert reply.status_code == 401, reply.text  # no key
        assert reply.json()["error"] == "unauthorized"
    return statistics.median(times) * 1000


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_pools_without_a_key_is_refused_before_any_work(keyed: Server) -> None:
    # idle connections put two lines each in the kernel's TCP table the lookup reads (within
    # this process's descriptors, and the server's, which has as many as this one by default)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard or hard == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    count = min(3000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 256)
    if count < 700:
        pytest.skip(reason=f"too few file descriptors ({count + 256}) to fill the TCP table")
    port = int(keyed.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    try:
        with httpx.Client(base_url=keyed.url, timeout=30) as client:
            pools = _mean_ms(client, "/v1/pools", 40)
            status = _mean_ms(client, "/v1/status", 40)
    finally:
        for sock in idle:
            sock.close()
    # before: 11-80 ms against 1-2 ms; a refusal is a refusal, whatever the route
    assert pools < 4 * status + 3, (pools, status)
    reply = keyed.get("/v1/pools", headers={"authorization": f"Bearer {ALICE}"})
    assert reply.status_code == 200 and reply.json()["layout"]["model"] == "tiny", reply.text
    _check(keyed)


def _stalled(server: Server, tenant: str) -> socket.socket:
    """A chunked lookup naming `tenant` whose body never ends (its first byte sent)."""
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.settimeout(3)
    sock.sendall(
        b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"X-Kvtier-Tenant: " + tenant.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )
    return sock


def _reply(sock: socket.socket) -> bytes:
    """A whole reply of `Content-Length` bytes read from `sock` (`TimeoutError` if none)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        more = sock.recv(4096)
        assert more, f"closed after {data!r}"
        data += more
    return data


def _length(data: bytes) -> int:
    """The `Content-Length` of the head in `data` (0 while the head is incomplete)."""
    head = data.partition(b"\r\n\r\n")[0].lower()
    return (
        int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        if b"content-length: " in head
        else 0
    )


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_keyless_call_naming_an_unknown_tenant_is_refused_before_its_body(
    keyless: Server,
) -> None:
    socks = [_stalled(keyless, f"nobody{i}") for i in range(4)]
    try:
        for sock in socks:  # before: no answer until body_timeout_s (20 s), the budget held
            reply = _reply(sock)
            assert reply.startswith(b"HTTP/1.1 403"), reply
            assert b'"unknown_tenant"' in reply and b"nobody" in reply, reply
        inflight = keyless.get("/v1/status").json()["inflight"]
        assert inflight["held_bytes"] == 0, inflight
    finally:
        for sock in socks:
            sock.close()
    # the configured tenants' calls and the routes that name no tenant answer as before
    tokens = {"tokens": [1, 2, 3, 4]}
    ok = keyless.post("/v1/lookup", json=tokens, headers={"x-kvtier-tenant": "alice"})
    assert ok.status_code == 200, ok.text
    whole = keyless.post("/v1/lookup", json=tokens, headers={"x-kvtier-tenant": "x" * 100})
    assert whole.status_code == 403, whole.text
    assert whole.json() == {
        "error": "unknown_tenant",
        "detail": f"tenant {'x' * 64!r} (of 100 characters): unknown, expected one of "
        "['alice', 'bob']",
    }
    default = keyless.post("/v1/reset", json={})  # no header: tenant `default`, not listed
    assert default.status_code == 403 and default.json()["error"] == "unknown_tenant"
    pools = keyless.get("/v1/pools", headers={"x-kvtier-tenant": "nobody"})
    assert pools.status_code == 200, pools.text
    lease = keyless.get("/v1/leases/5", headers={"x-kvtier-tenant": "nobody"})
    assert lease.status_code == 404 and lease.json()["error"] == "unknown_lease", lease.text
    _check(keyless)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_stalled_known_tenant_call_still_waits_for_its_body(keyless: Server) -> None:
    sock = _stalled(keyless, "bob")
    try:
        with pytest.raises(TimeoutError):
            sock.recv(4096)  # admitted: its body is awaited, held in the budget
        held = keyless.get("/v1/status").json()["inflight"]["held_bytes"]
        assert held == 1 << 20, held
    finally:
        sock.close()
