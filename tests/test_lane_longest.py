"""A call longer than the local lane reads (`frames.longest`, named in `/v1/pools` as
`lane_max_frame_bytes`) goes over HTTP, which answers it: a typed 413 naming the tokens, not a
`TransportError` from a lane that could only end the connection (as both clients got before),
and the lane goes on carrying the small calls."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from service_server import Server, running, write_config

from kvtier.client import AsyncClient, Client, ServiceError
from kvtier.service import frames

MAX_TOKENS = 4096
LONGEST = 4 * MAX_TOKENS + (1 << 20)  # what the lane reads: the tokens, and 1 MiB of fields
TOO_MANY = LONGEST // 4 + 1  # past the lane's frame, tokens 4 bytes each


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("lane-longest"), service={"max_tokens": MAX_TOKENS}
    )
    with running(config) as live:
        yield live


def test_pools_name_the_longest_frame_the_lane_reads(server: Server) -> None:
    pools = server.get("/v1/pools").json()
    assert pools["lane"] and pools["lane_max_frame_bytes"] == LONGEST == frames.longest(MAX_TOKENS)


def test_a_call_past_the_lanes_frame_is_a_413_over_http_and_the_lane_goes_on(
    server: Server,
) -> None:
    with Client(server.url) as client:
        assert client.lookup([1, 2, 3, 4]).num_tokens == 0
        lane = client._lane
        assert lane is not None and lane.calls == 1
        with pytest.raises(ServiceError) as refused:
            client.lookup(list(range(TOO_MANY)))
        assert refused.value.status == 413 and "tokens" in str(refused.value)
        assert client.lookup([1, 2, 3, 4]).num_tokens == 0
        assert lane.calls == 2 and not lane.dead  # the big one over HTTP, the lane kept


def test_the_async_client_too(server: Server) -> None:
    async def run() -> None:
        async with AsyncClient(server.url) as client:
            assert (await client.lookup([1, 2, 3, 4])).num_tokens == 0
            with pytest.raises(ServiceError) as refused:
                await client.lookup(list(range(TOO_MANY)))
            assert refused.value.status == 413
            assert (await client.lookup([1, 2, 3, 4])).num_tokens == 0
            lane = client._lane
            assert lane is not None and lane.calls == 2 and not lane.dead

    asyncio.run(run())
