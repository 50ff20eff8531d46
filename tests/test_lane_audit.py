"""The local lane (`kvtier/service/lane.py`) against hostile peers of a real `kvtier serve`,
beyond `test_lane.py`: one tenant's key never reaches another's leases or reservations over
the lane; a stalled peer neither blocks the others nor keeps its connection past the frame
timeout; the connection bound holds; and a lane that once failed to accept (out of file
descriptors) accepts again once it can."""

from __future__ import annotations

import os
import resource
import select
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lane_peer
import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import closed_by_server, connect, opened, read_frame, send
from service_server import Server, kv_of, running, start, tokens_of, write_config

from kvtier.client import Client
from kvtier.service import frames
from kvtier.service.lane import MAX_CONNECTIONS

KEY_A = "audit-tenant-a-key-0123456789"
KEY_B = "audit-tenant-b-key-0123456789"
AUTH_A, AUTH_B = f"Bearer {KEY_A}", f"Bearer {KEY_B}"
TIMEOUT_S = 1.5  # service.body_timeout_s


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("lane-audit"),
        service={"body_timeout_s": TIMEOUT_S, "prefetch_wait_s": 1.0},
        tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
    )
    with running(config) as live:
        yield live


def lane_of(server: Server) -> str:
    return lane_peer.lane_of(server, AUTH_A)


def call(sock: socket.socket, path: str, auth: str | None, fields: dict[str, Any],
         tenant: str | None = None) -> tuple[int, dict[str, Any]]:  # fmt: skip
    body = msgpack.packb(fields, use_bin_type=True)
    payload = msgpack.packb([path, auth, tenant, body], use_bin_type=True)
    send(sock, payload)
    status, reply = read_frame(sock)
    return status, msgpack.unpackb(reply, raw=False)


def packed(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def check_store(server: Server) -> None:
    assert server.admin("/v1/admin/check").json()["ok"] is True


def test_one_tenants_key_never_reaches_anothers_leases_or_reservations(server: Server) -> None:
    tokens = tokens_of(7000, 16)
    with Client(server.url, api_key=KEY_A) as client_a:
        assert client_a.store(tokens, kv_of(16, seed=7)).stored_tokens == 16
    sock = opened(lane_of(server))
    try:
        lookup = {"tokens": packed(tokens)}
        assert call(sock, "/v1/lookup", AUTH_A, lookup)[1]["num_tokens"] == 16
        assert call(sock, "/v1/lookup", AUTH_B, lookup)[1]["num_tokens"] == 0
        # with keys, the tenant field is ignored: b's key naming tenant a is still tenant b
        assert call(sock, "/v1/lookup", AUTH_B, lookup, tenant="a")[1]["num_tokens"] == 0
        status, lease = call(sock, "/v1/prefetch", AUTH_A, {**lookup, "wait_s": 1.0})
        assert status == 200 and lease["state"] == "ready", lease
        lease_id = lease["lease_id"]
        unknown = call(sock, "/v1/leases", AUTH_B, {"lease_id": 12345})[1]["detail"]
        for path in ("/v1/leases", "/v1/release"):
            status, refusal = call(sock, path, AUTH_B, {"lease_id": lease_id})
            assert (status, refusal["error"]) == (404, "unknown_lease"), (path, refusal)
            # the same answer as for an id no one holds: nothing tells b the lease exists
            assert refusal["detail"] == unknown.replace("12345", str(lease_id))
        for path in ("/v1/prefetch", "/v1/reserve"):  # b "releases" a's lease on its way
            status, _ = call(sock, path, AUTH_B, {"tokens": packed(tokens_of(9000, 4)),
                                                  "release": [lease_id]})  # fmt: skip
            assert status == 200
        status, still = call(sock, "/v1/leases", AUTH_A, {"lease_id": lease_id})
        assert status == 200 and still["state"] == "ready", still
        reserve = {"tokens": packed(tokens_of(8000, 8))}
        status, reservation = call(sock, "/v1/reserve", AUTH_A, reserve)
        assert status == 200 and reservation["slots"], reservation
        rid = reservation["reservation_id"]
        for path in ("/v1/commit", "/v1/abort"):
            status, refusal = call(sock, path, AUTH_B, {"reservation_id": rid})
            assert (status, refusal["error"]) == (404, "unknown_lease"), (path, refusal)
        assert call(sock, "/v1/abort", AUTH_A, {"reservation_id": rid})[0] == 200  # still a's
        assert call(sock, "/v1/release", AUTH_A, {"lease_id": lease_id})[0] == 200
    finally:
        sock.close()
    check_store(server)


def test_a_stalled_peer_blocks_no_other_and_is_cut_off_mid_length(server: Server) -> None:
    name = lane_of(server)
    stalled, partial = opened(name), opened(name)
    try:
        stalled.sendall(struct.pack("<I", 100) + b"\x00" * 10)  # 10 of 100 bytes, then nothing
        partial.sendall(b"\x05\x00")  # 2 of a length's 4 bytes, then nothing
        started = time.monotonic()
        other = opened(name)
        try:
            status, _ = call(other, "/v1/lookup", AUTH_A, {"tokens": packed([1, 2, 3, 4])})
        finally:
            other.close()
        assert status == 200 and time.monotonic() - started < TIMEOUT_S
        assert not select.select([stalled, partial], [], [], 0)[0]  # both still open then
        for sock in (stalled, partial):  # a frame, its length included, has TIMEOUT_S
            sock.settimeout(TIMEOUT_S + 5)
            assert closed_by_server(sock)
        assert time.monotonic() - started < TIMEOUT_S + 3
    finally:
        stalled.close()
        partial.close()


def test_connections_mid_body_at_the_bound_make_room_before_the_hello(server: Server) -> None:
    """Every connection holding a call whose body is not all sent (waiting on its peer, not
    answered): one more still gets its hello, the one idle longest (mid-body) closed to make
    room, and a client stays on the lane (auditor U: before, every new connection was closed
    before its hello; `test_service_audit_u.py`). Idle ones make room too: see
    `test_lane_bounds.py`."""
    name = lane_of(server)
    held: list[socket.socket] = []
    body = msgpack.packb({"tokens": bytes(4 << 15)}, use_bin_type=True)  # 128 KiB
    payload = msgpack.packb(["/v1/lookup", AUTH_A, None, body], use_bin_type=True)
    try:
        for _ in range(MAX_CONNECTIONS):
            held.append(opened(name))
        for sock in held:  # admitted on its head, its body awaited: idle, waiting on its peer
            sock.sendall(struct.pack("<I", len(payload)) + payload[: len(payload) // 2 + 4096])
        time.sleep(TIMEOUT_S / 3)  # their threads read the heads (each body has TIMEOUT_S)
        opened(name, timeout_s=10).close()  # its hello: room was made
        held[0].settimeout(10)
        assert closed_by_server(held[0])  # the one idle longest, its body never finished
        with Client(server.url, api_key=KEY_A) as client:
            assert client.lookup(tokens_of(1, 8)).num_tokens == 0
            assert client._lane is not None and not client._lane.dead and client._lane.calls == 1
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # their threads end as they see the close: room again
        try:
            opened(name, timeout_s=2).close()
            break
        except (EOFError, ConnectionResetError):
            assert time.monotonic() < deadline, "the lane did not free its connections"
            time.sleep(0.05)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit (Linux)")
def test_a_lane_that_ran_out_of_descriptors_accepts_again(tmp_path: Path) -> None:
    """A peer that makes the server run out of file descriptors (any local user can, with idle
    HTTP connections) must not end the lane for good: once descriptors are free, it accepts."""
    live = start(write_config(tmp_path, service={"body_timeout_s": TIMEOUT_S}))
    try:
        name = live.get("/v1/pools").json()["lane"]
        pid = live.process.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        held: list[socket.socket] = []
        try:
            now_open = len(os.listdir(f"/proc/{pid}/fd"))
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (now_open, hard))  # no fd to spare
            for _ in range(16):  # until one is not accepted (EMFILE)
                sock = connect(name, timeout_s=1.0)
                held.append(sock)
                try:
                    assert read_frame(sock) == frames.HELLO
                except TimeoutError:
                    break
            else:
                pytest.fail("the server never ran out of descriptors")
        finally:
            for sock in held:
                sock.close()
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        opened(name, timeout_s=5).close()
        assert live.get("/readyz").status_code == 200
    finally:
        assert live.stop() == 0
