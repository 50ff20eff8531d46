"""Audit AW of the local lane's server side against hostile same-host peers sharing one real
`kvtier serve` (`kvtier/service/lane.py`, `lane_state.py`; raw sockets, no client code):

- A peer that sends calls and reads none of its replies keeps each connection answering a call
  (its reply waiting on a full socket buffer) for `body_timeout_s` at a time, so 256 such
  connections, key-less ones refused 401 included, used to close every other client's new
  connection before its hello, over and over (its client takes HTTP for 30 s a time). A reply
  left unread for `STALL_S` now lets room-making cut its connection.
- The lane listened with a backlog of 64: four clients opening their 64 connections at once
  (the most a client opens, `client/lane_slots.py` `MOST_CALLS`) had most of the connects refused
  (EAGAIN: 152 to 184 of 256 on this machine), each such client going to HTTP for 30 s.
- A server restarted while its clients idle could find /dev/shm too small with nothing in it:
  the stopped server's pools keep their pages while a client maps them. Its refusal says so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import socket
import struct
import time
from collections.abc import Iterator

import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import GOODBYE_FRAME, lane_of, opened, read_frame
from service_server import ADMIN_KEY, Server, running, write_config

from kvtier.service.lane import MAX_CONNECTIONS
from kvtier.tiers import shm

KEY_A = "audit-aw-tenant-a-key-0123456789"
KEY_B = "audit-aw-tenant-b-key-0123456789"
TENANTS = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
STALL_S = 1.0  # lane_state.STALL_S, as a literal (the module has none before the fix)
PIPELINED = 2000  # key-less lookups sent at once: far more replies than a socket buffer holds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Its first-frame bound (5 s) and `body_timeout_s` (30 s) outlast each scenario."""
    config = write_config(
        tmp_path_factory.mktemp("plane_aw"), service={"body_timeout_s": 30.0}, tenants=TENANTS
    )
    with running(config) as live:
        yield live


def frame_of(path: str, auth: str | None, body: object) -> bytes:
    payload: bytes = msgpack.packb([path, auth, None, msgpack.packb(body)], use_bin_type=True)
    return struct.pack("<I", len(payload)) + payload


KEYLESS = frame_of("/v1/lookup", None, {"tokens": [1, 2, 3, 4]})  # answered 401


def stuffed(name: str) -> socket.socket:
    """A lane connection that has sent `PIPELINED` calls and reads none of their replies."""
    sock = opened(name)
    sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        sock.send(KEYLESS * PIPELINED)
    return sock


def lookup_answered(name: str) -> int:
    """Tenant b's lookup over a new lane connection: its status (0: closed before its hello)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect("\0" + name)
        if sock.recv(1, socket.MSG_PEEK) == b"":
            return 0
        read_frame(sock)  # its hello
        sock.sendall(frame_of("/v1/lookup", f"Bearer {KEY_B}", {"tokens": [1, 2, 3, 4]}))
        status: int = read_frame(sock)[0]
        return status
    finally:
        sock.close()


def ended(sock: socket.socket, within_s: float) -> bytes:
    """What `sock` reads to its end (`within_s` at most; a reset ends it too)."""
    sock.setblocking(True)
    sock.settimeout(within_s)
    got = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            got += chunk
    return bytes(got)


def test_a_connection_whose_replies_go_unread_is_the_one_cut_for_room(server: Server) -> None:
    """One peer's replies go unread (stalled since before the others' hellos); at the bound a
    new connection makes room by cutting it, without a goodbye (a reply is under way), and the
    silent connections opened after it stay. Before, a stalled reply was a call being answered,
    never ended for room: a silent connection was closed instead."""
    name = lane_of(server, f"Bearer {KEY_A}")
    hog = stuffed(name)
    time.sleep(STALL_S + 0.3)  # its reply stalled for longer than STALL_S
    silent = [opened(name) for _ in range(MAX_CONNECTIONS - 1)]  # the bound, with the hog
    try:
        assert lookup_answered(name) == 200
        rest = ended(hog, 5.0)  # cut: its unread replies, then the end
        assert not rest.endswith(GOODBYE_FRAME)
        assert not select.select(silent, [], [], 0)[0]  # the silent ones still open
    finally:
        hog.close()
        for sock in silent:
            sock.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_peers_that_read_no_reply_cannot_hold_every_connection(server: Server) -> None:
    """`MAX_CONNECTIONS` key-less peers pipeline calls and read no reply: each connection's
    thread waits on its reply. Another tenant's lookups still take the lane, each new
    connection cutting a stalled one, and `kvtier_lane_connections` says the bound. Before,
    each new connection was closed before its hello for `body_timeout_s` (30 s here)."""
    name = lane_of(server, f"Bearer {KEY_A}")
    hogs = [stuffed(name) for _ in range(MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 30
        while lane_connections(server) < MAX_CONNECTIONS:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(STALL_S + 0.3)
        assert [lookup_answered(name) for _ in range(5)] == [200] * 5
        while lane_connections(server) > MAX_CONNECTIONS:  # a cut one's thread ends at once
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for sock in hogs:
            sock.close()


def test_a_burst_of_connects_past_64_is_queued_not_refused(server: Server) -> None:
    """300 connects at once, as four clients opening their 64 connections each (and more) do:
    each is queued for the lane's accept (`BACKLOG`) rather than refused EAGAIN, which sends a
    client to HTTP for 30 s. Before, the backlog was 64: the connects past it failed."""
    name = lane_of(server, f"Bearer {KEY_A}")
    socks, refused = [], 0
    try:
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)  # as the clients connect: a full backlog fails at once
            try:
                sock.connect("\0" + name)
            except BlockingIOError:
                refused += 1
                sock.close()
                continue
            socks.append(sock)
        assert refused == 0
    finally:
        for sock in socks:
            sock.close()
    assert lookup_answered(name) == 200


def lane_connections(server: Server) -> float:
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    found = re.search(r"^kvtier_lane_connections (\S+)$", text, re.MULTILINE)
    assert found is not None
    return float(found[1])


def test_too_little_shared_memory_names_the_room_an_idle_clients_mapping_keeps() -> None:
    """A pool past what /dev/shm has free is refused naming the free room, and now also what can
    hold room unseen: a server restarted while its clients idle found /dev/shm too small (the
    stopped server's pools, unlinked, keep their pages while a client maps them), with no file
    there to explain it. No segment is left."""
    room = os.statvfs(shm.SHM_DIR)
    nbytes = room.f_blocks * room.f_frsize + (1 << 30)  # more than the whole tmpfs
    name = f"{shm.segment_prefix('kvtieraw')}-host"
    with pytest.raises(OSError) as refused:
        shm.create_shared(name, nbytes)
    assert refused.value.errno == errno.ENOSPC
    message = str(refused.value)
    assert "bytes free" in message and "still maps" in message, message
    assert not (shm.SHM_DIR / name).exists()
