"""The second API audit's findings through the sidecar's clients (`Client`, `AsyncClient`),
against a real `kvtier serve`: each test fails on the code before its fix.

- A KV no copy can read ("meta", sparse) is an `InvalidKVError` naming its device, on the
  shared-memory path and the body path alike, with nothing reserved or leased after it (before:
  msgpack's or torch's untyped errors).
- `release(id)` of an id no request can carry (2**64 and past) is a `LeaseError`, as the store
  raises, and of what is no id an `InvalidArgumentError` (before: msgpack's `OverflowError`).
- Bool token ids are refused (`InvalidTokensError`), as a bool array is.
- A READY lease shows its layers as the embedded store's does (`layers_ready` = `num_layers`,
  not 0/0), with or without the pools mapped.
- `mapped_instance` names the server instance whose pools `pool_buffer` hands out, and
  changes when the client re-maps after a restart of the sidecar at its URL; `pool_buffer`
  taken again then reads the new server's pages.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from service_server import (
    ADMIN_KEY,
    BT,
    DIM,
    HEADS,
    LAYERS,
    kv_of,
    restartable,
    running,
    start,
    write_config,
)

from kvtier.client import AsyncClient, Client
from kvtier.errors import InvalidArgumentError, InvalidKVError, InvalidTokensError, LeaseError

pytestmark = pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite

SHAPE = (LAYERS, 2, 2 * BT, HEADS, DIM)


def _held(url: str) -> tuple[int, dict[str, int]]:
    """Live leases, and each memory tier's free slots, from the global status."""
    import httpx

    status = httpx.get(url + "/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    free = {name: tier["free_slots"] for name, tier in status["tiers"].items() if name != "disk"}
    return status["index"]["leases"], free


def _bad_kv() -> list[torch.Tensor]:
    return [
        torch.empty(SHAPE, dtype=torch.float16, device="meta"),
        torch.randn(SHAPE).to(torch.float16).to_sparse(),
    ]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["mapped", "body"])
def test_kv_no_copy_can_read_is_an_invalid_kv_error_through_both_clients(
    tmp_path: Path, shared_memory: bool
) -> None:
    tokens = list(range(100, 100 + 2 * BT))
    with running(write_config(tmp_path)) as server:
        before = _held(server.url)
        with Client(server.url, shared_memory=shared_memory) as client:
            assert (client.pool_buffer("gpu") is not None) == shared_memory
            for kv in _bad_kv():
                with pytest.raises(InvalidKVError, match=f"device '{kv.device.type}'|sparse"):
                    client.store(tokens, kv)

        async def run() -> None:
            async with AsyncClient(server.url, shared_memory=shared_memory) as client:
                for kv in _bad_kv():
                    with pytest.raises(InvalidKVError, match="expected a strided"):
                        await client.store(tokens, kv)

        asyncio.run(run())
        assert _held(server.url) == before
        server.admin("/v1/admin/check")
        with Client(server.url) as client:
            assert client.lookup(tokens).num_tokens == 0


def test_release_of_an_id_no_request_can_carry_is_typed_in_both_clients(tmp_path: Path) -> None:
    with running(write_config(tmp_path)) as server:
        with Client(server.url) as client:
            for lease_id in (2**64, 2**70, -1):
                with pytest.raises(LeaseError, match=f"lease {lease_id}: unknown"):
                    client.release(lease_id)
            for bad in ("x", 1.5, None, True):
                with pytest.raises(InvalidArgumentError, match="expected a Lease or an int id"):
                    client.release(bad)  # type: ignore[arg-type]
            with pytest.raises(LeaseError):
                client.release(12345)  # in range, unknown: the server says so

        async def run() -> None:
            async with AsyncClient(server.url) as client:
                with pytest.raises(LeaseError, match="unknown"):
                    await client.release(2**64)
                with pytest.raises(InvalidArgumentError):
                    await client.release("x")  # type: ignore[arg-type]

        asyncio.run(run())


def test_bool_token_ids_are_refused_by_both_clients(tmp_path: Path) -> None:
    bools: Any = [True, False, True, True]
    with running(write_config(tmp_path)) as server:
        with Client(server.url) as client:
            for call in (
                lambda: client.lookup(bools),
                lambda: client.prefetch(bools),
                lambda: client.store(bools, kv_of(4, seed=1)),
                lambda: client.load(bools),
            ):
                with pytest.raises(InvalidTokensError, match=r"tokens\[0\]: got True \(bool\)"):
                    call()

        async def run() -> None:
            async with AsyncClient(server.url) as client:
                with pytest.raises(InvalidTokensError, match="bool"):
                    await client.lookup(bools)
                with pytest.raises(InvalidTokensError, match="bool"):
                    await client.store(bools, kv_of(4, seed=1))

        asyncio.run(run())
        response = server.post("/v1/lookup", json={"tokens": bools})  # JSON's true: refused
        assert response.status_code == 400, response.text


@pytest.mark.parametrize("shared_memory", [True, False], ids=["mapped", "body"])
def test_a_ready_lease_shows_every_layer_as_the_stores_does(
    tmp_path: Path, shared_memory: bool
) -> None:
    tokens = list(range(300, 300 + 2 * BT))
    with running(write_config(tmp_path)) as server:
        with Client(server.url, shared_memory=shared_memory) as client:
            client.store(tokens, kv_of(len(tokens), seed=3))
            lease = client.prefetch(tokens)
            assert lease.ready()
            assert (lease.layers_ready, lease.num_layers) == (LAYERS, LAYERS)  # before: 0/0
            assert f"layers_ready={LAYERS}/{LAYERS}" in repr(lease)
            client.release(lease)

        async def run() -> None:
            async with AsyncClient(server.url, shared_memory=shared_memory) as client:
                lease = await client.prefetch(tokens)
                assert (lease.layers_ready, lease.num_layers) == (LAYERS, LAYERS)
                await client.release(lease)

        asyncio.run(run())


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_mapped_instance_changes_when_the_client_remaps_after_a_restart(tmp_path: Path) -> None:
    first, second = list(range(1, 1 + 4 * BT)), list(range(5001, 5001 + 4 * BT))
    with restartable(tmp_path) as (config, port, started):
        started.append(start(config, port=port))
        with Client(started[-1].url) as client:
            before, gpu = client.mapped_instance, client.pool_buffer("gpu")
            assert isinstance(before, str) and gpu is not None
            client.store(first, kv_of(len(first), seed=1))
            started[-1].stop()
            started.append(start(config, port=port))  # same URL: another server
            client.store(second, kv_of(len(second), seed=2))  # the client re-maps on its reply
            after = client.mapped_instance
            assert isinstance(after, str) and after != before
            lease = client.prefetch(second)
            fresh = client.pool_buffer("gpu")
            assert fresh is not None and fresh is not gpu  # take it again: the new pages
            pages = fresh[list(lease.block_table)]  # a gathered copy of the leased pages
            stored = kv_of(len(second), seed=2)
            for i in range(len(lease.block_table)):
                assert torch.equal(pages[i], stored[:, :, i * BT : (i + 1) * BT])
            client.release(lease)

        async def run(url: str) -> tuple[str | None, str | None, bool]:
            async with AsyncClient(url) as client:
                ahead = client.mapped_instance  # nothing mapped before the first call
                await client.lookup(first)
                return ahead, client.mapped_instance, client.pool_buffer("gpu") is not None

        ahead, mapped, has_pool = asyncio.run(run(started[-1].url))
        assert ahead is None and mapped == after and has_pool
