"""Audit BJ: the sidecar's clients (`kvtier/client/`) against a hostile lane peer, and their
argument checks before anything is sent.

Pins, on real sockets (a raw lane peer on a thread of the test; a fake HTTP sidecar):
- a lane reply frame whose length names more than comes takes memory for what came, not for
  what it named: before, the blocking client's `read_frame` took the whole length (up to
  `max_reply_bytes`, 1 GiB by default) of zeroed memory at once, per call, for as long as the
  peer stalled (4 threads' lookups: 3 GiB resident); a frame that comes whole in many steps
  is still read byte for byte;
- a lane reply frame past 64 KiB (`flat.SMALL`: its body bytes decoded as a `memoryview`) is
  a reply: before, it was "not [status, body bytes]", and over the lane (the default on one
  host) a store or load of a prompt of 100,000 tokens (25,000 slots) failed with a `ReplyError`
  where HTTP answered it;
- a `ttl_s` that is no number of seconds (a `np.float32`, a tensor, a str, a bool, 0, nan, an
  int past a float's range) is an `InvalidArgumentError` naming it, from `prefetch` and
  `reserve` of both clients, with nothing sent and nothing owed: before, msgpack's raw
  `TypeError` / `OverflowError`, and the prefetch or reserve owed a give-back of a request
  never sent (a `/v1/release` or `/v1/abort` the flusher then sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
import torch
from fake_server import FakeServer, fake_servers
from service_server import BT, kv_of, running, tokens_of, write_config

from kvtier.client import AsyncClient, Client
from kvtier.client.connections import TransportError
from kvtier.client.lane import LaneConnections
from kvtier.errors import InvalidArgumentError
from kvtier.service import frames

TIMEOUT_S = 0.5


@contextlib.contextmanager
def lane_peer(reply: bytes, stall: bool) -> Iterator[str]:
    """A raw lane (abstract Unix socket) that says hello, reads one request frame and writes
    `reply`, then (`stall`) holds the connection open until the block ends; its name."""
    name = f"kvtier-lane-{os.getpid()}-{secrets.token_hex(4)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(4)
    done = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                conn.sendall(frames.frame(frames.HELLO))
                (length,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
                conn.recv(length, socket.MSG_WAITALL)
                for at in range(0, len(reply), 1 << 16):  # in many steps
                    conn.sendall(reply[at : at + (1 << 16)])
                if stall:
                    done.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield name
    finally:
        done.set()
        listener.close()
        thread.join(5)


def test_a_lane_frame_that_names_more_than_comes_takes_memory_for_what_came() -> None:
    named = 200 << 20  # within the client's limit: it is read, until `timeout_s`
    with lane_peer(struct.pack("<I", named) + b"\x92", stall=True) as name:
        lane = LaneConnections(name, TIMEOUT_S, 256 << 20)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            started = time.monotonic()
            with pytest.raises(TransportError, match=r"/v1/lookup \(lane\).*timeout_s"):
                lane.request("/v1/lookup", msgpack.packb({}), {})
            took = time.monotonic() - started
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert took < TIMEOUT_S + 2.0, took
    assert peak < 16 << 20, f"{peak} bytes taken for a frame that named {named} and sent 1"


def test_a_lane_frame_that_comes_whole_in_many_steps_is_read_byte_for_byte() -> None:
    content = bytes(np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8))
    with lane_peer(frames.frame([200, content]), stall=False) as name:
        lane = LaneConnections(name, 5.0, 8 << 20)
        reply = lane.request("/v1/lookup", msgpack.packb({}), {})
    assert reply is not None and reply.status == 200
    assert reply.content == content


BAD_TTLS = [np.float32(1.0), torch.tensor(1.0), "1", True, 0, -1.0, float("nan"), 10**400]
TTL_IDS = ["np.float32", "tensor", "str", "bool", "zero", "negative", "nan", "past-float"]


@pytest.fixture
def sidecar() -> Iterator[FakeServer]:
    """A fake sidecar that answers nothing but records every path asked."""
    with fake_servers() as fake:
        yield fake()


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=TTL_IDS)
def test_a_ttl_that_is_no_number_of_seconds_is_refused_before_anything_is_sent(
    sidecar: FakeServer, ttl: Any
) -> None:
    kv = Client(sidecar.url, shared_memory=False, timeout_s=2.0)
    try:
        for call in (kv.prefetch, kv.reserve):
            with pytest.raises(InvalidArgumentError, match="ttl_s: got"):
                call([1, 2, 3, 4], ttl_s=ttl)
        time.sleep(0.1)  # a give-back owed would be on its way by now (the flusher)
        assert kv._owed.take_requests() == []
    finally:
        kv.close()
    assert sidecar.paths == []


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=TTL_IDS)
def test_an_async_ttl_that_is_no_number_of_seconds_is_refused_before_anything_is_sent(
    sidecar: FakeServer, ttl: Any
) -> None:
    async def main() -> None:
        kv = AsyncClient(sidecar.url, shared_memory=False, timeout_s=2.0)
        try:
            for call in (kv.prefetch, kv.reserve):
                with pytest.raises(InvalidArgumentError, match="ttl_s: got"):
                    await call([1, 2, 3, 4], ttl_s=ttl)
            assert kv._owed.take_requests() == []
        finally:
            await kv.aclose()

    asyncio.run(main())
    assert sidecar.paths == []


def test_a_ttl_of_seconds_still_reaches_the_server_as_a_float(sidecar: FakeServer) -> None:
    """An int or a `np.float64` is a number of seconds, sent as a float (the server answers
    404 here: a `ServiceError`, after the request went)."""
    kv = Client(sidecar.url, shared_memory=False, timeout_s=2.0)
    try:
        for ttl in (3, np.float64(2.5)):
            with contextlib.suppress(Exception):
                kv.reserve([1, 2, 3, 4], ttl_s=ttl)
    finally:
        kv.close()
    assert sidecar.paths.count("/v1/reserve") == 2, sidecar.paths


LONG = 100_000
"""A prompt whose reservation and lease hold 25,000 slots (4-token blocks): a lane reply of
some 75 KiB, past `flat.SMALL`."""


def test_a_long_prompt_is_stored_and_loaded_over_the_lane_byte_for_byte(tmp_path: Path) -> None:
    blocks = LONG // BT + 8
    with running(write_config(tmp_path, gpu_blocks=blocks, host_blocks=blocks)) as server:
        kv = Client(server.url, timeout_s=60.0)
        try:
            assert kv._lane is not None and kv.pool_buffer("gpu") is not None
            tokens, cache = tokens_of(1, LONG), kv_of(LONG, 3)
            stored = kv.store(tokens, cache)
            assert stored.stored_tokens == LONG, stored
            loaded = kv.load(tokens)
            assert loaded.num_tokens == LONG
            assert torch.equal(loaded.kv.view(torch.int16), cache.view(torch.int16))
            assert kv._lane.calls >= 3  # reserve, commit, prefetch: none of them over HTTP

            async def main() -> None:
                client = AsyncClient(server.url, timeout_s=60.0)
                try:
                    lease = await client.prefetch(tokens)
                    assert lease.num_tokens == LONG, lease
                    assert len(lease.block_table) == LONG // BT
                    await client.release(lease)
                    reservation = await client.reserve(tokens_of(LONG + 1, LONG))
                    assert len(reservation.slots) == LONG // BT
                    await client.abort(reservation)
                    assert client._lane is not None and client._lane.calls >= 4
                finally:
                    await client.aclose()

            asyncio.run(main())
        finally:
            kv.close()
        status = server.get("/v1/status").json()["index"]
        assert (status["leases"], status["reservations"]) == (0, 0), status
