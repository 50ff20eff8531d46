"""One `Client` shared by many threads, one `AsyncClient` by many tasks, against a real
`kvtier serve`, as an engine uses them (the vLLM connector shares one `Client` per tenant key
between its load threads and its scheduler).

Every KV stored is a function of (tenant, tokens) block by block (`block_kv`: a block's bytes
follow from its tenant and the whole prefix up to its end), and prompts share trunks, so that a
load that got another call's bytes, another tenant's, or a slot overwritten mid-copy (a lease
released before the copy out of the mapped pool ended, its slot reused) fails the bit-exact
comparison. The pools are small (`GPU_BLOCKS`, `HOST_BLOCKS`): blocks are evicted and slots
reused all along. A call may fail only with a typed error (`kvtier.errors`); after `close()`
the server holds no lease. Every join is bounded, with a traceback dump of every thread on a
hang. Seeded: a failure names the worker and step.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import hashlib
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from service_server import ADMIN_KEY, BT, DIM, HEADS, LAYERS, Server, running, write_config

from kvtier.blocks import from_blocks
from kvtier.client import AsyncClient, Client
from kvtier.errors import KVTierError

GPU_BLOCKS, HOST_BLOCKS = 16, 24  # a prompt is 1-5 blocks: 12 threads overflow both tiers
TRUNKS = 4  # prompts start with one of these, so that they share blocks
KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-9876543210"
BOUND_S = 60.0  # a hang, not a slow machine: the default-suite runs take 1-3 s each


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No auth: tenants "a" and "b" named per call (`tenant=`), as one client may."""
    config = write_config(
        tmp_path_factory.mktemp("concurrency"),
        gpu_blocks=GPU_BLOCKS,
        host_blocks=HOST_BLOCKS,
        tenants={"a": {}, "b": {}},
    )
    with running(config) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Tenants by API key, one `Client` per key (the vLLM connector's way)."""
    config = write_config(
        tmp_path_factory.mktemp("concurrency-keys"),
        gpu_blocks=2 * GPU_BLOCKS,
        host_blocks=2 * HOST_BLOCKS,
        tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
    )
    with running(config) as live:
        yield live


# ---- what a load must return --------------------------------------------------------------


def block_kv(tenant: str, prefix: list[int]) -> torch.Tensor:
    """The KV of the block that ends `prefix`, for `tenant`: `[layers, 2, BT, heads, dim]`."""
    digest = hashlib.blake2b(repr((tenant, prefix)).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn((LAYERS, 2, BT, HEADS, DIM), generator=gen).to(torch.float16)


def kv_for(tenant: str, tokens: list[int]) -> torch.Tensor:
    """The KV of `tokens`' full blocks, as `store` takes it (`[layers, 2, n, heads, dim]`)."""
    blocks = [block_kv(tenant, tokens[: (i + 1) * BT]) for i in range(len(tokens) // BT)]
    if not blocks:
        return torch.zeros((LAYERS, 2, 0, HEADS, DIM), dtype=torch.float16)
    return torch.cat(blocks, dim=2)


def prompt(rng: random.Random) -> list[int]:
    """1-2 blocks of one of `TRUNKS` trunks, then 0-3 blocks of one of 3 branches."""
    trunk = rng.randrange(TRUNKS)
    tokens = [trunk * 1000 + j for j in range(BT * rng.randint(1, 2))]
    branch = 50_000 + 100 * rng.randrange(3)
    return tokens + [branch + j for j in range(BT * rng.randint(0, 3))]


@dataclass
class Outcomes:
    """What the workers saw: wrong loads and untyped errors are failures; typed errors are
    counted (a tier full of others' leases is a rightful `CapacityError`)."""

    wrong: list[str] = field(default_factory=list)
    untyped: list[str] = field(default_factory=list)
    typed: dict[str, int] = field(default_factory=dict)
    loaded_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(
        self, where: str, tenant: str, tokens: list[int], got: torch.Tensor, n: int, start: int = 0
    ) -> None:
        """`got`, loaded for `tokens` from token `start` (`n` of them cached), must be `kv_for`
        those, bit for bit."""
        expected = kv_for(tenant, tokens[:n])[:, :, start:]
        ok = n % BT == 0 and n <= len(tokens) and got.shape == expected.shape
        if ok and not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
            ok = False
        with self.lock:
            self.loaded_tokens += n
            if not ok:
                self.wrong.append(f"{where}: {n} tokens of {tokens[:8]}..., got {got.shape}")

    @contextlib.contextmanager
    def step(self, where: str) -> Iterator[None]:
        try:
            yield
        except KVTierError as exc:
            with self.lock:
                self.typed[type(exc).__name__] = self.typed.get(type(exc).__name__, 0) + 1
        except Exception as exc:
            with self.lock:
                self.untyped.append(f"{where}: {exc!r}")

    def assert_clean(self) -> None:
        assert (self.wrong[:5], self.untyped[:5]) == ([], []), (len(self.wrong), self.typed)
        assert self.loaded_tokens > 0, self.typed


def run_threads(count: int, target: Callable[[int], None]) -> None:
    """`target(0..count-1)` on threads; fails (every thread's traceback dumped) past
    `BOUND_S`."""
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    faulthandler.dump_traceback_later(BOUND_S)
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + BOUND_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a worker hung (tracebacks on stderr)"
    finally:
        faulthandler.cancel_dump_traceback_later()


async def gather_bounded(*calls: Any) -> None:
    faulthandler.dump_traceback_later(BOUND_S)
    try:
        await asyncio.wait_for(asyncio.gather(*calls), BOUND_S)
    finally:
        faulthandler.cancel_dump_traceback_later()


def live_leases(server: Server) -> int:
    response = server.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text
    leases: int = response.json()["index"]["leases"]
    return leases


def assert_checked(server: Server) -> None:
    assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}


def assert_left_clean(server: Server, seen: Outcomes) -> None:
    """After the client closed: every call's outcome was allowed, no lease is left on the
    server, and its index and pools pass their check."""
    seen.assert_clean()
    assert live_leases(server) == 0
    assert_checked(server)


# ---- one worker's steps -------------------------------------------------------------------


def blocking_step(
    client: Client, tenant: str, rng: random.Random, seen: Outcomes, where: str
) -> None:
    """One random call of the engine contract on `client`, its result checked."""
    tokens, kind = prompt(rng), rng.random()
    with seen.step(where):
        if kind < 0.4:
            client.store(tokens, kv_for(tenant, tokens), tenant=tenant)
        elif kind < 0.75:
            start = BT * rng.randint(0, 1) if len(tokens) > BT else 0
            got = client.load(tokens, tenant=tenant, start=start)
            seen.check(where, tenant, tokens, got.kv, got.num_tokens, start)
        elif kind < 0.9:
            pool = client.pool_buffer("gpu")
            lease = client.prefetch(tokens, tenant=tenant)
            try:
                if pool is not None and lease.num_tokens:  # the engine reads the pages itself
                    kv = from_blocks(pool[list(lease.block_table)])
                    seen.check(where, tenant, tokens, kv, lease.num_tokens)
            finally:
                client.release(lease)
        else:
            assert client.lookup(tokens, tenant=tenant).num_tokens <= len(tokens)


async def async_step(
    client: AsyncClient, tenant: str, rng: random.Random, seen: Outcomes, where: str
) -> None:
    tokens, kind = prompt(rng), rng.random()
    with seen.step(where):
        if kind < 0.45:
            await client.store(tokens, kv_for(tenant, tokens), tenant=tenant)
        elif kind < 0.9:
            got = await client.load(tokens, tenant=tenant)
            seen.check(where, tenant, tokens, got.kv, got.num_tokens)
        else:
            await client.release(await client.prefetch(tokens, tenant=tenant))


# ---- threads on one Client ----------------------------------------------------------------


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "body"])
def test_threads_on_one_client_load_only_their_own_bytes_and_leave_no_lease(
    server: Server, shared_memory: bool
) -> None:
    """12 threads, one client, two tenants named per call (the same tokens, other bytes):
    every load bit-exact, no untyped error, and no lease left once the client is closed."""
    seen = Outcomes()
    client = Client(server.url, shared_memory=shared_memory, timeout_s=30)
    assert (client.pool_buffer("gpu") is not None) == shared_memory

    def worker(index: int) -> None:
        rng = random.Random(index)
        for step in range(50):
            tenant = rng.choice(("a", "b"))
            blocking_step(client, tenant, rng, seen, f"thread {index} step {step}")

    try:
        run_threads(12, worker)
    finally:
        client.close()
    assert_left_clean(server, seen)


def test_one_client_per_tenant_key_shared_by_threads_as_the_vllm_connector_does(
    keyed_server: Server,
) -> None:
    """Two keyed clients, 12 threads taking either: owed releases ride only on their own
    tenant's requests (another tenant's would be passed over, the lease held to its ttl)."""
    seen = Outcomes()
    clients = {
        "a": Client(keyed_server.url, api_key=KEY_A),
        "b": Client(keyed_server.url, api_key=KEY_B),
    }

    def worker(index: int) -> None:
        rng = random.Random(100 + index)
        for step in range(40):
            tenant = rng.choice(("a", "b"))
            blocking_step(clients[tenant], tenant, rng, seen, f"thread {index} step {step}")

    try:
        run_threads(12, worker)
    finally:
        for client in clients.values():
            client.close()
    assert_left_clean(keyed_server, seen)


# ---- tasks on one AsyncClient -------------------------------------------------------------


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "body"])
def test_tasks_on_one_async_client_load_only_their_own_bytes_and_leave_no_lease(
    server: Server, shared_memory: bool
) -> None:
    """24 tasks on one client (mapped at the first call, which they all race to), two
    tenants named per call."""
    seen = Outcomes()

    async def main() -> None:
        client = AsyncClient(server.url, shared_memory=shared_memory, timeout_s=30)

        async def task(index: int) -> None:
            rng = random.Random(200 + index)
            for step in range(20):
                tenant = rng.choice(("a", "b"))
                await async_step(client, tenant, rng, seen, f"task {index} step {step}")

        try:
            await gather_bounded(*(task(i) for i in range(24)))
        finally:
            await client.aclose()

    asyncio.run(main())
    assert_left_clean(server, seen)


# ---- close() while calls are under way -----------------------------------------------------


def prompts_stored(server: Server) -> list[list[int]]:
    """`TRUNKS` prompts of 3 blocks, stored for tenant "a"."""
    prompts = [[trunk * 1000 + j for j in range(3 * BT)] for trunk in range(TRUNKS)]
    with Client(server.url) as client:
        for tokens in prompts:
            client.store(tokens, kv_for("a", tokens), tenant="a")
    return prompts


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "body"])
def test_close_while_threads_load_and_store_leaves_no_lease_and_only_closed_errors(
    server: Server, shared_memory: bool
) -> None:
    """8 threads load and store until `close()` from another thread: it returns within the
    bound, every thread ends on a `ClosedError` (or a typed error of the server's) with
    nothing wrong loaded, and the server holds no lease (before, each close left the leases
    of the loads that ended after it, and those given back by a failed carrier, to their
    ttl: 3-5 a round)."""
    prompts = prompts_stored(server)
    for round_ in range(2):
        seen = Outcomes()
        client = Client(server.url, shared_memory=shared_memory, timeout_s=30)

        def worker(index: int, client: Client = client, seen: Outcomes = seen) -> None:
            rng = random.Random(400 + index)
            ended = False
            while not ended:  # the first error ends the thread
                tokens, where, ended = rng.choice(prompts), f"thread {index}", True
                with seen.step(where):
                    if rng.random() < 0.8:
                        got = client.load(tokens, tenant="a")
                        seen.check(where, "a", tokens, got.kv, got.num_tokens)
                    else:
                        client.store(tokens, kv_for("a", tokens), tenant="a")
                    ended = False

        closer = threading.Timer(0.15 + 0.05 * round_, client.close)
        closer.start()
        run_threads(8, worker)
        closer.join(BOUND_S)
        assert not closer.is_alive(), "close() hung"
        assert (seen.wrong[:5], seen.untyped[:5]) == ([], []), seen.typed
        assert seen.typed.get("ClosedError", 0) > 0, seen.typed
        assert live_leases(server) == 0, f"round {round_}: {seen.typed}"


def test_aclose_while_tasks_load_and_store_leaves_no_lease_and_only_closed_errors(
    server: Server,
) -> None:
    """As the threads' test, for 16 tasks on one `AsyncClient` (over HTTP too: a call after
    `aclose()` was httpx's bare RuntimeError)."""
    prompts = prompts_stored(server)

    async def main(shared_memory: bool, seen: Outcomes) -> None:
        client = AsyncClient(server.url, shared_memory=shared_memory, timeout_s=30)

        async def task(index: int) -> None:
            rng = random.Random(500 + index)
            ended = False
            while not ended:
                tokens, ended = rng.choice(prompts), True
                with seen.step(f"task {index}"):
                    if rng.random() < 0.7:
                        got = await client.load(tokens, tenant="a")
                        seen.check(f"task {index}", "a", tokens, got.kv, got.num_tokens)
                    elif rng.random() < 0.5:
                        await client.lookup(tokens, tenant="a")
                    else:
                        await client.store(tokens, kv_for("a", tokens), tenant="a")
                    ended = False

        async def closer() -> None:
            await asyncio.sleep(0.2)
            await client.aclose()

        await gather_bounded(closer(), *(task(i) for i in range(16)))

    for shared_memory in (True, False):
        seen = Outcomes()
        asyncio.run(main(shared_memory, seen))
        assert (seen.wrong[:5], seen.untyped[:5]) == ([], []), seen.typed
        assert seen.typed.get("ClosedError", 0) > 0, seen.typed
        assert live_leases(server) == 0, (shared_memory, seen.typed)


# ---- descriptors past select's FD_SETSIZE ---------------------------------------------------


@contextlib.contextmanager
def descriptors_past(number: int) -> Iterator[None]:
    """Every descriptor below `number` taken (by /dev/null), so that new sockets get higher
    ones, as in an engine process with many files open; skipped where the limit forbids."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = number + 256
    if soft < wanted and (hard == resource.RLIM_INFINITY or hard >= wanted):
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    elif soft < wanted:
        pytest.skip(reason=f"RLIMIT_NOFILE {soft}/{hard}: cannot open {number} descriptors")
    held: list[int] = []
    try:
        while not held or held[-1] < number:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("shared_memory", [True, False], ids=["lane", "http"])
def test_a_client_whose_sockets_are_past_descriptor_1024_reuses_its_connections(
    server: Server, shared_memory: bool
) -> None:
    """`select` refuses a descriptor past 1024 (a ValueError): every call after the first on
    a kept connection failed untyped, over HTTP and over the lane."""
    seen = Outcomes()
    with descriptors_past(1100):
        client = Client(server.url, shared_memory=shared_memory, timeout_s=30)
        try:

            def worker(index: int) -> None:
                rng = random.Random(300 + index)
                for step in range(10):
                    blocking_step(client, "a", rng, seen, f"thread {index} step {step}")

            run_threads(4, worker)
        finally:
            client.close()
    seen.assert_clean()
    assert live_leases(server) == 0


# ---- the longer soak -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_soak_threads_and_tasks_on_shared_clients(server: Server, seed: int) -> None:
    """16 threads on a shared-memory client and 32 tasks on an async one at the same time,
    many more steps."""
    seen = Outcomes()
    client = Client(server.url, timeout_s=60)

    async def tasks() -> None:
        shared = AsyncClient(server.url, timeout_s=60)

        async def task(index: int) -> None:
            rng = random.Random(seed * 1000 + 500 + index)
            for step in range(150):
                tenant = rng.choice(("a", "b"))
                await async_step(shared, tenant, rng, seen, f"task {index} step {step}")

        try:
            await gather_bounded(*(task(i) for i in range(32)))
        finally:
            await shared.aclose()

    def worker(index: int) -> None:
        if index == 16:
            asyncio.run(tasks())
            return
        rng = random.Random(seed * 1000 + index)
        for step in range(400):
            tenant = rng.choice(("a", "b"))
            blocking_step(client, tenant, rng, seen, f"thread {index} step {step}")

    try:
        run_threads(17, worker)
    finally:
        client.close()
    assert_left_clean(server, seen)
