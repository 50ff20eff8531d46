"""Clients shared by threads (and by tasks) while their sidecar is SIGKILLed and started again at
the same URL: the re-map race of `kvtier/client/pools.py` (`pool_for`, `stale`).

Two tenants by API key, one client each, on shared memory and the local lane. Worker threads
(two per client) store and load token sequences that both tenants use, each tenant with other
KV for the same tokens (a block's KV is a function of its tenant and every token up to its end),
while the main thread kills the server now and then and starts a new instance at the same port.
So a thread's call often meets a re-map that another thread started, a lease or reservation of
one instance is used while the client already maps the next, and the old server's pools are
still mapped by calls under way. A call may fail meanwhile, but only with a typed error
(`KVTierError`); every load that returns is exactly its tenant's bytes for the prefix it returns,
never the old server's memory or another tenant's, and never longer than what that tenant tried
to store. After the last restart both clients store and load through the new instance's pools
again (no call of theirs goes through the body).
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from service_server import ADMIN_KEY, BT, Server, free_port, start
from service_server import write_config as service_config
from test_isolation_property import held_blocks
from test_isolation_sidecar import bits, kv_of

from kvtier.client import AsyncClient, Client, ServiceError, TransportError
from kvtier.errors import KVTierError

KEYS = {name: f"key-of-{name}-0123456789abcdef" for name in ("alice", "bob")}
HEAD = [5000 + i for i in range(2 * BT)]
SEQS = [HEAD + [100 * i + t for t in range((1 + i % 3) * BT)] for i in range(6)] + [
    [9000 + 100 * i + t for t in range(3 * BT)] for i in range(2)
]
KV = {(tenant, tuple(seq)): kv_of(tenant, seq) for tenant in KEYS for seq in SEQS}


class Race:
    """What the workers saw: loads checked, typed failures by kind, and anything else."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried: dict[str, set[tuple[int, ...]]] = {name: set() for name in KEYS}
        self.failures: Counter[str] = Counter()
        self.wrong: list[str] = []  # a wrong byte, a block never stored, an untyped error
        self.hits = Counter[str]()  # loads that returned blocks, by server generation
        self.generation = 0

    def choose(self, rng: random.Random, tenant: str) -> tuple[bool, list[int]]:
        """A worker's next call: (whether it stores, the tokens). A store is counted before the
        call: one whose reply is lost may still have stored."""
        tokens = rng.choice(SEQS)
        storing = rng.random() < 0.4
        if storing:
            with self.lock:
                for b in range(1, len(tokens) // BT + 1):
                    self.tried[tenant].add(tuple(tokens[: b * BT]))
        return storing, tokens

    def loaded(self, tenant: str, tokens: list[int], num_tokens: int, kv: torch.Tensor) -> None:
        with self.lock:
            held = held_blocks(self.tried[tenant], tokens, BT)
        if num_tokens // BT > held:
            self.wrong.append(f"{tenant} loaded {num_tokens} tokens of {tokens[:3]}..., "
                              f"stored at most {held} blocks")  # fmt: skip
        elif num_tokens:
            want = KV[tenant, tuple(tokens)][:, :, :num_tokens]
            if kv.shape != want.shape or not torch.equal(bits(kv), bits(want)):
                self.wrong.append(f"{tenant} loaded bytes not its own for {num_tokens} tokens")
            with self.lock:
                self.hits[f"generation {self.generation}"] += 1

    def failed(self, exc: BaseException) -> bool:
        """Record a call's failure; whether no server was there (`TransportError`: the caller
        then leaves the CPUs to the restart a moment)."""
        with self.lock:
            if isinstance(exc, ServiceError):
                self.failures[f"{exc.status} {exc.kind}"] += 1
                if exc.status >= 500 and exc.status != 503:  # 503: not ready yet
                    self.wrong.append(f"a server error: {exc}")
            elif isinstance(exc, KVTierError):
                self.failures[type(exc).__name__] += 1
            else:
                self.wrong.append(f"an untyped error: {exc!r}")
        return isinstance(exc, TransportError)


def _config(directory: Path) -> Path:
    tenants = {name: {"api_keys": [key]} for name, key in KEYS.items()}
    return service_config(directory, gpu_blocks=24, host_blocks=32, disk="1MiB", tenants=tenants)


def _body_calls(server: Server) -> float:
    text = server.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    counts = re.findall(r'kvtier_request_seconds_count\{route="/v1/(?:load|store)"\} (\S+)', text)
    return sum(float(count) for count in counts)


class Killer:
    """The server at one port, killed (SIGKILL) and started again; persisted now and then, so
    that some blocks come back from disk under their tenants."""

    def __init__(self, directory: Path, race: Race, seed: int) -> None:
        self.config, self.port, self.race = _config(directory), free_port(), race
        self.server = start(self.config, port=self.port)
        self.rng = random.Random(seed)

    def kill_and_start(self) -> None:
        if self.rng.random() < 0.5:
            self.server.admin("/v1/admin/persist")
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait(30)
        self.server = start(self.config, port=self.port)
        with self.race.lock:
            self.race.generation += 1

    def pause(self) -> float:
        return self.rng.uniform(0.2, 0.7)


def _work(client: Client, tenant: str, race: Race, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        storing, tokens = race.choose(rng, tenant)
        try:
            if storing:
                client.store(tokens, KV[tenant, tuple(tokens)])
            else:
                loaded = client.load(tokens)
                race.loaded(tenant, tokens, loaded.num_tokens, loaded.kv)
        except Exception as exc:  # every kind is recorded: a typed one is allowed
            if race.failed(exc):
                time.sleep(0.005)


def _all_through_pools(server: Server, clients: dict[str, Client]) -> None:
    """Every client stores and loads through the pools of `server` (none through the body)."""
    before = _body_calls(server)
    for tenant, client in clients.items():
        tokens = [7000 + ord(tenant[0]) * 10 + t for t in range(2 * BT)]
        client.store(tokens, kv_of(tenant, tokens))
        loaded = client.load(tokens)
        assert loaded.num_tokens == len(tokens)
        assert torch.equal(bits(loaded.kv), bits(kv_of(tenant, tokens)))
    assert _body_calls(server) == before, "a call went through the body, not the new pools"


def _race_threads(directory: Path, kills: int, seed: int) -> Race:
    race, stop = Race(), threading.Event()
    killer = Killer(directory, race, seed)
    clients = {
        name: Client(killer.server.url, api_key=key, shared_memory=True, timeout_s=30)
        for name, key in KEYS.items()
    }
    workers = [
        threading.Thread(target=_work, args=(clients[name], name, race, stop, seed * 10 + i))
        for i, name in enumerate([*KEYS, *KEYS])
    ]
    try:
        for worker in workers:
            worker.start()
        for _ in range(kills):
            time.sleep(killer.pause())
            killer.kill_and_start()
        time.sleep(1.0)  # the workers on the last instance
        stop.set()
        for worker in workers:
            worker.join(60)
            assert not worker.is_alive(), "a worker hung"
        _all_through_pools(killer.server, clients)
    finally:
        stop.set()
        for client in clients.values():
            client.close()
        killer.server.stop()
    return race


def _assert_held(race: Race, kills: int) -> None:
    assert not race.wrong, race.wrong[:5]
    assert race.generation == kills
    after = sum(n for key, n in race.hits.items() if key != "generation 0")
    assert race.hits["generation 0"] >= 5 and after >= 5, race.hits  # the schedule did load


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_threads_sharing_a_client_across_sigkills_get_only_their_tenants_bytes(
    tmp_path: Path,
) -> None:
    race = _race_threads(tmp_path, kills=3, seed=1)
    _assert_held(race, 3)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
def test_longer_thread_races_across_sigkills(tmp_path: Path, seed: int) -> None:
    race = _race_threads(tmp_path, kills=10, seed=seed)
    _assert_held(race, 10)


async def _work_async(
    client: AsyncClient, tenant: str, race: Race, stop: asyncio.Event, seed: int
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        storing, tokens = race.choose(rng, tenant)
        try:
            if storing:
                await client.store(tokens, KV[tenant, tuple(tokens)])
            else:
                loaded = await client.load(tokens)
                race.loaded(tenant, tokens, loaded.num_tokens, loaded.kv)
        except Exception as exc:  # every kind is recorded: a typed one is allowed
            if race.failed(exc):
                await asyncio.sleep(0.005)
        await asyncio.sleep(0)  # a call that fails at once must not starve the killer


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_tasks_sharing_an_async_client_across_sigkills_get_only_their_tenants_bytes(
    tmp_path: Path,
) -> None:
    kills, race = 3, Race()
    killer = Killer(tmp_path, race, seed=4)

    async def main() -> None:
        clients = {
            name: AsyncClient(killer.server.url, api_key=key, shared_memory=True, timeout_s=30)
            for name, key in KEYS.items()
        }
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(_work_async(clients[name], name, race, stop, 40 + i))
            for i, name in enumerate([*KEYS, *KEYS])
        ]
        try:
            for _ in range(kills):
                await asyncio.sleep(killer.pause())
                await asyncio.to_thread(killer.kill_and_start)
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            before = await asyncio.to_thread(_body_calls, killer.server)
            for tenant, client in clients.items():
                tokens = [7500 + ord(tenant[0]) * 10 + t for t in range(2 * BT)]
                await client.store(tokens, kv_of(tenant, tokens))
                loaded = await client.load(tokens)
                assert torch.equal(bits(loaded.kv), bits(kv_of(tenant, tokens)))
            after = await asyncio.to_thread(_body_calls, killer.server)
            assert after == before, "a call went through the body, not the new pools"
        finally:
            stop.set()
            for client in clients.values():
                await client.aclose()

    try:
        asyncio.run(main())
    finally:
        killer.server.stop()
    _assert_held(race, kills)
