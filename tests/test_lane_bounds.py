"""The local lane's bounds on what a same-user peer can take (`kvtier/service/lane.py`), against
a real `kvtier serve`: a frame is admitted on its head, before its body is read, so key-less
frames of the longest length hold no memory; a tenant's body is held in
`service.max_inflight_bytes` before it is read (it waits for room, or is refused 503 busy, as
over HTTP); a connection that sends no frame is closed soon, and at the connection bound the
one idle longest makes room, so silent peers cannot push the other clients off the lane."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import lane_peer
import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import closed_by_server, opened, read_frame, send
from service_server import ADMIN_KEY, Server, peak_rss_mib, reset_peak, running, write_config

from kvtier.client import Client
from kvtier.service.lane import FIRST_FRAME_S, MAX_CONNECTIONS

pytestmark = pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite

KEY_A = "bounds-tenant-a-key-0123456789"
KEY_B = "bounds-tenant-b-key-0123456789"
AUTH_A = f"Bearer {KEY_A}"
TENANTS = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
TIMEOUT_S = 2.0  # service.body_timeout_s (and the first frame's bound, under 5 s)
FRAME_LIMIT = 4 * (1 << 20) + (1 << 20)  # `frame_limit` at the default max_tokens (1 << 20)
INFLIGHT_64M = {"max_inflight_bytes": 64 << 20}
SHARE_512K = {"max_body_bytes": 512 << 10, "max_inflight_bytes": 1 << 20}  # two tenants
PEERS = 48  # key-less peers sending frames of FRAME_LIMIT: 240 MiB were they read whole


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("lane-bounds"),
        service={"body_timeout_s": TIMEOUT_S, "max_body_bytes": 16 << 20, **INFLIGHT_64M},
        tenants=TENANTS,
    )
    with running(config) as live:
        yield live


def frame_of(path: str, auth: str | None, body: bytes) -> bytes:
    """A request frame as the wire has it: length, then `[path, auth, tenant, body]`."""
    payload: bytes = msgpack.packb([path, auth, None, body], use_bin_type=True)
    return struct.pack("<I", len(payload)) + payload


def lookup_body(count: int) -> bytes:
    body: bytes = msgpack.packb({"tokens": bytes(4 * count)}, use_bin_type=True)  # token 0s
    return body


def reply_of(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    status, body = read_frame(sock)
    return status, msgpack.unpackb(body, raw=False)


def test_keyless_frames_of_the_longest_length_are_refused_on_their_head_unheld(
    server: Server,
) -> None:
    """F2: each frame, all of it but its last byte sent, is answered 401 from its head (so
    before the rest could have been read whole), and the server's peak memory does not grow
    by what the frames would hold: 48 frames of 5 MiB."""
    name = lane_peer.lane_of(server, AUTH_A)
    frame = frame_of("/v1/lookup", None, bytes(FRAME_LIMIT - 64))
    (length,) = struct.unpack("<I", frame[:4])
    assert FRAME_LIMIT - 64 < length <= FRAME_LIMIT  # the longest frame the lane reads
    socks = [opened(name, timeout_s=TIMEOUT_S) for _ in range(PEERS)]
    replies: list[Any] = [None] * PEERS
    pid = server.process.pid
    reset_peak(pid)
    before = peak_rss_mib(pid)

    def peer(i: int) -> None:
        sock = socks[i]
        try:
            sock.sendall(memoryview(frame)[:-1])  # never the last byte
            replies[i] = reply_of(sock)
        except (OSError, EOFError) as exc:  # no answer before the deadline closed it
            replies[i] = exc

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(PEERS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        grown = peak_rss_mib(pid) - before
        assert grown < 48, f"peak RSS grew {grown:.0f} MiB for {PEERS} key-less frames"
        for reply in replies:
            assert isinstance(reply, tuple) and reply[0] == 401, reply
            assert reply[1]["error"] == "unauthorized", reply
    finally:
        for sock in socks:
            sock.close()
    sock = opened(name)  # a refused frame sent whole is skipped: the connection goes on
    try:
        sock.sendall(frame_of("/v1/lookup", "Bearer not-a-key-0123456789", bytes(1 << 20)))
        assert reply_of(sock)[0] == 403
        sock.sendall(frame_of("/v1/lookup", AUTH_A, lookup_body(4)))
        status, body = reply_of(sock)
        assert status == 200 and body["num_tokens"] == 0, body
    finally:
        sock.close()
    assert server.get("/readyz").status_code == 200


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose tenants' share of the bytes in flight is 512 KiB."""
    config = write_config(
        tmp_path_factory.mktemp("lane-budget"),
        service={"body_timeout_s": TIMEOUT_S, "max_tokens": 1 << 17, **SHARE_512K},
        tenants=TENANTS,
    )
    with running(config) as live:
        yield live


HOLDER_BYTES = 200 << 10  # an HTTP body of tenant a's, held in flight while it never comes
CALL_TOKENS = 100_000  # a lane lookup of 400 KiB: with a holder, past a's share of 512 KiB


def holder(server: Server) -> socket.socket:
    """An HTTP lookup of tenant a whose `HOLDER_BYTES` body never comes: held for TIMEOUT_S."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        f"POST /v1/lookup HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: {AUTH_A}\r\n"
        f"Content-Type: application/msgpack\r\nContent-Length: {HOLDER_BYTES}\r\n\r\n".encode()
    )
    return sock


def waits(server: Server) -> tuple[int, int]:
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
    inflight = server.get("/v1/status", headers=auth).json()["inflight"]
    return inflight["waits"], inflight["busy"]


def lane_call(sock: socket.socket, frame: bytes) -> tuple[float, tuple[int, dict[str, Any]]]:
    """Send `frame` (from a thread: its rest is read only once it is held) and its reply."""
    sender = threading.Thread(target=sock.sendall, args=(frame,))
    started = time.monotonic()
    sender.start()
    reply = reply_of(sock)
    sender.join(30)
    return time.monotonic() - started, reply


def test_a_tenants_frame_past_its_free_share_waits_for_room_as_over_http(tight: Server) -> None:
    name = lane_peer.lane_of(tight, AUTH_A)
    sock = opened(name, timeout_s=30)
    frame = frame_of("/v1/lookup", AUTH_A, lookup_body(CALL_TOKENS))
    held = holder(tight)
    try:
        time.sleep(0.3)  # the holder's body is in flight
        waited_before, _ = waits(tight)
        elapsed, (status, body) = lane_call(sock, frame)
        assert status == 200 and body["num_tokens"] == 0, body
        assert elapsed > TIMEOUT_S - 0.3 - 0.4, elapsed  # until the holder's 408
        assert waits(tight)[0] == waited_before + 1
    finally:
        held.close()
        sock.close()


def test_a_tenants_frame_that_never_fits_its_share_is_refused_busy(tight: Server) -> None:
    name = lane_peer.lane_of(tight, AUTH_A)
    sock = opened(name, timeout_s=30)
    stop = threading.Event()
    held: list[socket.socket] = []

    def hold_on() -> None:  # a holder every TIMEOUT_S / 2, each held TIMEOUT_S: never none
        while not stop.is_set():
            held.append(holder(tight))
            stop.wait(TIMEOUT_S / 2)

    rolling = threading.Thread(target=hold_on)
    rolling.start()
    try:
        time.sleep(0.3)
        _, busy_before = waits(tight)
        elapsed, (status, body) = lane_call(
            sock, frame_of("/v1/lookup", AUTH_A, lookup_body(CALL_TOKENS))
        )
        assert (status, body["error"]) == (503, "busy"), body
        assert elapsed > TIMEOUT_S - 0.4, elapsed
        assert waits(tight)[1] == busy_before + 1
        stop.set()
        sock.sendall(frame_of("/v1/lookup", AUTH_A, lookup_body(4)))  # the rest was skipped
        assert reply_of(sock)[0] == 200
    finally:
        stop.set()
        rolling.join(30)
        for one in held:
            one.close()
        sock.close()


@pytest.fixture(scope="module")
def patient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose first-frame bound (5 s) outlasts opening all its lane connections."""
    config = write_config(
        tmp_path_factory.mktemp("lane-room"), service={"body_timeout_s": 30.0}, tenants=TENANTS
    )
    with running(config) as live:
        yield live


def test_silent_peers_at_the_bound_make_room_and_a_client_stays_on_the_lane(
    patient: Server,
) -> None:
    """F4: every lane connection taken by a peer that sends nothing; a client's calls still go
    over the lane: the connection idle longest is closed to make room for a new one (first the
    client's own, idle since its last call, which it finds closed and replaces)."""
    name = lane_peer.lane_of(patient, AUTH_A)
    silent: list[socket.socket] = []
    try:
        with Client(patient.url, api_key=KEY_A) as client:
            assert client.lookup(list(range(1, 9))).num_tokens == 0
            opening = time.monotonic()
            for _ in range(MAX_CONNECTIONS):
                silent.append(opened(name))
            for _ in range(5):
                assert client.lookup(list(range(1, 9))).num_tokens == 0
            lane = client._lane
            assert lane is not None and not lane.dead and lane.calls == 6
        silent[0].settimeout(5)
        assert closed_by_server(silent[0])  # the one idle longest when the client reopened
        if time.monotonic() - opening < FIRST_FRAME_S - 0.5:  # (a loaded machine: past it,
            # the first silent ones end at their first frame's bound, which is right too)
            assert not select.select(silent[1:], [], [], 0)[0]  # the others still open
    finally:
        for sock in silent:
            sock.close()


def test_a_connection_that_sends_no_frame_is_closed_one_that_did_stays(server: Server) -> None:
    """F4: a connection opens to send a call: one without a frame within
    min(service.body_timeout_s, 5 s) is closed; one idle after a call is kept."""
    name = lane_peer.lane_of(server, AUTH_A)
    silent, used = opened(name), opened(name)
    try:
        send(used, msgpack.packb(["/v1/lookup", AUTH_A, None, lookup_body(4)], use_bin_type=True))
        assert reply_of(used)[0] == 200
        started = time.monotonic()
        silent.settimeout(TIMEOUT_S + 5)
        assert closed_by_server(silent)
        assert time.monotonic() - started < TIMEOUT_S + 2
        assert not select.select([used], [], [], 0)[0]  # still open, nothing to read
        used.sendall(frame_of("/v1/lookup", AUTH_A, lookup_body(4)))
        assert reply_of(used)[0] == 200
    finally:
        silent.close()
        used.close()
