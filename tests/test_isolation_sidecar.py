"""Tenant isolation as a property of random schedules through a real `kvtier serve`, across
SIGKILLs: the in-process property (`test_isolation_property.py`) with the service in between.

Three tenants, each with its own API key and its own `Client` (two of them on shared memory and
the local lane, one over HTTP bodies), store, load, look up and prefetch token sequences that
share prefixes, each writing different KV for the same tokens (a block's KV is a function of its
tenant and every token up to its end). The admin persists now and then, and the server is
killed (SIGKILL) and started again at the same URL: the clients go on with the new instance
(they re-map its pools), and the disk tier's recovered blocks come back under their tenants.
After every step a load returns exactly its tenant's bytes for the prefix it returns (never
another tenant's, never a block that tenant did not store), a lookup or a lease counts no more
than its tenant stored, and the admin check holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from service_server import ADMIN_KEY, BT, DIM, HEADS, LAYERS, Server, free_port, start
from service_server import write_config as service_config
from test_isolation_property import held_blocks

from kvtier.client import Client
from kvtier.errors import CapacityError, QuotaError

KEYS = {name: f"key-of-{name}-0123456789abcdef" for name in ("alice", "bob", "carol")}
PREFIXES = [[7000 + i for i in range(3 * BT)], [8000 + i for i in range(2 * BT)]]


def block_kv(tenant: str, tokens: list[int]) -> torch.Tensor:
    """The KV of the block that ends `tokens`, for `tenant`: `[layers, 2, BT, heads, dim]`."""
    digest = hashlib.blake2b(f"{tenant}:{tokens}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randn((LAYERS, 2, BT, HEADS, DIM), generator=gen).to(torch.float16)


def kv_of(tenant: str, tokens: list[int]) -> torch.Tensor:
    blocks = [block_kv(tenant, tokens[: b * BT]) for b in range(1, len(tokens) // BT + 1)]
    return torch.cat(blocks, dim=2)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


class Sidecar:
    """One schedule against a server that it kills and starts again at one port."""

    def __init__(self, directory: Path, seed: int) -> None:
        tenants = {name: {"api_keys": [key]} for name, key in KEYS.items()}
        self.config = service_config(
            directory, gpu_blocks=24, host_blocks=24, disk="1MiB", tenants=tenants
        )
        self.port = free_port()
        self.server: Server = start(self.config, port=self.port)
        self.rng = random.Random(seed)
        heads = [PREFIXES[i % 2] if i < 4 else [] for i in range(6)]
        self.seqs = [
            head + [100 * i + t for t in range(self.rng.randint(1, 3) * BT)]
            for i, head in enumerate(heads)
        ]
        self.clients = {
            name: Client(self.server.url, api_key=key, shared_memory=name != "carol", timeout_s=30)
            for name, key in KEYS.items()
        }
        self.stored: dict[str, set[tuple[int, ...]]] = {name: set() for name in KEYS}
        self.seen = {"hits": 0, "hits after a kill": 0, "kills": 0}

    def held(self, tenant: str, tokens: list[int]) -> int:
        return held_blocks(self.stored[tenant], tokens, BT)

    def step(self) -> None:
        rng = self.rng
        tenant, tokens = rng.choice(list(KEYS)), rng.choice(self.seqs)
        client = self.clients[tenant]
        op = rng.choices(["store", "load", "lookup", "prefetch", "persist", "kill"],
                         weights=[6, 6, 2, 3, 1, 1])[0]  # fmt: skip
        if op == "store":
            client.store(tokens, kv_of(tenant, tokens))
            for b in range(1, len(tokens) // BT + 1):
                self.stored[tenant].add(tuple(tokens[: b * BT]))
        elif op == "load":
            loaded = client.load(tokens)
            n = loaded.num_tokens // BT
            assert n <= self.held(tenant, tokens), (tenant, tokens, n)
            if n:
                want = kv_of(tenant, tokens[: n * BT])
                assert torch.equal(bits(loaded.kv), bits(want)), f"{tenant} got bytes not its own"
                self.seen["hits"] += 1
                self.seen["hits after a kill"] += self.seen["kills"] > 0
        elif op == "lookup":
            assert client.lookup(tokens).num_tokens // BT <= self.held(tenant, tokens)
        elif op == "prefetch":
            with contextlib.suppress(QuotaError, CapacityError):
                lease = client.prefetch(tokens)
                assert lease.num_tokens // BT <= self.held(tenant, tokens)
                client.release(lease)
        elif op == "persist":
            self.server.admin("/v1/admin/persist")
        else:  # SIGKILL, and a new instance at the same URL: what is on disk comes back
            self.server.admin("/v1/admin/persist")
            self.server.process.send_signal(signal.SIGKILL)
            self.server.process.wait(30)
            self.server = start(self.config, port=self.port)
            self.seen["kills"] += 1
        checked = self.server.post(
            "/v1/admin/check", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert checked.status_code == 200, checked.text

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.server.stop()


@contextlib.contextmanager
def sidecar(directory: Path, seed: int) -> Iterator[Sidecar]:
    made = Sidecar(directory, seed)
    try:
        yield made
    finally:
        made.close()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_schedule_with_sigkills_serves_each_tenant_only_its_own_bytes(tmp_path: Path) -> None:
    with sidecar(tmp_path, 0) as run:
        for _ in range(60):
            run.step()
        seen = run.seen
    assert seen["kills"] >= 1 and seen["hits after a kill"] >= 1, seen


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 4))
def test_longer_schedules_with_sigkills(tmp_path: Path, seed: int) -> None:
    with sidecar(tmp_path, seed) as run:
        for _ in range(250):
            run.step()
        seen = run.seen
    assert seen["kills"] >= 3 and seen["hits after a kill"] >= 10, seen
