"""A client's store of KV that is a view of a pool it maps (`pool_buffer("gpu")[a:b]`, the
pages of a lease, stored under another prompt): the server's reserve may free those very slots
(evicting their blocks for room), plant its canaries in them and hand them back for the new
blocks, which were then copied from themselves: a block came back with another block's bytes
(audit AV, against a real `kvtier serve`). The client now copies such a `kv` before it reserves
(`MappedPools.check_kv`); the in-process store does the same (`test_store_audit_AV.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from service_server import BT, Server, kv_of, running, tokens_of, write_config

from kvtier.client import AsyncClient, Client


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("views")
    with running(write_config(directory, gpu_blocks=4, host_blocks=4)) as started:
        yield started


def _fill(client: Client, base: int) -> None:
    """Four new one-block prompts in the server's four gpu slots, three of them used since."""
    for i in range(4):
        client.store(tokens_of(base + 1000 * i, BT), kv_of(BT, seed=base + i))
    for i in range(1, 4):
        client.lookup(tokens_of(base + 1000 * i, BT))


@pytest.mark.parametrize("slots", [(1, 3), (0, 2), (2, 4), (0, 4)])
def test_a_store_from_a_view_of_the_mapped_pool_stores_what_the_view_held(
    server: Server, slots: tuple[int, int]
) -> None:
    base = 100_000 * (1 + slots[0] + 4 * slots[1])
    tokens = tokens_of(base + 50_000, (slots[1] - slots[0]) * BT)
    with Client(server.url) as client:
        _fill(client, base)
        gpu = client.pool_buffer("gpu")
        assert gpu is not None
        view = gpu[slots[0] : slots[1]]
        held = view.clone()
        client.store(tokens, view, layout="blocks")
        got = client.load(tokens, layout="blocks")
        assert got.num_tokens == len(tokens)
        assert torch.equal(got.kv, held)  # was: a block with another block's bytes


def test_an_async_store_from_a_view_of_the_mapped_pool_stores_what_the_view_held(
    server: Server,
) -> None:
    with Client(server.url) as client:
        _fill(client, 3_000_000)
    tokens = tokens_of(3_060_000, 2 * BT)

    async def main() -> tuple[torch.Tensor, torch.Tensor]:
        async with AsyncClient(server.url) as client:
            await client.lookup(tokens)  # maps the pools
            gpu = client.pool_buffer("gpu")
            assert gpu is not None
            view = gpu[1:3]
            held = view.clone()
            await client.store(tokens, view, layout="blocks")
            got = await client.load(tokens, layout="blocks")
            return got.kv, held

    got, held = asyncio.run(main())
    assert torch.equal(got, held)
