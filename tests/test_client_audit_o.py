"""A mapped load into the caller's `out` whose lease is not proven held leaves nothing in `out`.

An audit's schedule: a client's copy out of the mapped gpu pool outlived its lease (its slots
could be another tenant's by then), and the release that would have proven the lease held never
got its answer (the server was SIGKILLed, or the call cancelled). The load raised, but `out`
kept the copy (in the audit, one block of another tenant's prompt). Now a copy not proven held
is zeroed whatever ends its release (`Owing.settle`), as it was already for a `LeaseError`.

Here the server dies during the copy (a delay is put into the client's copy function, the one
place a test can stop it), so the copy is the tenant's own bytes, read after the lease's ttl:
the property is that none of it is left in `out`.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from service_server import Server, kv_of, start, tokens_of, write_config

from kvtier.client import AsyncClient, Client, TransportError, pools

TTL_S = 0.3
N = 16


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = write_config(tmp_path, gpu_blocks=16, host_blocks=64)
    data = yaml.safe_load(config.read_text())
    data["policy"]["lease_ttl_s"] = TTL_S
    config.write_text(yaml.safe_dump(data))
    running = start(config)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.process.kill()
        running.process.wait()


def killing_copy(server: Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The client's pool copy, made to outlive the lease and the server: the first copy out of
    a pool waits past the ttl, the server is SIGKILLed, then the copy runs."""
    real: Callable[..., Any] = getattr(pools, "copy_blocks_slices")  # noqa: B009 (not exported)
    seen = {"copies": 0}

    def slow(src: torch.Tensor, dst: torch.Tensor, *rest: Any) -> Any:
        if seen["copies"] == 0 and src.data_ptr() != dst.data_ptr():
            seen["copies"] += 1
            time.sleep(TTL_S * 1.5)
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
        return real(src, dst, *rest)

    monkeypatch.setattr(pools, "copy_blocks_slices", slow)
    return seen


def test_a_load_whose_release_fails_leaves_nothing_in_out(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, kv = tokens_of(5000, N), kv_of(N, seed=3)
    with Client(server.url) as client:
        client.store(tokens, kv)
    client = Client(server.url, timeout_s=3)
    try:
        client.load(tokens[:4])  # the pools mapped, the lane taken
        seen = killing_copy(server, monkeypatch)
        out = torch.full_like(kv, 7.0)
        with pytest.raises(TransportError):
            client.load(tokens, out=out)
        assert seen["copies"] == 1  # the copy ran, after the lease's ttl
        assert bool((out == 0).all()), "a copy not proven held was left in out"
    finally:
        monkeypatch.undo()
        client.close(timeout_s=1)


def test_an_async_load_whose_release_fails_leaves_nothing_in_out(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, kv = tokens_of(6000, N), kv_of(N, seed=4)
    with Client(server.url) as client:
        client.store(tokens, kv)
    out = torch.full_like(kv, 7.0)

    async def scenario() -> int:
        client = AsyncClient(server.url, timeout_s=3)
        try:
            await client.load(tokens[:4])
            seen = killing_copy(server, monkeypatch)
            with pytest.raises(TransportError):
                await client.load(tokens, out=out)
            return seen["copies"]
        finally:
            monkeypatch.undo()
            await client.aclose(timeout_s=1)

    assert asyncio.run(scenario()) == 1
    assert bool((out == 0).all()), "a copy not proven held was left in out"
