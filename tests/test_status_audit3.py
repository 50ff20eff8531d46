"""A third audit of what the status reports (`status.py`, `/metrics`, `kvtier status`).

- A same-host client's load (`Client.load` / `AsyncClient.load` over shared memory, the vLLM
  connector's path) is a prefetch of the prefix, read from the mapped pool and released; the
  server counts it as a load (`ops.loads`, `loaded_tokens`: the tokens leased), not as a
  prefetch, globally, for the tenant and in /metrics: its prefetch carries `as_load`, a closed
  field (a bool; anything else is a 400 that grants nothing).
- Reservations hold slots that are neither free nor blocks: every tier reports them as
  `reserved_slots` (live and `quarantined_slots`), beside `in_flight_slots`, so that
  `slots - free_slots == blocks + reserved_slots + in_flight_slots` and
  `used_bytes == (slots - free_slots) * slot_bytes`; `index.leases` (`kvtier_leases`,
  `kvtier status`) counts clients' leases, not a reservation's pin (`index.reservations` the
  live reservations).
- `used_bytes` is in `capacity_bytes`' unit on every tier: a full disk tier (header and aligned
  payload a slot, any codec) and a quantized host tier read `used_bytes == capacity_bytes`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from service_server import ADMIN_KEY, Server, kv_of, running, tokens_of, write_config

from kvtier import KVStore
from kvtier.cli import main
from kvtier.client import AsyncClient, Client
from kvtier.config import KVTierConfig

pytestmark = pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite

KEY_A = "tenant-a-key-0123456789abcdef"
KEY_B = "tenant-b-key-0123456789abcdef"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TTL_S, QUARANTINE_S = 1.0, 3.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = write_config(
        tmp_path,
        gpu_blocks=16,
        host_blocks=32,
        tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
    )
    data = yaml.safe_load(config.read_text())
    data["policy"]["reservation_quarantine_s"] = QUARANTINE_S
    config.write_text(yaml.safe_dump(data))
    with running(config) as live:
        yield live


def global_status(server: Server) -> dict[str, Any]:
    response = server.get("/v1/status", headers=ADMIN)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def tenant_ops(server: Server, key: str) -> dict[str, int]:
    response = server.get("/v1/status", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    ops: dict[str, int] = response.json()["ops"]
    return ops


def metrics(server: Server) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value}."""
    text = server.get("/metrics", headers=ADMIN).text
    lines = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in lines}


LOAD_OPS = ("loads", "loaded_tokens", "prefetches")


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, int]:
    return {op: after[op] - before[op] for op in LOAD_OPS}


def test_a_mapped_load_is_counted_as_a_load_not_a_prefetch(server: Server) -> None:
    tokens = tokens_of(0, 16)
    with Client(server.url, api_key=KEY_A) as client:
        client.store(tokens, kv_of(16, 1))
        assert client.pool_buffer("gpu") is not None  # the load goes through shared memory
        before, mine = global_status(server)["ops"], tenant_ops(server, KEY_A)
        assert client.load(tokens).num_tokens == 16
    after = global_status(server)["ops"]
    want = {"loads": 1, "loaded_tokens": 16, "prefetches": 0}
    assert delta(after, before) == want
    assert delta(tenant_ops(server, KEY_A), mine) == want
    assert tenant_ops(server, KEY_B)["loads"] == 0
    found = metrics(server)
    assert found['kvtier_ops_total{op="loads"}'] == after["loads"] == 1
    assert found['kvtier_ops_total{op="loaded_tokens"}'] == after["loaded_tokens"] == 16
    assert found['kvtier_ops_total{op="prefetches"}'] == after["prefetches"] == 0


def test_an_async_mapped_load_is_counted_as_a_load(server: Server) -> None:
    tokens = tokens_of(100, 12)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with AsyncClient(server.url, api_key=KEY_B) as client:
            await client.store(tokens, kv_of(12, 2))
            assert client.pool_buffer("gpu") is not None
            before = global_status(server)["ops"]
            assert (await client.load(tokens)).num_tokens == 12
            await client.prefetch(tokens)  # a prefetch stays a prefetch
        return before, global_status(server)["ops"]

    before, after = asyncio.run(scenario())
    assert delta(after, before) == {"loads": 1, "loaded_tokens": 12, "prefetches": 1}


@pytest.mark.parametrize("value", [1, 0, "true", None, [True]])
def test_as_load_is_a_bool_or_a_400_that_grants_nothing(server: Server, value: Any) -> None:
    before = global_status(server)
    response = server.post(
        "/v1/prefetch",
        json={"tokens": tokens_of(0, 8), "as_load": value},
        headers={"authorization": f"Bearer {KEY_A}"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_argument"
    assert "as_load" in response.json()["detail"]
    after = global_status(server)
    assert after["index"]["leases"] == before["index"]["leases"] == 0
    assert delta(after["ops"], before["ops"]) == dict.fromkeys(LOAD_OPS, 0)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_reserved_slots_are_reported_and_a_reservation_is_no_lease(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(server.url, api_key=KEY_A, shared_memory=False) as a:
        a.store(tokens_of(0, 16), kv_of(16, 3))  # 4 blocks
    with Client(server.url, api_key=KEY_B, shared_memory=False) as b:
        b.reserve(tokens_of(500, 24), ttl_s=TTL_S)  # 6 slots on gpu and on host
        live, found = global_status(server), metrics(server)
        assert main(["status", "--url", server.url, "--key", ADMIN_KEY]) == 0
        shown = capsys.readouterr().out
        expired = wait_for(server, lambda s: s["index"]["reservations"] == 0)
    for name in ("gpu", "host"):
        tier = live["tiers"][name]
        assert (tier["blocks"], tier["reserved_slots"], tier["quarantined_slots"]) == (4, 6, 0)
        assert found[f'kvtier_tier_reserved_slots{{tier="{name}"}}'] == 6
        tier = expired["tiers"][name]  # expired: quarantined for QUARANTINE_S
        assert (tier["blocks"], tier["reserved_slots"], tier["quarantined_slots"]) == (4, 6, 6)
    for status in (live, expired):
        for tier in status["tiers"].values():
            in_use = tier["slots"] - tier["free_slots"]
            assert in_use == tier["blocks"] + tier["reserved_slots"] + tier["in_flight_slots"]
            assert tier["used_bytes"] == in_use * tier["slot_bytes"]
            assert tier["capacity_bytes"] == tier["slots"] * tier["slot_bytes"]
        assert status["index"]["leases"] == 0
    assert live["index"]["reservations"] == 1
    assert (found["kvtier_leases"], found["kvtier_reservations"]) == (0, 1)
    assert "0 leases live, 1 reservations live" in shown
    assert [line.split()[-1] for line in shown.splitlines()[2:4]] == ["6", "6"]  # reserved
    after = wait_for(server, lambda s: s["tiers"]["gpu"]["reserved_slots"] == 0)["tiers"]["gpu"]
    assert (after["quarantined_slots"], after["free_slots"]) == (0, 12)  # the quarantine ended


def wait_for(server: Server, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The global status once `done` holds for it (bounded: 30 s)."""
    deadline = time.monotonic() + 30
    while not done(status := global_status(server)):
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    return status


def test_a_lease_is_still_counted_in_index_leases(server: Server) -> None:
    tokens = tokens_of(0, 8)
    with Client(server.url, api_key=KEY_A, shared_memory=False) as client:
        client.store(tokens, kv_of(8, 4))
        lease = client.prefetch(tokens)
        status, found = global_status(server), metrics(server)
        assert (status["index"]["leases"], found["kvtier_leases"]) == (1, 1)
        assert status["tiers"]["gpu"]["leased_blocks"] == 2
        client.release(lease)
    assert global_status(server)["index"]["leases"] == 0


MODEL = {"name": "demo", "num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16"}


def _store(tmp_path: Path, host: dict[str, Any], codec: str) -> KVStore:
    return KVStore(
        KVTierConfig.model_validate(
            {
                "model": MODEL,
                "block_tokens": 16,
                "tiers": {
                    "gpu": {"capacity": "256KiB", "device": "cpu"},
                    "host": host,
                    "disk": {"capacity": "1MiB", "path": str(tmp_path / "d"), "codec": codec},
                },
                "policy": {"disk_admission_hits": 0},
                "mover": {"background": False},
            }
        )
    )


@pytest.mark.parametrize(
    ("codec", "host"),
    [
        ("none", {"capacity": "512KiB"}),
        ("lz4", {"capacity": "512KiB"}),
        ("int4", {"capacity": "512KiB"}),
        ("none", {"capacity": "256KiB", "codec": "int8"}),
    ],
)
def test_used_bytes_is_in_capacity_bytes_unit_on_every_tier(
    tmp_path: Path, codec: str, host: dict[str, Any]
) -> None:
    store = _store(tmp_path, host, codec)
    try:
        gen = torch.Generator().manual_seed(5)
        for i in range(60):
            kv = torch.randn((4, 2, 64, 2, 64), generator=gen).to(torch.float16)
            store.store(tokens_of(1000 * i, 64), kv)
        store.persist()
        status = store.status()
        for name, tier in status["tiers"].items():
            in_use = tier["slots"] - tier["free_slots"]
            assert tier["capacity_bytes"] == tier["slots"] * tier["slot_bytes"], name
            assert tier["used_bytes"] == in_use * tier["slot_bytes"], name
        for name in ("disk", "host"):  # full: occupancy 1
            tier = status["tiers"][name]
            assert tier["free_slots"] == 0, name
            assert tier["used_bytes"] == tier["capacity_bytes"], name
        disk = status["tiers"]["disk"]
        assert disk["slot_bytes"] > disk["capacity_bytes"] // max(1, disk["slots"]) - 1
        assert disk["blocks"] == disk["slots"]
    finally:
        store.close()


def test_a_full_disk_reads_full_in_metrics(tmp_path: Path) -> None:
    config = write_config(tmp_path, gpu_blocks=4, host_blocks=8, disk="64KiB", write="write_back")
    with running(config) as live, Client(live.url, shared_memory=False) as client:
        for i in range(16):
            client.store(tokens_of(100 * i, 16), kv_of(16, i))
        live.admin("/v1/admin/persist")
        disk = global_status(live)["tiers"]["disk"]
        assert disk["free_slots"] == 0
        found = metrics(live)
        used = found['kvtier_tier_used_bytes{tier="disk"}']
        assert used == found['kvtier_tier_capacity_bytes{tier="disk"}'] == disk["capacity_bytes"]
        assert httpx.get(live.url + "/readyz", timeout=10).status_code == 200
