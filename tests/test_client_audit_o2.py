"""A mapped store slower than its reservation still stores; a load never writes a mapped pool.

An audit's findings, on a real `kvtier serve`:

- A mapped `store` is reserve, the client's write into the reserved slots, commit. The
  reservation's ttl is `policy.lease_ttl_s` by default, so a write that outlasts it (here the
  client's copy into the pool is slowed past the ttl) made the commit a `LeaseError` and the
  store stored nothing. Now the client sends the KV again through the body, as it does when the
  reserve is refused: the store returns the tokens stored, and a load returns the bytes. Both
  clients.
- A load with `out=` a view of a pool mapped here (`pool_buffer`) would copy the prompt's
  blocks into the server's slots, over other prompts' cached blocks. Now `out` is checked
  apart from the mapped pools (`InvalidArgumentError` naming `out`), and the pool is left as
  it was. Both clients.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from service_server import Server, kv_of, start, tokens_of, write_config

from kvtier.client import AsyncClient, Client, pools
from kvtier.errors import InvalidArgumentError

TTL_S = 0.2
N = 16


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = write_config(tmp_path, gpu_blocks=16, host_blocks=64)
    data = yaml.safe_load(config.read_text())
    data["policy"]["lease_ttl_s"] = TTL_S  # the reservations' default ttl too
    config.write_text(yaml.safe_dump(data))
    running = start(config)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.process.kill()
        running.process.wait()


def slow_writes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The client's copy into a mapped pool (a store's write), made to outlast the ttl; copies
    out of a pool (a load's) run as they are."""
    real: Callable[..., Any] = getattr(pools, "copy_blocks_slices")  # noqa: B009 (not exported)
    seen = {"writes": 0}

    def slow(src: torch.Tensor, dst: torch.Tensor, src_slots: Any, dst_slots: Any) -> Any:
        if isinstance(src_slots, range):  # the caller's blocks 0.. into the reserved slots
            seen["writes"] += 1
            time.sleep(TTL_S * 1.5)
        return real(src, dst, src_slots, dst_slots)

    monkeypatch.setattr(pools, "copy_blocks_slices", slow)
    return seen


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_mapped_store_that_outlasts_its_reservation_is_stored(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, kv = tokens_of(1000, N), kv_of(N, seed=1)
    with Client(server.url) as client:
        assert client.pool_buffer("gpu") is not None  # the mapped path is taken
        seen = slow_writes(monkeypatch)
        result = client.store(tokens, kv)
        monkeypatch.undo()
        assert seen["writes"] == 1  # it went through the pool first, past the ttl
        assert result.stored_tokens == N
        loaded = client.load(tokens)
    assert loaded.num_tokens == N and same(loaded.kv, kv)


def test_an_async_mapped_store_that_outlasts_its_reservation_is_stored(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, kv = tokens_of(2000, N), kv_of(N, seed=2)

    async def scenario() -> tuple[int, int, int, torch.Tensor]:
        async with AsyncClient(server.url) as client:
            await client.lookup(tokens)  # the pools mapped
            assert client.pool_buffer("gpu") is not None
            seen = slow_writes(monkeypatch)
            result = await client.store(tokens, kv)
            monkeypatch.undo()
            loaded = await client.load(tokens)
        return seen["writes"], result.stored_tokens, loaded.num_tokens, loaded.kv

    writes, stored, num_tokens, got = asyncio.run(scenario())
    assert writes == 1 and stored == N
    assert num_tokens == N and same(got, kv)


def test_a_load_into_a_view_of_the_mapped_pool_is_refused(server: Server) -> None:
    tokens, kv = tokens_of(3000, N), kv_of(N, seed=3)
    with Client(server.url) as client:
        client.store(tokens, kv)
        gpu = client.pool_buffer("gpu")
        assert gpu is not None
        before = gpu.clone()
        blocks = N // client.layout().block_tokens
        with pytest.raises(InvalidArgumentError, match="out"):
            client.load(tokens, out=gpu[-blocks:], layout="blocks")
        assert same(gpu, before), "the load wrote the server's pool slots"


def test_an_async_load_into_a_view_of_the_mapped_pool_is_refused(server: Server) -> None:
    tokens, kv = tokens_of(4000, N), kv_of(N, seed=4)

    async def scenario() -> None:
        async with AsyncClient(server.url) as client:
            await client.store(tokens, kv)
            gpu = client.pool_buffer("gpu")
            assert gpu is not None
            before = gpu.clone()
            blocks = N // (await client.layout()).block_tokens
            with pytest.raises(InvalidArgumentError, match="out"):
                await client.load(tokens, out=gpu[-blocks:], layout="blocks")
            assert same(gpu, before), "the load wrote the server's pool slots"

    asyncio.run(scenario())
