"""The local lane (`kvtier/service/lane.py`, `kvtier/client/lane.py`) against a real `kvtier
serve`: a same-host client takes it for the small calls and gets what HTTP gives; hostile
frames are answered or cut off and the store stays whole; another user is closed before a byte;
a lane that cannot be reached leaves the client on HTTP; a stopping server ends its
connections."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lane_peer
import msgpack  # type: ignore[import-untyped]
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lane_peer import closed_by_server, connect, opened, read_frame, send
from service_server import ADMIN_KEY, Server, kv_of, running, start, tokens_of, write_config

from kvtier.client import AsyncClient, Client
from kvtier.client.lane import AsyncLaneConnections, LaneConnections
from kvtier.errors import LeaseError, ReplyError
from kvtier.service import frames

KEY = "lane-tenant-key-0123456789"
AUTH = f"Bearer {KEY}"
MAX_TOKENS = 256
MAX_BODY = 4096
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("lane"),
        service={
            "max_tokens": MAX_TOKENS,
            "max_body_bytes": MAX_BODY,
            "body_timeout_s": TIMEOUT_S,
            "prefetch_wait_s": 1.0,
        },
        tenants={"default": {"api_keys": [KEY]}},
    )
    with running(config) as live:
        yield live


def lane_of(server: Server) -> str:
    return lane_peer.lane_of(server, AUTH)


def call(sock: socket.socket, request: Any) -> tuple[int, dict[str, Any]]:
    send(sock, msgpack.packb(request, use_bin_type=True))
    status, body = read_frame(sock)
    return status, msgpack.unpackb(body, raw=False)


def check_store(server: Server) -> None:
    assert server.admin("/v1/admin/check").json()["ok"] is True


def test_a_same_host_client_takes_the_lane_and_gets_what_http_gives(server: Server) -> None:
    tokens = tokens_of(1000, 48)
    kv = kv_of(48, seed=1)
    with (
        Client(server.url, api_key=KEY) as near,
        Client(server.url, api_key=KEY, shared_memory=False) as far,
    ):
        lane = near._lane
        assert lane is not None and not lane.dead and far._lane is None
        stored = near.store(tokens, kv)  # reserve + the mapped pool + commit: two lane calls
        assert stored.stored_tokens == 48 and lane.calls == 2
        assert near.lookup(tokens) == far.lookup(tokens)
        assert near.lookup(tokens).num_tokens == 48
        loaded = near.load(tokens)  # a prefetch over the lane, the copy from the mapped pool
        assert torch.equal(loaded.kv.view(torch.int16), kv.view(torch.int16))
        over_http = far.load(tokens)
        assert torch.equal(over_http.kv.view(torch.int16), kv.view(torch.int16))
        assert lane.calls >= 5
        with pytest.raises(LeaseError):
            near.release(10**9)  # a typed error comes back over the lane as over HTTP
        answered = lane.calls  # read first: the flusher's release may be on its way
        metrics = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
        assert metric(metrics, "kvtier_lane_connections") >= 1  # `near`'s, still open
        assert metric(metrics, "kvtier_lane_requests_total") >= answered
    check_store(server)


def metric(text: str, name: str) -> float:
    """The value of an unlabelled series in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no series {name} in /metrics")


def test_hostile_frames_are_answered_or_cut_off_and_the_store_stays_whole(
    server: Server,
) -> None:
    name = lane_of(server)
    tokens = struct.pack("<4I", 1, 2, 3, 4)
    good_body = msgpack.packb({"tokens": tokens}, use_bin_type=True)
    sock = opened(name)
    try:
        status, body = call(sock, ["/v1/lookup", AUTH, None, good_body])
        assert status == 200 and body["num_tokens"] == 0
        send(sock, b"\xc1 not msgpack")
        refusal = msgpack.unpackb(read_frame(sock)[1])
        assert refusal["error"] == "malformed_frame"
        for bad in (["/v1/lookup"], {"path": 1}, ["/v1/lookup", 7, None, good_body],
                    ["/v1/lookup", AUTH, None, "not bytes"], 12):  # fmt: skip
            status, body = call(sock, bad)
            assert (status, body["error"]) == (400, "malformed_frame"), bad
        status, body = call(sock, ["/v1/store", AUTH, None, good_body])
        assert (status, body["error"]) == (404, "not_found")  # KV bodies stay on HTTP
        status, body = call(sock, ["/v1/lookup", None, None, good_body])
        assert (status, body["error"]) == (401, "unauthorized")
        status, body = call(sock, ["/v1/lookup", "Bearer wrong", None, good_body])
        assert (status, body["error"]) == (403, "forbidden") and "wrong" not in body["detail"]
        status, body = call(sock, ["/v1/lookup", AUTH, None, b"\x93\x01"])  # cut short
        assert (status, body["error"]) == (400, "malformed_body")
        status, body = call(sock, ["/v1/lookup", AUTH, None, b"\x00" * (MAX_BODY + 1)])
        assert (status, body["error"]) == (413, "body_too_large")
        too_many = msgpack.packb({"tokens": b"\x00" * 4 * (MAX_TOKENS + 1)}, use_bin_type=True)
        status, body = call(sock, ["/v1/lookup", AUTH, None, too_many])
        assert status == 413, body
        status, body = call(sock, ["/v1/release", AUTH, None, msgpack.packb({"lease_id": -1})])
        assert status in (400, 404), body
        for fields, refused in (({"lease_id": "1"}, 400), ({"lease_id": 1, "wait_s": -1.0}, 400),
                                ({"lease_id": 2**64 - 1, "wait_s": 0.5}, 404)):  # fmt: skip
            status, body = call(sock, ["/v1/leases", AUTH, None, msgpack.packb(fields)])
            assert status == refused, (fields, body)  # the lease's state, as GET answers it
        status, body = call(sock, ["/v1/lookup", AUTH, None, good_body])
        assert status == 200  # the connection went on through every refusal
        sock.sendall(struct.pack("<I", (1 << 32) - 1))  # a frame past the limit: cut off
        assert closed_by_server(sock)
    finally:
        sock.close()
    slow = opened(name)
    try:
        slow.sendall(struct.pack("<I", 100) + b"\x00" * 10)  # 10 of 100 bytes, then nothing
        started = time.monotonic()
        assert closed_by_server(slow)
        assert time.monotonic() - started < TIMEOUT_S + 5
    finally:
        slow.close()
    check_store(server)
    with Client(server.url, api_key=KEY) as client:
        assert client.lookup(tokens_of(1, 8)).num_tokens == 0
        assert client._lane is not None and client._lane.calls == 1


PARTS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
    st.binary(max_size=64), st.sampled_from(sorted(frames.PATHS)), st.just(AUTH),
)  # fmt: skip
FIELDS = ("tokens", "lease_id", "reservation_id", "ttl_s", "wait_s", "release")
FRAMES = st.one_of(
    st.binary(max_size=256),  # any bytes
    st.lists(PARTS, max_size=6).map(lambda parts: msgpack.packb(parts, use_bin_type=True)),
    st.tuples(  # the right shape around a hostile body
        st.sampled_from(sorted(frames.PATHS)),
        st.one_of(st.none(), st.just(AUTH), st.text(max_size=40)),
        st.one_of(st.none(), st.text(max_size=12)),
        st.one_of(
            st.binary(max_size=256),
            st.dictionaries(st.sampled_from(FIELDS), PARTS, max_size=4).map(
                lambda body: msgpack.packb(body, use_bin_type=True)
            ),
        ),
    ).map(lambda request: msgpack.packb(list(request), use_bin_type=True)),
)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads=st.lists(FRAMES, min_size=1, max_size=4))
def test_any_frame_is_answered_with_a_status_and_never_a_500(
    server: Server, payloads: list[bytes]
) -> None:
    sock = opened(lane_of(server))
    try:
        for payload in payloads:
            send(sock, payload)
            status, body = read_frame(sock)
            assert isinstance(status, int) and 200 <= status < 500, (status, body)
            reply = msgpack.unpackb(body, raw=False)
            assert status == 200 or set(reply) == {"error", "detail"}, reply
    finally:
        sock.close()
    check_store(server)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_another_user_is_closed_before_a_byte(server: Server) -> None:
    name = lane_of(server)
    pid = os.fork()
    if pid == 0:  # the child: another user, who may not use the lane
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = connect(name)
            code = 0 if closed_by_server(sock) else 1
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    sock = opened(name)  # the server's own user still gets the hello
    sock.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_lane_served_by_another_user_is_not_taken() -> None:
    name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user, listening under a lane name with a good hello
        try:
            os.setgid(65534)
            os.setuid(65534)
            impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            impostor.bind("\0" + name)
            impostor.listen(1)
            os.write(ready_w, b"1")
            impostor.settimeout(10)
            conn, _ = impostor.accept()
            conn.sendall(struct.pack("<I", len(hello := msgpack.packb(frames.HELLO))) + hello)
            conn.recv(1)
        finally:
            os._exit(0)
    assert os.read(ready_r, 1) == b"1"
    lane = LaneConnections.of(name, 5.0, 1 << 20)
    assert lane is not None
    assert lane.request("/v1/lookup", b"", {}) is None and lane.dead  # nothing sent to it
    os.waitpid(pid, 0)


def out_of_reach(lane: LaneConnections) -> bool:
    return lane.dead


def test_a_lane_name_from_the_server_is_checked_and_one_out_of_reach_leaves_http(
    server: Server,
) -> None:
    assert LaneConnections.of(None, 1.0, 1 << 20) is None
    for bad in ("../../x", "kvtier-lane-0-deadbeef", "kvtier-lane-1-DEADBEEF", 7, b"x"):
        with pytest.raises(ReplyError, match="lane"):
            LaneConnections.of(bad, 1.0, 1 << 20)
    gone = LaneConnections.of("kvtier-lane-1-00000000", 1.0, 1 << 20)
    assert gone is not None
    assert gone.request("/v1/lookup", b"", {}) is None and out_of_reach(gone)
    assert gone.retry_at > time.monotonic() + 20  # HTTP for the next half minute
    gone.retry_at = 0.0  # the half minute passed: it tries once more, and fails again
    assert not out_of_reach(gone)
    assert gone.request("/v1/lookup", b"", {}) is None and out_of_reach(gone)
    with Client(server.url, api_key=KEY) as client:
        client._lane = gone  # a lane that cannot be reached: nothing sent, HTTP instead
        assert client.lookup(tokens_of(5000, 8)).num_tokens == 0
        assert gone.calls == 0


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_stopping_server_ends_its_lane_connections(tmp_path: Path) -> None:
    live = start(write_config(tmp_path))
    try:
        sock = opened(lane_of(live))
        started = time.monotonic()
        assert live.stop() == 0
        assert time.monotonic() - started < 20
        assert closed_by_server(sock)
        sock.close()
    finally:
        if live.process.poll() is None:
            live.process.kill()
            live.process.wait()


def test_the_async_client_takes_the_lane_too_and_leaves_it_when_out_of_reach(
    server: Server,
) -> None:
    tokens, kv = tokens_of(3000, 32), kv_of(32, seed=2)

    async def run() -> None:
        async with AsyncClient(server.url, api_key=KEY) as near:
            stored = await near.store(tokens, kv)  # its first call maps the pools
            lane = near._lane
            assert lane is not None and not lane.dead
            assert stored.stored_tokens == 32 and lane.calls == 2  # reserve, commit
            assert (await near.lookup(tokens)).num_tokens == 32
            loaded = await near.load(tokens)
            assert torch.equal(loaded.kv.view(torch.int16), kv.view(torch.int16))
            assert lane.calls >= 4
            with pytest.raises(LeaseError):
                await near.release(10**9)
            gone = AsyncLaneConnections.of("kvtier-lane-1-00000000", 1.0, 1 << 20)
            assert gone is not None
            near._lane = gone  # out of reach: nothing sent, HTTP instead
            assert (await near.lookup(tokens)).num_tokens == 32
            assert gone.dead and gone.calls == 0
            await lane.aclose()

    asyncio.run(run())
    check_store(server)
