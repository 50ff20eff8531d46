"""A client whose re-map fails after its sidecar restarted (`kvtier/client/mapper.py`): the
new sidecar at the URL serves another layout, so its pools cannot be taken.

- The reply that found the new instance granted a lease (a load's prefetch) or a reservation
  (a store's): it is given back at once, not left to the server's ttl.
- The client is not left on the body path for good: when a sidecar of the client's layout is
  back at the URL, the next store and load map its pools and go through them again.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
import yaml
from service_server import ADMIN_KEY, BT, Server, free_port, kv_of, running, write_config

from kvtier.client import AsyncClient, Client
from kvtier.errors import LayoutChangedError


def _float32(directory: Path) -> Path:
    path = write_config(directory)
    config = yaml.safe_load(path.read_text())
    config["model"] = {**config["model"], "dtype": "float32"}
    path.write_text(yaml.safe_dump(config))
    return path


def _live_leases(server: Server) -> int:
    status = server.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    return int(status["index"]["leases"])


def _body_calls(server: Server) -> float:
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    counts = re.findall(r'kvtier_request_seconds_count\{route="/v1/(?:load|store)"\} (\S+)', text)
    return sum(float(count) for count in counts)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_failed_remap_gives_back_what_it_was_granted_and_a_later_call_maps_again(
    tmp_path: Path,
) -> None:
    tokens, port = list(range(300, 300 + 4 * BT)), free_port()
    same = write_config(tmp_path / "same")
    with running(same, port=port) as first:
        client = Client(first.url)
        client.store(tokens, kv_of(len(tokens), seed=1))
    try:
        with running(_float32(tmp_path / "other"), port=port) as other:
            with Client(other.url, shared_memory=False) as writer:
                writer.store(tokens, kv_of(len(tokens), seed=2).float())
            with pytest.raises(LayoutChangedError, match=r"pools\.layout"):
                client.load(tokens)  # its prefetch found the new instance, then its layout
            assert _live_leases(other) == 0  # the lease of that prefetch, given back
            with pytest.raises(LayoutChangedError, match=r"pools\.layout"):
                client.store(list(range(900, 900 + 4 * BT)), kv_of(4 * BT, seed=3))
            assert _live_leases(other) == 0
        with running(same, port=port) as back:
            more = list(range(1200, 1200 + 4 * BT))
            assert client.store(more, kv_of(len(more), seed=4)).stored_tokens == len(more)
            assert torch.equal(client.load(more).kv, kv_of(len(more), seed=4))
            assert client.pool_buffer("gpu") is not None
            assert _body_calls(back) == 0  # both through the mapped pools again
    finally:
        client.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_the_async_client_gives_back_and_maps_again_the_same_way(tmp_path: Path) -> None:
    tokens, port = list(range(400, 400 + 4 * BT)), free_port()
    same = write_config(tmp_path / "same")

    async def load(client: AsyncClient, tokens: list[int]) -> torch.Tensor:
        return (await client.load(tokens)).kv

    loop = asyncio.new_event_loop()
    with running(same, port=port) as first:
        client = AsyncClient(first.url)
        loop.run_until_complete(client.store(tokens, kv_of(len(tokens), seed=1)))
    try:
        with running(_float32(tmp_path / "other"), port=port) as other:
            with Client(other.url, shared_memory=False) as writer:
                writer.store(tokens, kv_of(len(tokens), seed=2).float())
            with pytest.raises(LayoutChangedError, match=r"pools\.layout"):
                loop.run_until_complete(load(client, tokens))
            assert _live_leases(other) == 0
        with running(same, port=port) as back:
            more = list(range(1400, 1400 + 4 * BT))
            stored = loop.run_until_complete(client.store(more, kv_of(len(more), seed=4)))
            assert stored.stored_tokens == len(more)
            assert torch.equal(loop.run_until_complete(load(client, more)), kv_of(len(more), 4))
            assert _body_calls(back) == 0
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
