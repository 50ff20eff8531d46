"""The sidecar clients as an engine author uses them against a real `kvtier serve` (audit AR).

Pinned here:
- `pool_buffer(tier)` names the tier it was given or refuses it: a tier that is no tier's name
  (a typo such as "gpuu", a list, None) is an `InvalidArgumentError` naming `tier`, the same
  from `Client` and `AsyncClient` (before, a misspelt tier was None, which an engine reads as
  "not mapped here" and silently falls back to the body path, and an unhashable one was a raw
  `TypeError`); a real tier that is not mapped here ("disk", "remote", a closed client's) is
  still None, and "gpu" the mapped pool holding the bytes stored.
- A burst of concurrent calls does not push a client off its own lane: at most
  `lane_slots.MOST_CALLS` of a client's calls are on the lane at once (one more waits for a
  slot, or takes HTTP), so the
  server's 256 lane connections are never the client's to exhaust (before, 600 concurrent
  lookups of one `AsyncClient` opened 600 connections, the server closed some before their
  hello, and every call of that client took HTTP for the next 30 s, about 3x slower).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from service_server import ADMIN_KEY, BT, Server, kv_of, running, tokens_of, write_config

from kvtier.blocks import to_blocks
from kvtier.client import AsyncClient, Client
from kvtier.errors import InvalidArgumentError

MOST_CALLS = 64  # `kvtier.client.lane_slots.MOST_CALLS` (not imported: the test ran on code before)
NOT_TIERS: list[Any] = ["gpuu", "GPU", "", None, ["gpu"], 0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("ar"))) as started:
        yield started


@pytest.mark.parametrize("tier", NOT_TIERS, ids=repr)
def test_pool_buffer_of_no_tier_is_an_invalid_argument_in_both_clients(
    server: Server, tier: Any
) -> None:
    with Client(server.url) as client:
        assert client.pool_buffer("gpu") is not None  # mapped: the refusal is of the name
        with pytest.raises(InvalidArgumentError, match=r"^tier: got .*expected one of"):
            client.pool_buffer(tier)

    async def main() -> None:
        async with AsyncClient(server.url) as client:
            await client.lookup([1, 2, 3, 4])  # maps the pools
            with pytest.raises(InvalidArgumentError, match=r"^tier: got .*expected one of"):
                client.pool_buffer(tier)

    asyncio.run(main())


def test_pool_buffer_of_a_real_tier_is_the_pool_or_none_and_a_misspelt_one_refused(
    server: Server,
) -> None:
    tokens, kv = tokens_of(7000, 2 * BT), kv_of(2 * BT, seed=7)
    client = Client(server.url)
    try:
        client.store(tokens, kv)
        lease = client.prefetch(tokens)
        gpu = client.pool_buffer("gpu")
        assert gpu is not None and client.pool_buffer("host") is not None
        assert client.pool_buffer("disk") is None and client.pool_buffer("remote") is None
        pages = gpu[list(lease.block_table)]
        client.release(lease)
        assert torch.equal(pages, to_blocks(kv, BT))
    finally:
        client.close()
    assert client.pool_buffer("gpu") is None  # closed: nothing mapped, still no error
    with pytest.raises(InvalidArgumentError, match="'hots'"):
        client.pool_buffer("hots")  # closed or not, a misspelt tier is no "not mapped"


def _lane_metric(server: Server, name: str) -> float:
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def test_a_burst_of_async_calls_keeps_the_client_on_its_lane(server: Server) -> None:
    tokens = tokens_of(20000, 8 * BT)

    async def main() -> tuple[list[int], float, float]:
        async with AsyncClient(server.url) as client:
            await client.lookup(tokens)  # mapped, on the lane
            burst = await asyncio.gather(*(client.lookup(tokens) for _ in range(500)))
            open_after_burst = _lane_metric(server, "kvtier_lane_connections")
            before = _lane_metric(server, "kvtier_lane_requests_total")
            for _ in range(20):
                await client.lookup(tokens)
            return [hit.num_tokens for hit in burst], open_after_burst, before

    hits, open_after_burst, before = asyncio.run(main())
    assert hits == [0] * 500  # every call of the burst answered (lane or HTTP)
    assert open_after_burst <= MOST_CALLS
    assert _lane_metric(server, "kvtier_lane_requests_total") - before == 20  # still the lane
