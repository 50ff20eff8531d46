"""`store(tokens, kv, start=...)`: a writer that holds only a tail of the KV (a keyed engine's
later pages, issue 15) stores it below a cached prefix, in process and through a real sidecar
with both clients (shared memory and body); without that prefix nothing is stored, and a
`start` that is not a block boundary in range is refused naming it, storing nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import httpx
import msgpack  # type: ignore[import-untyped]
import pytest
from conftest import kv_for, same
from service_server import Server, kv_of, running, tokens_of, write_config

from kvtier.blocks import encode_tokens
from kvtier.client import AsyncClient, Client
from kvtier.errors import InvalidArgumentError
from kvtier.results import StoreResult
from kvtier.service import wire
from kvtier.store import KVStore


def test_a_tail_is_stored_below_a_cached_prefix_and_never_without_it(
    make_store: Callable[..., KVStore],
) -> None:
    store = make_store(gpu_blocks=16, host_blocks=32)
    tokens = list(range(100, 124))  # 6 blocks of 4
    kv = kv_for(store, 24, seed=1)
    assert store.store(tokens[8:], kv[:, :, 8:], start=0) == StoreResult(16, 16, 0)  # elsewhere
    assert store.store(tokens, kv[:, :, 8:], start=8) == StoreResult(0, 0, 0)  # no prefix
    assert store.lookup(tokens).num_tokens == 0
    assert store.store(tokens[:8], kv[:, :, :8]) == StoreResult(8, 8, 0)
    assert store.store(tokens, kv[:, :, 8:], start=8) == StoreResult(24, 16, 0)
    assert same(store.load(tokens).kv, kv)
    assert store.store(tokens, kv[:, :, 12:], start=12) == StoreResult(24, 0, 0)  # all there
    store.check()
    for start in (2, -4, 28, True, 4.0):
        with pytest.raises(InvalidArgumentError, match="start"):
            store.store(tokens, kv[:, :, 8:], start=start)  # type: ignore[arg-type]
    store.check()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("tail"))) as live:
        yield live


def test_both_clients_store_a_tail_through_the_sidecar_bit_exact(server: Server) -> None:
    for shared_memory, base in ((True, 5000), (False, 6000)):
        tokens, kv = tokens_of(base, 24), kv_of(24, seed=base)
        with Client(server.url, shared_memory=shared_memory) as client:
            assert client.store(tokens, kv[:, :, 8:], start=8).stored_tokens == 0  # no prefix
            assert client.store(tokens[:8], kv[:, :, :8]).stored_tokens == 8
            assert client.store(tokens, kv[:, :, 8:], start=8) == StoreResult(24, 16, 0)
            assert same(client.load(tokens).kv, kv)
            with pytest.raises(InvalidArgumentError, match="start"):
                client.store(tokens, kv[:, :, 6:], start=6)
    tokens, kv = tokens_of(7000, 24), kv_of(24, seed=7)

    async def scenario() -> None:
        async with AsyncClient(server.url) as client:
            assert (await client.store(tokens[:16], kv[:, :, :16])).stored_tokens == 16
            assert (await client.store(tokens, kv[:, :, 16:], start=16)).stored_tokens == 8
            assert same((await client.load(tokens)).kv, kv)

    asyncio.run(scenario())


def test_a_hostile_start_on_the_wire_is_a_400_naming_it(server: Server) -> None:
    tokens, kv = tokens_of(8000, 8), kv_of(8, seed=8)
    for start in ("4", -4, 3, 12, 2**64 - 1, None):
        body = {"tokens": encode_tokens(tokens), **wire.kv_to_wire(kv[:, :, 4:]), "start": start}
        reply = httpx.post(
            f"{server.url}/v1/store",
            content=msgpack.packb(body),
            headers={"content-type": wire.MSGPACK, "accept": "application/json"},
        )
        assert reply.status_code == 400, (start, reply.text)
        assert "start" in reply.text
    with Client(server.url) as client:
        assert client.lookup(tokens).num_tokens == 0  # nothing stored by any of them
