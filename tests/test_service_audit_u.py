"""Auditor U's two findings, against a real `kvtier serve` (`kvtier/service/grants.py`,
`plane.py`, `lane.py`, `lane_state.py`):

1. Without API keys, `/v1/release {request}` and `/v1/abort {request}` naming a tenant the
   config does not list are refused 403 `unknown_tenant`, as `/v1/lookup` is, over the lane
   and over HTTP, and nothing is remembered for the name (before: 200, and a new grants table
   per name: 3,000 names of 30 KB grew the server by 175 MiB). A configured tenant's give-back
   by token still answers `{}`.
2. A keyed tenant holding every lane connection with frames whose body it never finishes (the
   bodies charged to the budget, or waiting for room there) cannot keep another tenant's new
   connection off the lane: the one idle longest, mid-body, makes room, and its held bytes
   return to the budget (before: every new connection was closed before its hello for
   `body_timeout_s` at a time). Once the stalled peers hang up, the budget holds nothing and
   the lane's connection gauge is back to 0.
"""

from __future__ import annotations

import secrets
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import lane_peer
import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import closed_by_server, opened, read_frame
from service_server import ADMIN_KEY, Server, running, write_config

from kvtier.service import frames
from kvtier.service.lane import MAX_CONNECTIONS

pytestmark = pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite

KEY_A = "audit-u-tenant-a-key-0123456789"
KEY_B = "audit-u-tenant-b-key-0123456789"
TENANTS = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
STALLED_TOKENS = 50_000  # a lookup of 200 KB: its 64 KiB head admitted, its body charged
SHARE_512K = {"max_body_bytes": 512 << 10, "max_inflight_bytes": 1 << 20}  # two tenants
SENT = 70_000  # the bytes of it each stalled peer sends: the head and a little of the body


def frame_of(path: str, auth: str | None, body: dict[str, Any], tenant: str | None) -> bytes:
    """A request frame as the wire has it: length, then `[path, auth, tenant, body]`."""
    packed = msgpack.packb(body, use_bin_type=True)
    payload: bytes = msgpack.packb([path, auth, tenant, packed], use_bin_type=True)
    return struct.pack("<I", len(payload)) + payload


def lane_call(
    sock: socket.socket, path: str, auth: str | None, body: dict[str, Any], tenant: str | None
) -> tuple[int, Any]:
    sock.sendall(frame_of(path, auth, body, tenant))
    status, reply = read_frame(sock)
    return status, msgpack.unpackb(reply, raw=False)


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server without API keys: every caller names its tenant; `default` the only one."""
    with running(write_config(tmp_path_factory.mktemp("audit-u-keyless"))) as live:
        yield live


@pytest.mark.parametrize("path", ["/v1/release", "/v1/abort"])
def test_a_give_back_by_token_of_an_unconfigured_tenant_is_refused_on_the_lane(
    keyless: Server, path: str
) -> None:
    name = lane_peer.lane_of(keyless, "")
    sock = opened(name)
    try:
        for _ in range(3):
            tenant = secrets.token_hex(8) + "x" * 1000
            status, reply = lane_call(sock, path, None, {"request": secrets.token_hex(8)}, tenant)
            assert status == 403, reply
            assert reply["error"] == "unknown_tenant", reply
            assert tenant[:16] in reply["detail"] and "'default'" in reply["detail"], reply
        status, reply = lane_call(sock, "/v1/lookup", None, {"tokens": bytes(32)}, "nosuch")
        assert (status, reply["error"]) == (403, "unknown_tenant")  # as a lookup is refused
        status, reply = lane_call(sock, path, None, {"request": secrets.token_hex(8)}, "default")
        assert (status, reply) == (200, {})  # a configured tenant's: given back as before
    finally:
        sock.close()


@pytest.mark.parametrize("path", ["/v1/release", "/v1/abort"])
def test_a_give_back_by_token_of_an_unconfigured_tenant_is_refused_over_http(
    keyless: Server, path: str
) -> None:
    token = secrets.token_hex(8)
    for tenant, status in (("nosuch", 403), ("default", 200)):
        reply = httpx.post(
            keyless.url + path, json={"request": token}, headers={"x-kvtier-tenant": tenant}
        )
        assert reply.status_code == status, reply.text
        if status == 403:
            assert reply.json()["error"] == "unknown_tenant", reply.text
            assert "'nosuch'" in reply.json()["detail"], reply.text
    keyless.admin("/v1/admin/check")


def held_bytes(server: Server) -> int:
    held: int = server.get("/v1/status", headers=ADMIN).json()["inflight"]["held_bytes"]
    return held


def lane_gauge(server: Server) -> float:
    for line in server.get("/metrics", headers=ADMIN).text.splitlines():
        if line.startswith("kvtier_lane_connections "):
            return float(line.split()[1])
    raise AssertionError("no kvtier_lane_connections gauge")


def settled(check: Any, timeout_s: float = 5.0) -> bool:
    """Whether `check()` is true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stall_every_connection(server: Server) -> tuple[list[socket.socket], int]:
    """Tenant a's `MAX_CONNECTIONS` lane connections, each with a lookup frame sent only up to
    `SENT` bytes: its head admitted, its body stalled. The peers, and the body's length."""
    body = {"tokens": bytes(4 * STALLED_TOKENS)}
    frame = frame_of("/v1/lookup", f"Bearer {KEY_A}", body, None)
    name = lane_peer.lane_of(server, f"Bearer {KEY_A}")
    stalled = []
    for _ in range(MAX_CONNECTIONS):
        sock = opened(name)
        sock.sendall(frame[:SENT])
        stalled.append(sock)
    return stalled, len(msgpack.packb(body, use_bin_type=True))


def b_is_answered_on_the_lane(server: Server) -> None:
    """A new lane connection of tenant b gets its hello and its lookup answered."""
    sock = lane_peer.connect(lane_peer.lane_of(server, f"Bearer {KEY_B}"), 5)
    try:
        assert read_frame(sock) == frames.HELLO  # before: closed here (EOFError)
        status, reply = lane_call(
            sock, "/v1/lookup", f"Bearer {KEY_B}", {"tokens": bytes(32)}, None
        )
        assert status == 200 and reply["num_tokens"] == 0, reply
    finally:
        sock.close()


@pytest.fixture
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Keyed tenants a and b, a budget that holds every stalled body, frames 30 s apiece."""
    config = write_config(
        tmp_path_factory.mktemp("audit-u-roomy"),
        service={"body_timeout_s": 30.0},
        tenants=TENANTS,
    )
    with running(config) as live:
        yield live


def test_stalled_bodies_of_one_tenant_do_not_keep_another_off_the_lane(roomy: Server) -> None:
    stalled, body_length = stall_every_connection(roomy)
    try:
        everyone = MAX_CONNECTIONS * body_length
        assert settled(lambda: held_bytes(roomy) == everyone), held_bytes(roomy)
        for _ in range(3):
            b_is_answered_on_the_lane(roomy)
        stalled[0].settimeout(5)
        assert closed_by_server(stalled[0])  # the one idle longest: its frame never finished
        assert settled(lambda: held_bytes(roomy) <= everyone - body_length)  # given back
    finally:
        for sock in stalled:
            sock.close()
    assert settled(lambda: held_bytes(roomy) == 0 and lane_gauge(roomy) == 0)
    roomy.admin("/v1/admin/check")


@pytest.fixture
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Keyed tenants a and b whose shares (512 KiB) hold two stalled bodies: the others wait
    for room in the budget, up to `body_timeout_s` (30 s)."""
    config = write_config(
        tmp_path_factory.mktemp("audit-u-tight"),
        service={"body_timeout_s": 30.0, **SHARE_512K},
        tenants=TENANTS,
    )
    with running(config) as live:
        yield live


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_frames_waiting_for_room_do_not_keep_another_off_the_lane(tight: Server) -> None:
    stalled, body_length = stall_every_connection(tight)
    try:
        assert settled(lambda: held_bytes(tight) == 2 * body_length), held_bytes(tight)
        for _ in range(3):
            b_is_answered_on_the_lane(tight)  # each closing one of a's waiting for room
        stalled[0].settimeout(5)
        assert closed_by_server(stalled[0])
    finally:
        for sock in stalled:
            sock.close()
    assert settled(lambda: held_bytes(tight) == 0 and lane_gauge(tight) == 0)
    tight.admin("/v1/admin/check")
