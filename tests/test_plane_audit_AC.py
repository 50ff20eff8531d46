"""Audit AC of the data plane's local lane against a real `kvtier serve` and raw sockets: what
its counters say of the frames a hostile or clumsy peer sends (`kvtier/service/lane.py`,
"Counted").

`kvtier_lane_requests_total` is the requests the lane answered and `kvtier_request_seconds`
has them too, as it has every HTTP request, refused or not. Before, a frame refused 400
(malformed) or 404 (a path the lane does not carry) was answered but counted nowhere, and a
frame whose peer hung up mid-body, which nothing answered, was counted as answered.
"""

from __future__ import annotations

import re
import socket
import struct
import time
from collections.abc import Iterator

import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import lane_of, opened, read_frame, send
from service_server import ADMIN_KEY, Server, kv_of, running, tokens_of, write_config

from kvtier.client import Client
from kvtier.results import StoreResult

KEY = "plane-audit-ac-key-0123456789"
AUTH = f"Bearer {KEY}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("plane_ac"),
        service={"max_tokens": 1024, "body_timeout_s": 2.0},
        tenants={"default": {"api_keys": [KEY]}},
    )
    with running(config) as live:
        yield live


def counts(server: Server) -> dict[str, float]:
    """The lane's request count, its open connections, and `kvtier_request_seconds`' count of
    each route."""
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        route = re.match(r'kvtier_request_seconds_count\{route="([^"]+)"\} (\S+)', line)
        if route:
            found[route[1]] = float(route[2])
        elif line.startswith(("kvtier_lane_requests_total ", "kvtier_lane_connections ")):
            name, value = line.split()
            found[name] = float(value)
    return found


def settled(server: Server) -> dict[str, float]:
    """`counts` once no lane connection is open (each connection's thread has ended)."""
    deadline = time.monotonic() + 5.0
    while (now := counts(server))["kvtier_lane_connections"] > 0:
        assert time.monotonic() < deadline, f"lane connections still open: {now}"
        time.sleep(0.01)
    return now


def test_refused_frames_are_counted_as_answered(server: Server) -> None:
    """Three malformed frames (400) and three of a path the lane does not carry (404): each is
    answered, so each counts once in the lane's requests and in `route="other"`."""
    name = lane_of(server, AUTH)
    before = settled(server)
    sock = opened(name)
    try:
        for _ in range(3):
            send(sock, b"\xc1")  # not msgpack at all
            assert read_frame(sock)[0] == 400
            send(sock, msgpack.packb(["/v1/nowhere", AUTH, None, b""], use_bin_type=True))
            assert read_frame(sock)[0] == 404
    finally:
        sock.close()
    after = settled(server)
    assert after["kvtier_lane_requests_total"] - before["kvtier_lane_requests_total"] == 6
    assert after.get("other", 0) - before.get("other", 0) == 6


def test_a_frame_cut_off_mid_body_is_not_counted(server: Server) -> None:
    """Frames longer than their head (64 KiB), admitted, whose peers hang up mid-body: nothing
    answers them, so nothing counts them; an answered lookup after them counts once."""
    name = lane_of(server, AUTH)
    body = msgpack.packb({"tokens": list(range(8)), "pad": "p" * 200_000})
    frame = msgpack.packb(["/v1/lookup", AUTH, None, body], use_bin_type=True)
    data = struct.pack("<I", len(frame)) + frame
    before = settled(server)
    for _ in range(3):
        sock = opened(name)
        sock.sendall(data[:100_000])  # the head and part of the body
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # the server ends it unanswered
        sock.close()
    sock = opened(name)
    try:
        sock.sendall(data)
        status, _ = read_frame(sock)
        assert status == 200
    finally:
        sock.close()
    after = settled(server)
    assert after["kvtier_lane_requests_total"] - before["kvtier_lane_requests_total"] == 1
    assert after["/v1/lookup"] - before.get("/v1/lookup", 0) == 1


def test_a_store_the_server_holds_whole_sends_no_body(server: Server) -> None:
    """A mapped client's store of a prefix the server holds whole: its reserve says so (nothing
    to reserve, every whole block cached), and the store ends there. It used to take that for a
    refusal and send the whole KV through `/v1/store` (a 4k-token prompt of a real model: 512
    MiB over HTTP for nothing); the answer is the body path's, and it is counted as a store."""
    tokens, kv = tokens_of(500, 67), kv_of(67, seed=5)  # 16 whole blocks of 4 and 3 tokens
    with Client(server.url, api_key=KEY) as client:
        before, stores = counts(server).get("/v1/store", 0.0), store_count(server)
        assert client.store(tokens, kv).stored_tokens == 64
        assert counts(server).get("/v1/store", 0.0) == before  # through the mapped pool
        again = client.store(tokens, kv)
        assert again == StoreResult(64, 0, 0)
        assert client.store(tokens[:64], kv[:, :, :64]) == again
        assert counts(server).get("/v1/store", 0.0) == before  # no body sent
        assert store_count(server) == stores + 3  # each a store, as the body path counts one
    with Client(server.url, api_key=KEY, shared_memory=False) as plain:
        assert plain.store(tokens, kv) == again  # the body path's answer is the same
    assert store_count(server) == stores + 4


def store_count(server: Server) -> float:
    """`kvtier_ops_total{op="stores"}`."""
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    found = re.search(r'^kvtier_ops_total\{op="stores"\} (\S+)$', text, re.MULTILINE)
    assert found is not None, text[:400]
    return float(found[1])
