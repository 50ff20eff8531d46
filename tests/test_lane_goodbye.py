"""The local lane's goodbye (`kvtier/service/lane.py`, `kvtier/client/lane.py`) against a real
`kvtier serve`: a connection the server ends while no call is under way on it (for room at the
connection bound, silent past its first frame's bound, the server stopping) gets `GOODBYE` as
its last frame, and a request sent after it is not answered; so a client that reads it where
it expected a reply sends the call again, and peers churning connections at the bound cost an
honest client no `TransportError`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator

import lane_peer
import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import GOODBYE, GOODBYE_FRAME, closed_by_server, connect, opened, read_frame
from service_server import ADMIN_KEY, Server, running, start, write_config

from kvtier.client import AsyncClient, Client, TransportError
from kvtier.service import frames
from kvtier.service.lane import MAX_CONNECTIONS

KEY = "goodbye-tenant-key-0123456789"
AUTH = f"Bearer {KEY}"
TENANTS = {"default": {"api_keys": [KEY]}}
CHURN_S = 3.0  # how long peers churn connections at the bound while clients call
CALLERS = 8  # a client's threads (or tasks) calling at once
TOKENS = list(range(1, 9))
HOLDERS = MAX_CONNECTIONS - 4 * CALLERS  # connections answering a call throughout the churn
HELD_TOKENS = 20_000  # a lookup of 80 KiB: its head admitted, its body held in the budget


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose first-frame bound (5 s) outlasts opening all its lane connections."""
    config = write_config(
        tmp_path_factory.mktemp("lane-goodbye"),
        service={"body_timeout_s": 30.0, "max_body_bytes": 1 << 20, "max_inflight_bytes": 64 << 20},
        tenants=TENANTS,
    )
    with running(config) as live:
        yield live


def lookup_frame(count: int = 4) -> bytes:
    body = msgpack.packb({"tokens": bytes(4 * count)}, use_bin_type=True)
    payload: bytes = msgpack.packb(["/v1/lookup", AUTH, None, body], use_bin_type=True)
    return struct.pack("<I", len(payload)) + payload


def metric(server: Server, name: str) -> float:
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no series {name} in /metrics")


def quiet(server: Server) -> str:
    """The lane's name once none of its connections is open (the tests before closed theirs)."""
    deadline = time.monotonic() + 10
    while metric(server, "kvtier_lane_connections") > 0:
        assert time.monotonic() < deadline, "the lane's connections did not end"
        time.sleep(0.05)
    return lane_peer.lane_of(server, AUTH)


def readable(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    return bool(select.select([sock], [], [], timeout_s)[0])


def begun(name: str) -> socket.socket:
    """A connection whose frame has begun (its first byte sent, the rest never): idle since
    then for room, and bound by `body_timeout_s` (30 s) rather than the first frame's 5 s, so
    none ends by itself while the others are opened on a loaded machine."""
    sock = opened(name)
    sock.sendall(b"\x10")
    return sock


def make_room(name: str, idlest: socket.socket, opening: list[socket.socket]) -> None:
    """Wait for `idlest` to be ended for room, opening another connection (into `opening`) each
    second it is not: at the bound, it is the next to end (on a loaded machine, a silent one
    may have reached its first frame's bound and ended already, leaving room)."""
    for _ in range(8):
        if readable(idlest, 1.0):
            return
        opening.append(opened(name))
    raise AssertionError("the connection idle longest was not ended for room")


def test_connections_ended_for_room_say_goodbye_and_a_request_after_it_is_not_answered(
    server: Server,
) -> None:
    """At the bound, two newcomers end the two connections idle longest: one idle since its
    hello, one that had begun a frame (3 bytes of it). Each reads `GOODBYE` and then the end,
    the rest of its request sent after it (refused: the connection is shut), and the server
    answers neither request: its lane request count grows by the newcomer's call only."""
    name = quiet(server)
    frame = lookup_frame()
    idle = opened(name)
    begun = opened(name)
    begun.sendall(frame[:3])  # a frame's first byte is its connection's idle time
    time.sleep(0.05)
    silent = [opened(name) for _ in range(MAX_CONNECTIONS - 2)]  # the bound
    newcomers: list[socket.socket] = []
    try:
        before = metric(server, "kvtier_lane_requests_total")
        newcomers += [opened(name), opened(name)]  # each makes room
        for sock, rest in ((idle, frame), (begun, frame[3:])):
            make_room(name, sock, newcomers)  # ended, before the request is sent (or its rest)
            with contextlib.suppress(OSError):  # shut: EPIPE
                sock.sendall(rest)
            assert read_frame(sock) == GOODBYE
            assert closed_by_server(sock)
        newcomers[0].sendall(frame)
        status, body = read_frame(newcomers[0])
        assert status == 200 and msgpack.unpackb(body)["num_tokens"] == 0
        assert metric(server, "kvtier_lane_requests_total") == before + 1
    finally:
        for sock in [idle, begun, *silent, *newcomers]:
            sock.close()


def test_a_clients_pooled_connection_ended_for_room_has_goodbye_pending_and_is_replaced(
    server: Server,
) -> None:
    """A client's idle connection ended for room reads as closed before it is used (its
    `GOODBYE` pending); the client's next call opens another and stays on the lane."""
    name = quiet(server)
    with Client(server.url, api_key=KEY) as client:
        assert client.lookup(TOKENS).num_tokens == 0
        lane = client._lane
        assert lane is not None and len(lane._idle) == 1
        pooled = lane._idle[0]
        silent = [begun(name) for _ in range(MAX_CONNECTIONS - 1)]
        try:
            silent.append(begun(name))  # makes room: the client's, idle longest
            make_room(name, pooled, silent)
            assert pooled.recv(len(GOODBYE_FRAME), socket.MSG_PEEK) == GOODBYE_FRAME
            assert client.lookup(TOKENS).num_tokens == 0
            assert lane.calls == 2 and not lane.dead and pooled.fileno() == -1
        finally:
            for sock in silent:
                sock.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_connection_silent_past_its_first_frame_bound_says_goodbye(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A connection that sends no frame within min(body_timeout_s, 5 s) of its hello is ended
    with `GOODBYE`; so is an idle one when the server stops."""
    config = write_config(
        tmp_path_factory.mktemp("lane-goodbye-first"),
        service={"body_timeout_s": 0.5},
        tenants=TENANTS,
    )
    live = start(config)
    try:
        name = lane_peer.lane_of(live, AUTH)
        silent, used = opened(name), opened(name)
        used.sendall(lookup_frame())
        assert read_frame(used)[0] == 200
        assert readable(silent)
        assert read_frame(silent) == GOODBYE
        assert closed_by_server(silent)
        assert not select.select([used], [], [], 0)[0]  # idle after a call: kept
        assert live.stop() == 0
        assert readable(used)
        assert read_frame(used) == GOODBYE  # stopped while idle
        assert closed_by_server(used)
    finally:
        live.stop()


def on_lane(dead: bool, done: int) -> float:
    """The calls of `done` a churned client sends through the lane at least: nearly all (one
    is sent over HTTP only after goodbyes on two connections); where a connection could not be
    opened (`dead`: a connect refused with the listen backlog full, the churners' doing; the
    client then takes HTTP for 30 s, as its contract says) the ones before."""
    return 50 if dead else 0.9 * done


class Churn:
    """Peers opening silent lane connections at the bound in a loop, each making the server end
    the connection idle longest (theirs, or an honest client's). `HOLDERS` of the bound's
    connections answer a call throughout (a frame whose body is held, never sent whole): not
    ones to end, so the client's idle connections are among the few that are, and often the
    idlest."""

    def __init__(self, name: str, threads: int = 2) -> None:
        self.name, self.stopping = name, threading.Event()
        self.holders = [opened(name) for _ in range(HOLDERS)]
        self.held: collections.deque[socket.socket] = collections.deque()
        self.opened = 0
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def __enter__(self) -> Churn:
        frame = lookup_frame(HELD_TOKENS)
        for sock in self.holders:
            sock.sendall(frame[: frames.HEAD_BYTES + 1024])  # admitted, its body held
        while len(self.held) < MAX_CONNECTIONS - HOLDERS:
            self.held.append(opened(self.name))
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)
        while self.held:
            self.held.popleft().close()
        for sock in self.holders:
            sock.close()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                sock = connect(self.name, timeout_s=5)
            except OSError:  # the backlog full: again
                continue
            with contextlib.suppress(OSError, EOFError):
                read_frame(sock)  # its hello (or none: every connection answering)
            self.held.append(sock)
            self.opened += 1
            while len(self.held) > MAX_CONNECTIONS:
                with contextlib.suppress(IndexError):
                    self.held.popleft().close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_client_calling_while_peers_churn_connections_at_the_bound_gets_no_error(
    server: Server,
) -> None:
    """`CALLERS` threads of a `Client` look up for `CHURN_S` while peers open silent
    connections at the bound: no call fails, and the calls stay on the lane."""
    name = quiet(server)
    errors: list[BaseException] = []
    done = [0] * CALLERS
    with Client(server.url, api_key=KEY) as client:
        assert client.lookup(TOKENS).num_tokens == 0
        lane = client._lane
        assert lane is not None
        with Churn(name) as churn:
            until = time.monotonic() + CHURN_S

            def caller(i: int) -> None:
                rng = random.Random(i)
                while time.monotonic() < until:
                    try:
                        assert client.lookup(TOKENS).num_tokens == 0
                        done[i] += 1
                    except TransportError as exc:
                        errors.append(exc)
                    time.sleep(rng.random() * 0.002)  # the client's idle connections vary

            callers = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
            for thread in callers:
                thread.start()
            for thread in callers:
                thread.join(CHURN_S + 30)
        assert churn.opened > MAX_CONNECTIONS, churn.opened
        assert not errors, f"{len(errors)} of {sum(done) + len(errors)} calls failed: {errors[0]}"
        assert lane.calls >= on_lane(lane.dead, sum(done)), (lane.calls, sum(done), lane.dead)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_an_async_client_calling_while_peers_churn_connections_at_the_bound_gets_no_error(
    server: Server,
) -> None:
    """The same for `CALLERS` tasks of an `AsyncClient`."""
    name = quiet(server)
    errors: list[BaseException] = []
    done = [0] * CALLERS

    async def run() -> None:
        async with AsyncClient(server.url, api_key=KEY) as client:
            assert (await client.lookup(TOKENS)).num_tokens == 0
            lane = client._lane
            assert lane is not None
            until = time.monotonic() + CHURN_S

            async def caller(i: int) -> None:
                rng = random.Random(i)
                while time.monotonic() < until:
                    try:
                        assert (await client.lookup(TOKENS)).num_tokens == 0
                        done[i] += 1
                    except TransportError as exc:
                        errors.append(exc)
                    await asyncio.sleep(rng.random() * 0.002)

            with Churn(name) as churn:
                await asyncio.gather(*(caller(i) for i in range(CALLERS)))
            assert churn.opened > MAX_CONNECTIONS, churn.opened
            assert lane.calls >= on_lane(lane.dead, sum(done)), (lane.calls, sum(done), lane.dead)

    asyncio.run(run())
    assert not errors, f"{len(errors)} of {sum(done) + len(errors)} calls failed: {errors[0]}"
