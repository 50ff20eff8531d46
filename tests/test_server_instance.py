"""A sidecar restarted at the same URL is another server instance, and a client that mapped the
old one's pools knows it (`kvtier/client/pools.py`, `kvtier/service/admission.py`).

- Every `kvtier serve` process draws a random instance id; `/v1/pools` and every reply that
  names slots (a lease, over HTTP and the lane; a reservation) carry it.
- A client that outlives a restart maps the new server's pools and lane at the first reply of
  the new instance: its next load is the new server's bytes, read through the mapped pools
  again (the new server counts no `/v1/load` and no `/v1/store`, and answers on its lane); the
  blocking and the async client alike.
- A lease of another instance than the one mapped is never read through the mapping, whatever
  the pool (the check does not look at the pool's kind: the CUDA IPC pools, which cannot be
  mapped on this machine, take the same line as the /dev/shm ones tested here); the pools are
  asked for again once per instance, never in a loop.
- A malformed instance in a reply is a `ReplyError` naming the field.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from service_server import (
    ADMIN_KEY,
    BT,
    Server,
    kv_of,
    restartable,
    start,
)

from kvtier.client import AsyncClient, Client
from kvtier.client.pools import MappedPools
from kvtier.errors import ReplyError
from kvtier.service import replies

INSTANCE = re.compile(r"[0-9a-f]{16}")


def _counts(server: Server) -> dict[str, float]:
    """Requests the server answered: by route (HTTP and lane), and over its lane."""
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    found = {"lane": 0.0}
    for line in text.splitlines():
        route = re.match(r'kvtier_request_seconds_count\{route="([^"]+)"\} (\S+)', line)
        if route:
            found[route[1]] = float(route[2])
        elif line.startswith("kvtier_lane_requests_total "):
            found["lane"] = float(line.split()[1])
    return found


def _pools_body(server: Server) -> dict[str, Any]:
    body = server.get("/v1/pools").json()
    assert isinstance(body, dict)
    return body


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_each_server_process_has_its_own_instance_in_every_reply_that_names_slots(
    tmp_path: Path,
) -> None:
    tokens = list(range(100, 100 + 4 * BT))
    seen = []
    with restartable(tmp_path) as (config, port, started):
        for _ in range(2):
            started.append(start(config, port=port))
            server = started[-1]
            instance = _pools_body(server)["instance"]
            assert isinstance(instance, str) and INSTANCE.fullmatch(instance)
            with Client(server.url) as client:
                client.store(tokens, kv_of(len(tokens), seed=3))
            lease = server.post("/v1/prefetch", json={"tokens": tokens}).json()
            state = server.get(f"/v1/leases/{lease['lease_id']}").json()
            reserved = server.post("/v1/reserve", json={"tokens": tokens + [7] * BT}).json()
            assert reserved["num_tokens"] == BT  # one new block: its slot named
            assert (lease["instance"], state["instance"], reserved["instance"]) == (instance,) * 3
            seen.append(instance)
            server.stop()
    assert seen[0] != seen[1]


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_client_that_outlives_a_restart_loads_the_new_bytes_through_the_new_pools(
    tmp_path: Path,
) -> None:
    tokens = list(range(500, 500 + 8 * BT))
    with restartable(tmp_path) as (config, port, started):
        started.append(start(config, port=port))
        client = Client(started[-1].url)
        try:
            old_pool = client.pool_buffer("gpu")
            assert old_pool is not None
            client.store(tokens, kv_of(len(tokens), seed=1))  # the old server's bytes
            assert torch.equal(client.load(tokens).kv, kv_of(len(tokens), seed=1))
            started[-1].stop()
            started.append(start(config, port=port))  # same URL, new pools, new lane
            new = started[-1]
            with Client(new.url, shared_memory=False) as other:
                other.store(tokens, kv_of(len(tokens), seed=2))  # through the body
            before = _counts(new)
            got = client.load(tokens)  # no error, no old byte: the new server's, mapped
            assert got.num_tokens == len(tokens)
            assert torch.equal(got.kv, kv_of(len(tokens), seed=2))
            pool = client.pool_buffer("gpu")
            assert pool is not None and pool is not old_pool
            more = list(range(900, 900 + 4 * BT))
            assert client.store(more, kv_of(len(more), seed=4)).stored_tokens == len(more)
            assert torch.equal(client.load(more).kv, kv_of(len(more), seed=4))
            after = _counts(new)
            assert after.get("/v1/load", 0) == before.get("/v1/load", 0)  # not through the body
            assert after.get("/v1/store", 0) == before.get("/v1/store", 0)
            assert after["/v1/commit"] - before.get("/v1/commit", 0) == 1  # reserve+write+commit
            assert after["lane"] - before["lane"] >= 3  # reserve, commit, a prefetch: the new lane
        finally:
            client.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_the_async_client_outlives_a_restart_the_same_way(tmp_path: Path) -> None:
    tokens = list(range(700, 700 + 8 * BT))

    async def run(url: str, restart: Any) -> tuple[torch.Tensor, bool]:
        async with AsyncClient(url) as client:
            await client.store(tokens, kv_of(len(tokens), seed=5))
            assert torch.equal((await client.load(tokens)).kv, kv_of(len(tokens), seed=5))
            old_pool = client._pools.buffers.get("gpu")
            assert old_pool is not None
            await asyncio.to_thread(restart)
            got = await client.load(tokens)
            assert got.num_tokens == len(tokens)
            pool = client._pools.buffers.get("gpu")
            return got.kv, pool is not None and pool is not old_pool

    with restartable(tmp_path) as (config, port, started):
        started.append(start(config, port=port))
        counts: dict[str, dict[str, float]] = {}

        def restart() -> None:
            started[-1].stop()
            started.append(start(config, port=port))
            with Client(started[-1].url, shared_memory=False) as other:
                other.store(tokens, kv_of(len(tokens), seed=6))
            counts["before"] = _counts(started[-1])

        kv, remapped = asyncio.run(run(started[-1].url, restart))
        assert torch.equal(kv, kv_of(len(tokens), seed=6)), "not the new server's bytes"
        assert remapped, "the async client did not map the new server's pools"
        after, before = _counts(started[-1]), counts["before"]
        assert after.get("/v1/load", 0) == before.get("/v1/load", 0)
        assert after["lane"] > before["lane"]


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_lease_of_another_instance_is_never_read_through_the_mapping(tmp_path: Path) -> None:
    tokens = list(range(300, 300 + 4 * BT))
    with restartable(tmp_path) as (config, port, started):
        started.append(start(config, port=port))
        server = started[-1]
        with Client(server.url) as client:
            client.store(tokens, kv_of(len(tokens), seed=8))
        pools = MappedPools()
        body = _pools_body(server)
        pools.map(body)
        assert pools.pool_for("gpu", body["instance"]) is not None
        lease_body = server.post("/v1/prefetch", json={"tokens": tokens}).json()
        lease = pools.lease(lease_body, None, len(tokens))
        read = pools.read_blocks(
            lease, lease_body["instance"], pools.destination(len(tokens), None, "layers", None)
        )
        assert read is not None and torch.equal(read, kv_of(len(tokens), seed=8))  # control

        forged = {**lease_body, "instance": "0123456789abcdef"}  # another server's reply
        other = replies.instance(forged, "lease")
        assert other != body["instance"]
        dest = pools.destination(len(tokens), None, "layers", None)
        dest.blocks(len(lease.block_table)).fill_(7.0)
        assert pools.read_blocks(pools.lease(forged, None, len(tokens)), other, dest) is None
        assert bool((dest.blocks(len(lease.block_table)) == 7.0).all()), "a byte was read"
        assert pools.pool_for("gpu", other) is None and pools.pool_for("host", other) is None
        assert pools.stale(other)  # the client asks /v1/pools again: every mapping forgotten
        assert pools.buffers == {} and pools.pool_for("gpu", body["instance"]) is None
        assert not pools.stale(other)  # once per instance: no second ask, no loop
        pools.map(_pools_body(server))  # what the client maps then: still the same server
        assert pools.pool_for("gpu", other) is None  # the forged lease still reads nothing
        assert pools.pool_for("gpu", body["instance"]) is not None


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_malformed_instance_is_a_reply_error_naming_the_field(tmp_path: Path) -> None:
    tokens = list(range(400, 400 + 2 * BT))
    with restartable(tmp_path) as (config, port, started):
        started.append(start(config, port=port))
        server = started[-1]
        with Client(server.url) as client:
            client.store(tokens, kv_of(len(tokens), seed=9))
        pools_body = _pools_body(server)
        lease = server.post("/v1/prefetch", json={"tokens": tokens}).json()
        reserved = server.post("/v1/reserve", json={"tokens": tokens + [5] * BT}).json()
    malformed: list[object] = ["0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0"]
    for bad in [*malformed, 12, True, [], "x"]:
        pools = MappedPools()
        with pytest.raises(ReplyError, match=r"^pools\.instance: got"):
            pools.map({**pools_body, "instance": bad})
        assert pools.buffers == {} and pools.served is None  # nothing mapped
        pools.map(pools_body)
        with pytest.raises(ReplyError, match=r"^lease\.instance: got"):
            pools.lease({**lease, "instance": bad}, None, len(tokens))
        with pytest.raises(ReplyError, match=r"^reservation\.instance: got"):
            pools.reservation({**reserved, "instance": bad}, bytes(4 * (len(tokens) + BT)))
        pools.clear()
