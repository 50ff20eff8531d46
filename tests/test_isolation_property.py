"""Tenant isolation as a property of random schedules, in a real store with a disk tier.

Three tenants store, load, look up, prefetch, evict, persist and restart over token sequences
that share prefixes, each tenant writing different KV for the same tokens. A block's KV is a
function of its tenant and of every token up to the block's end (`block_kv`), so whatever copy
of a block a call is served from, gpu, host or disk, before or after a restart, the bytes it
must get are known. After every step:

- a `load` returns, block by block, exactly the KV its own tenant stored for that prefix: never
  another tenant's bytes, never a block its tenant did not store (a block may be gone: a
  shorter prefix is fine);
- a `lookup` and a prefetch's lease count no more than the tenant's own stored prefix, and the
  leased gpu slots hold the tenant's bytes;
- `store.check()` holds.

Seeded (`random.Random(seed)`) so that a failure replays; the default suite runs a few short
schedules, `-m slow` longer ones and the background mover.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch
from conftest import DISK_BLOCK_TOKENS, bits, disk_config, leased_kv

from kvtier.config import KVTierConfig
from kvtier.errors import CapacityError, QuotaError
from kvtier.store import KVStore

TENANTS = ("alice", "bob", "carol")
BT = DISK_BLOCK_TOKENS
PREFIXES = [[7000 + i for i in range(3 * BT)], [8000 + i for i in range(2 * BT)]]


def sequences(rng: random.Random) -> list[list[int]]:
    """Token sequences of 1-6 blocks, most of them below one of two shared prefixes."""
    made = []
    for i in range(8):
        head = PREFIXES[i % 2] if i < 6 else []
        tail = [100 * i + t for t in range(rng.randint(1, 3) * BT)]
        made.append(head + tail)
    return made


def block_kv(store: KVStore, tenant: str, tokens: list[int]) -> torch.Tensor:
    """The KV of the block that ends `tokens`, for `tenant`: `[layers, 2, BT, heads, dim]`."""
    digest = hashlib.blake2b(f"{tenant}:{tokens}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    layout = store.layout
    shape = (layout.num_layers, 2, BT, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=gen).to(layout.dtype)


def kv_of(store: KVStore, tenant: str, tokens: list[int]) -> torch.Tensor:
    """The KV of every full block of `tokens`, for `tenant`."""
    blocks = [block_kv(store, tenant, tokens[: b * BT]) for b in range(1, len(tokens) // BT + 1)]
    return torch.cat(blocks, dim=2)


def held_blocks(stored: set[tuple[int, ...]], tokens: list[int], bt: int = BT) -> int:
    """How many leading blocks of `bt` tokens of `tokens` are in `stored` (the prefixes a
    tenant stored)."""
    n = 0
    while n < len(tokens) // bt and tuple(tokens[: (n + 1) * bt]) in stored:
        n += 1
    return n


class Schedule:
    """One random schedule over a store of `config`, with what each tenant stored."""

    def __init__(self, config: KVTierConfig, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.seqs = sequences(self.rng)
        self.store = KVStore(config)
        self.stored: dict[str, set[tuple[int, ...]]] = {t: set() for t in TENANTS}
        self.seen = {"hits": 0, "hits after a restart": 0, "others' prefix, not its own": 0}
        self.restarted = False

    def held(self, tenant: str, tokens: list[int]) -> int:
        return held_blocks(self.stored[tenant], tokens)

    def step(self) -> str:
        rng, store = self.rng, self.store
        tenant, tokens = rng.choice(TENANTS), rng.choice(self.seqs)
        op = rng.choices(
            ["store", "load", "lookup", "prefetch", "evict", "persist", "restart"],
            weights=[6, 6, 2, 3, 2, 1, 1],
        )[0]
        if op == "store":
            store.store(tokens, kv_of(store, tenant, tokens), tenant=tenant)
            for b in range(1, len(tokens) // BT + 1):
                self.stored[tenant].add(tuple(tokens[: b * BT]))
        elif op == "load":
            loaded = store.load(tokens, tenant=tenant, device="cpu")
            n = loaded.num_tokens // BT
            assert n <= self.held(tenant, tokens), (tenant, tokens, n)
            self.seen["hits"] += n > 0
            self.seen["hits after a restart"] += n > 0 and self.restarted
            others = max(self.held(other, tokens) for other in TENANTS if other != tenant)
            self.seen["others' prefix, not its own"] += others > self.held(tenant, tokens)
            want = kv_of(store, tenant, tokens[: n * BT]) if n else loaded.kv
            assert torch.equal(bits(loaded.kv), bits(want)), f"{tenant} got bytes not its own"
        elif op == "lookup":
            found = store.lookup(tokens, tenant=tenant).num_tokens
            assert found // BT <= self.held(tenant, tokens)
        elif op == "prefetch":
            try:
                lease = store.prefetch(tokens, tenant=tenant)
            except (QuotaError, CapacityError):  # over its share of gpu: nothing leased
                self.store.check()
                return "refused"
            n = lease.num_tokens // BT
            assert n <= self.held(tenant, tokens)
            if n:
                got = leased_kv(store, lease)
                assert torch.equal(bits(got), bits(kv_of(store, tenant, tokens[: n * BT])))
            store.release(lease)
        elif op == "evict":
            store.evict(rng.choice(["gpu", "host"]), rng.randint(1, 4))
        elif op == "persist":
            store.persist()
        else:  # restart: what is on disk comes back under its tenant
            store.persist()
            store.close()
            self.store = KVStore(self.config)
            self.restarted = True
        self.store.check()
        return op

    def close(self) -> None:
        self.store.close()


def run(tmp_path: Path, seed: int, steps: int, background: bool = False) -> dict[str, int]:
    """Run a schedule; what it went through: its ops, and the cases `Schedule.seen` counts."""
    config = disk_config(
        tmp_path / "disk",
        capacity="512KiB",
        gpu_blocks=12,  # a share of 4 blocks a tenant: prefetches of more are refused
        host_blocks=12,
        tenants=TENANTS,
        background=background,
    )
    schedule = Schedule(config, seed)
    try:
        ops = [schedule.step() for _ in range(steps)]
    finally:
        schedule.close()
    return {**{op: ops.count(op) for op in set(ops)}, **schedule.seen}


@pytest.mark.parametrize("seed", range(4))
def test_no_schedule_serves_a_tenant_bytes_not_its_own(tmp_path: Path, seed: int) -> None:
    seen = run(tmp_path, seed, 200)
    # the schedule reached what it is about: hits, hits from disk after a restart, and loads of
    # a prefix another tenant stored and this one did not
    assert seen["restart"] >= 1 and seen["hits after a restart"] >= 1, seen
    assert seen["others' prefix, not its own"] >= 5, seen


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
@pytest.mark.parametrize("seed", range(4, 12))
def test_longer_schedules_and_the_background_mover(
    tmp_path: Path, seed: int, background: bool
) -> None:
    seen = run(tmp_path, seed, 1000, background)
    assert seen["restart"] >= 5 and seen["hits after a restart"] >= 20, seen
