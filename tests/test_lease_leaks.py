"""A lease or reservation whose reply is lost outlives it by one more call or `close()` at most
(`kvtier/service/grants.py`, `kvtier/client/owing.py`), against a real `kvtier serve`.

The reply is lost for real: the clients reach the server through `Relay`, a TCP relay in this
process that passes bytes both ways and, when told, cuts the client's connection as the
server's reply arrives (the server did the work and answered; the client never reads it), or
holds the reply until the test lets it through. What the server holds is read from its own
`/v1/status` (`index.leases`; a reservation's slots: the gpu tier's neither free nor
holding a block).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import msgpack  # type: ignore[import-untyped]
import pytest
from lane_peer import lane_of, opened, read_frame, send
from service_server import Server, kv_of, running, tokens_of, write_config

from kvtier.client import AsyncClient, Client
from kvtier.client.connections import TransportError
from kvtier.errors import ClosedError, KVTierError
from kvtier.service import wire
from kvtier.service.grants import MAX_PER_TENANT, Grants

TTL_S = 600.0  # far past any test: a lease still held at the end was not given back


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("leaks"),
        tenants={n: {} for n in ("default", "alice", "bob", "lost")},
    )
    with running(config) as live:
        yield live


class Relay:
    """A TCP relay to `port`. `mode`: "pass"; "drop" (the next reply from the server closes
    the client's connection instead, once); "hold" (the next reply waits for `let_through`).
    `replied` is set when a dropped or held reply arrived from the server."""

    def __init__(self, port: int) -> None:
        self.port, self.mode = port, "pass"
        self.replied, self.let_through = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            self.sockets += [client, upstream]
            threading.Thread(target=self._copy, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._reply, args=(upstream, client), daemon=True).start()

    def _copy(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _reply(self, upstream: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                mode, self.mode = self.mode, "pass"
                if mode != "pass":
                    self.replied.set()
                if mode == "drop":
                    client.close()
                    upstream.close()
                    return
                if mode == "hold":
                    self.let_through.wait(30)
                client.sendall(data)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.let_through.set()
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture
def relay(server: Server) -> Iterator[Relay]:
    port = int(server.url.rsplit(":", 1)[1])
    live = Relay(port)
    yield live
    live.close()


def live_leases(server: Server) -> int:
    return int(server.get("/v1/status").json()["index"]["leases"])


def reserved_blocks(server: Server) -> int:
    """The gpu slots held neither free nor by a cached block: a reservation's."""
    gpu = server.get("/v1/status").json()["tiers"]["gpu"]
    return int(gpu["slots"] - gpu["free_slots"] - gpu["blocks"])


def settles(read: object, expected: int, within_s: float = 5.0) -> int:
    """`read()` once it equals `expected`, or its last value after `within_s`."""
    assert callable(read)
    deadline = time.monotonic() + within_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return int(value)


def post(server: Server, path: str, body: Mapping[str, object], tenant: str) -> httpx.Response:
    return server.post(
        path,
        content=json.dumps(body),
        headers={"content-type": wire.JSON, "x-kvtier-tenant": tenant},
    )


def cached(server: Server, seed: int, tenant: str = "default") -> list[int]:
    """Tokens of 4 blocks stored for `tenant` (so that a prefetch of them leases blocks)."""
    tokens = tokens_of(1000 * seed, 16)
    with Client(server.url, tenant=tenant, shared_memory=False) as client:
        client.store(tokens, kv_of(16, seed))
    return tokens


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_prefetch_whose_reply_is_lost_holds_no_lease_after_the_next_call(
    server: Server, relay: Relay
) -> None:
    tokens, base = cached(server, 1), live_leases(server)
    with Client(relay.url, shared_memory=False, timeout_s=10) as client:
        relay.mode = "drop"
        with pytest.raises(TransportError):
            client.prefetch(tokens, ttl_s=TTL_S)
        assert relay.replied.is_set()  # the server granted it and answered
        client.release(client.prefetch(tokens_of(99_000, 4), ttl_s=TTL_S))  # the next call
        assert settles(lambda: live_leases(server), base) == base


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_reserve_whose_reply_is_lost_holds_no_slots_after_close(
    server: Server, relay: Relay
) -> None:
    base = reserved_blocks(server)
    client = Client(relay.url, shared_memory=False, timeout_s=10)
    relay.mode = "drop"
    with pytest.raises(TransportError):
        client.reserve(tokens_of(2000, 16), ttl_s=TTL_S)
    assert relay.replied.is_set()
    client.close()
    assert settles(lambda: reserved_blocks(server), base) == base


def test_a_cancelled_async_prefetch_holds_no_lease_after_aclose(
    server: Server, relay: Relay
) -> None:
    tokens, base = cached(server, 3), live_leases(server)

    async def scenario() -> None:
        client = AsyncClient(relay.url, shared_memory=False, timeout_s=10)
        relay.mode = "hold"
        task = asyncio.ensure_future(client.prefetch(tokens, ttl_s=TTL_S))
        assert await asyncio.to_thread(relay.replied.wait, 10)  # granted, reply on its way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        relay.let_through.set()
        await client.aclose()

    asyncio.run(scenario())
    assert settles(lambda: live_leases(server), base) == base


def test_a_cancelled_async_reserve_is_given_back_by_the_next_call(
    server: Server, relay: Relay
) -> None:
    base = reserved_blocks(server)

    async def scenario() -> None:
        async with AsyncClient(relay.url, shared_memory=False, timeout_s=10) as client:
            relay.mode = "hold"
            task = asyncio.ensure_future(client.reserve(tokens_of(4000, 16), ttl_s=TTL_S))
            assert await asyncio.to_thread(relay.replied.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            relay.let_through.set()
            await client.abort(await client.reserve(tokens_of(4100, 4)))  # the next call
            assert await asyncio.to_thread(settles, lambda: reserved_blocks(server), base) == base

    asyncio.run(scenario())


def test_a_reply_that_comes_after_close_is_given_back_by_its_call(
    server: Server, relay: Relay
) -> None:
    tokens, base = cached(server, 5), live_leases(server)
    client = Client(relay.url, shared_memory=False, timeout_s=10)
    relay.mode = "hold"
    raised: list[BaseException] = []

    def call() -> None:
        try:
            client.prefetch(tokens, ttl_s=TTL_S)
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert relay.replied.wait(10)  # the lease is granted; its reply is held
    client.close(timeout_s=0.2)  # gives up waiting for the call under way
    relay.let_through.set()
    caller.join(10)
    assert [type(e) for e in raised] == [ClosedError]
    assert settles(lambda: live_leases(server), base) == base


def test_another_tenants_token_gives_back_nothing(server: Server) -> None:
    tokens, token = cached(server, 6, "alice"), "0123456789abcdef"
    granted = post(server, "/v1/prefetch", {"tokens": tokens, "request": token}, "alice")
    assert granted.status_code == 200, granted.text
    lease_id = granted.json()["lease_id"]
    reserved = post(
        server, "/v1/reserve", {"tokens": tokens_of(6100, 8), "request": token}, "alice"
    )
    assert reserved.status_code == 200, reserved.text
    rid = reserved.json()["reservation_id"]

    assert post(server, "/v1/release", {"request": token}, "bob").status_code == 200
    assert post(server, "/v1/abort", {"request": token}, "bob").status_code == 200
    held = server.get(f"/v1/leases/{lease_id}", headers={"x-kvtier-tenant": "alice"})
    assert held.status_code == 200 and held.json()["state"] == "ready"
    kept = post(server, "/v1/commit", {"reservation_id": rid}, "alice")  # still alice's to end
    assert kept.status_code in (200, 409), kept.text  # 409: unwritten slots, but it was live

    assert post(server, "/v1/release", {"request": token}, "alice").status_code == 200
    gone = server.get(f"/v1/leases/{lease_id}", headers={"x-kvtier-tenant": "alice"})
    assert gone.status_code == 404
    # once more (given back already) and a token never granted: done, nothing to do
    assert post(server, "/v1/release", {"request": token}, "alice").json() == {}
    assert post(server, "/v1/abort", {"request": "fedcba9876543210"}, "alice").json() == {}
    assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}  # grants too


def test_a_token_given_back_before_its_request_arrives_grants_nothing(server: Server) -> None:
    tokens, token, base = cached(server, 7, "lost"), "00000000000000aa", live_leases(server)
    assert post(server, "/v1/release", {"request": token}, "lost").json() == {}
    late = post(server, "/v1/prefetch", {"tokens": tokens, "request": token}, "lost")
    assert late.status_code == 404 and late.json()["error"] == "unknown_lease"
    assert live_leases(server) == base


@pytest.mark.parametrize(
    "bad", ["0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", "0123456789abcdeg", 7, []]
)
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/prefetch", {"tokens": [1, 2, 3, 4]}),
        ("/v1/reserve", {"tokens": [1, 2, 3, 4]}),
        ("/v1/release", {}),
        ("/v1/abort", {}),
    ],
)
def test_a_malformed_token_is_a_400_naming_the_field(
    server: Server, path: str, body: dict[str, object], bad: object
) -> None:
    leases, reserved = live_leases(server), reserved_blocks(server)
    refused = post(server, path, {**body, "request": bad}, "default")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == "invalid_argument"
    assert "request" in refused.json()["detail"]
    assert "16 lowercase hex" in refused.json()["detail"]
    assert (live_leases(server), reserved_blocks(server)) == (leases, reserved)


def test_an_id_and_a_token_together_are_refused(server: Server) -> None:
    both = {"lease_id": 1, "request": "0123456789abcdef"}
    refused = post(server, "/v1/release", both, "default")
    assert refused.status_code == 400 and "request" in refused.json()["detail"]


def test_the_grant_table_is_bounded_per_tenant_and_kind() -> None:
    grants = Grants()
    ab = ("a", "b")  # the configured tenants
    tokens = [f"{i:016x}" for i in range(MAX_PER_TENANT + 10)]
    for i, token in enumerate(tokens):
        assert grants.grant("lease", "a", token, i, ab)
    grants.grant("reservation", "a", tokens[0], 7, ab)
    grants.check()
    assert grants.size("lease", "a") == MAX_PER_TENANT
    assert grants.withdraw("lease", "a", tokens[0], ab) is None  # the oldest: dropped
    assert grants.withdraw("lease", "a", tokens[-1], ab) == len(tokens) - 1
    assert grants.withdraw("lease", "b", tokens[-2], ab) is None  # another tenant's: not found
    assert grants.withdraw("lease", "a", tokens[-2], ab) == len(tokens) - 2
    assert grants.withdraw("reservation", "a", tokens[0], ab) == 7
    # a withdrawn token is remembered (bounded too): its late request is granted nothing
    assert not grants.grant("lease", "b", tokens[-2], 1, ab)
    grants.check()
    assert grants.size("lease", "a") <= MAX_PER_TENANT


def test_check_finds_a_broken_table() -> None:
    grants = Grants(bound=2)
    for token in ("00000000000000a1", "00000000000000a2", "00000000000000a3"):
        grants.grant("lease", "t", token, 1, ("t",))
    grants.check()
    assert grants.size("lease", "t") == 2
    broken = Grants(bound=2)
    broken.grant("lease", "t", "not-a-token", 1, ("t",))
    with pytest.raises(KVTierError, match="malformed token"):
        broken.check()


def test_the_lane_gives_back_by_token_and_refuses_a_malformed_one(server: Server) -> None:
    tokens, token, base = cached(server, 8), "00000000000000bb", live_leases(server)

    def call(sock: socket.socket, path: str, body: dict[str, object]) -> tuple[int, dict[str, Any]]:
        send(sock, msgpack.packb([path, None, None, msgpack.packb(body)], use_bin_type=True))
        status, reply = read_frame(sock)
        return status, msgpack.unpackb(reply, raw=False)

    with contextlib.closing(opened(lane_of(server, ""))) as sock:
        status, reply = call(sock, "/v1/prefetch", {"tokens": tokens, "request": "BAD"})
        assert status == 400 and "request" in reply["detail"]
        assert live_leases(server) == base
        status, reply = call(sock, "/v1/prefetch", {"tokens": tokens, "request": token})
        assert status == 200 and live_leases(server) == base + 1
        assert call(sock, "/v1/release", {"request": token}) == (200, {})
        assert live_leases(server) == base


def test_give_backs_cut_off_by_a_cancelled_task_are_sent_by_aclose(
    server: Server, relay: Relay
) -> None:
    """The tokens a call takes to give back (`take_requests`) before its own request, when the
    task is cancelled while they go out: the one in flight and those after it are owed again,
    and `aclose()` gives them back (before, they were dropped: their leases and reservations
    held to their ttl)."""
    base_leases, base_reserved = live_leases(server), reserved_blocks(server)
    granted = []
    for seed, (kind, path, body) in enumerate(
        [
            ("lease", "/v1/prefetch", {"tokens": cached(server, 11)}),
            ("lease", "/v1/prefetch", {"tokens": cached(server, 12)}),
            ("reservation", "/v1/reserve", {"tokens": tokens_of(12_100, 8)}),
        ]
    ):
        token = f"{0xABC0 + seed:016x}"  # the reply of each is lost: the client owes its token
        reply = post(server, path, {**body, "request": token, "ttl_s": TTL_S}, "default")
        assert reply.status_code == 200, reply.text
        granted.append((kind, token))
    assert live_leases(server) == base_leases + 2 and reserved_blocks(server) > base_reserved

    async def scenario() -> None:
        client = AsyncClient(relay.url, shared_memory=False, timeout_s=10)
        owing = client._owing  # what `_post_carrying` does first, cut off as a task can be
        for kind, token in granted:
            owing.owed.add_request(kind, token, "default")
        relay.mode = "hold"
        sending = asyncio.ensure_future(owing.send_requests(owing.owed.take_requests()))
        assert await asyncio.to_thread(relay.replied.wait, 10)  # the first one went out
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        relay.let_through.set()
        await client.aclose()

    asyncio.run(scenario())
    assert settles(lambda: live_leases(server), base_leases) == base_leases
    assert settles(lambda: reserved_blocks(server), base_reserved) == base_reserved
