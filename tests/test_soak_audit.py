"""A randomized soak of one `KVStore` with every feature on at once, from several threads.

What the other thread tests do not combine: each case in `CASES` runs a real disk tier (in
`tmp_path`; gpu 8 slots, host 12 (23 int8 payloads), disk 60: everything overflows), two or
three tenants with quotas and floors (some given, some the default share), a write policy
(write_through, write_back, selective), a background or inline mover (one with
`lift_on_lookup`), a disk codec (`none`, lossless `lz4`, lossy `int8`) and one an int8 host
tier; one case adds a remote tier (`redis_nodes`: skipped without redis-server). Four threads
(each its own `random.Random(seed)`: every thread's sequence of calls is reproducible, the
interleaving is not) store (whole prompts, tails with `start=`, pages with `layout="blocks"`;
token prompts and keyed chains, `KeyedPages`), look up, load (a new tensor or the caller's
`out`, with `start=`, `layout` layers or blocks), prefetch (wait; no wait, then wait, check,
load, release; cancel; abandon to expiry), reserve -> write the slots -> commit (or abort, or
commit half-written, or abandon to quarantine), evict, persist, drain, clear (a tenant's, all)
and status, while a checker runs `check()` every 20 ms.

What must hold:
- every byte a load, a lease's pages or a committed reservation serves is the KV of
  (tenant, the prompt's tokens up to that block): `Reference.block_kv`. KV depends on the
  tenant and on the whole prefix, so a block of another tenant or another prefix shows as wrong
  bytes. With a quantizing tier a block may also be the codec's round trip (once or twice);
- a tenant never hits a prompt only another tenant stored (`private` prompts);
- only typed refusals (`CapacityError`, `QuotaError`, `NotWrittenError` where expected;
  `ClosedError` / `LeaseError` once the store is closed under load);
- `check()` after every round and at the end; every join bounded (a hang dumps every
  thread's stack and fails); at the end no lease or reservation is left and, cleared, every
  tier's free slots are its capacity; the mover's steps raised nothing.

The default suite runs each case but the remote one for 2 x 0.9 s; `-m slow` runs the long one
of each (`KVTIER_SOAK_AUDIT_S` seconds per case, 20 by default). A finding is minimized into a
deterministic test of its own, below `# ---- what the soak found`.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import random
import sys
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.config import parse_config
from kvtier.errors import CapacityError, ClosedError, LeaseError, NotWrittenError
from kvtier.keyed import KeyedPages
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.store import KVStore

pytestmark = pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite

BT = 4
BLOCK_BYTES = 4096  # 2 layers, K|V, 4 tokens, 2 heads, 64 dims, fp16
MODEL = {"name": "soak", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16"}
SLOW_S = float(os.environ.get("KVTIER_SOAK_AUDIT_S", "20"))
THREADS = 4
QUARANTINE_S = 0.3


@dataclass(frozen=True)
class Case:
    write: str
    background: bool
    tenants: dict[str, Any]
    codec: str = "none"
    remote: bool = False
    seed: int = 0
    lift: bool = False  # mover.lift_on_lookup
    host_codec: str = "none"

    @property
    def lossy(self) -> str | None:
        """The quantizing codec of a tier, if one has (loads are then checked against it)."""
        lossy = [c for c in (self.host_codec, self.codec) if c not in ("none", "lz4")]
        return lossy[0] if lossy else None


FLOORS = {
    "a": {"quota": {"gpu": 0.75, "leases": 6}, "floor": {"gpu": 0.25, "host": 0.25}},
    "b": {"quota": {"gpu": 0.5}, "floor": {"gpu": 0.25}},
    "c": {},
}
CASES = {
    "write_through-bg-3tenants-lz4": Case("write_through", True, FLOORS, "lz4", seed=1),
    "write_back-inline-2tenants": Case("write_back", False, {"a": {}, "b": {}}, seed=2),
    "selective-bg-3tenants-lz4-lift": Case("selective", True, FLOORS, "lz4", seed=3, lift=True),
    "selective-inline-3tenants-lz4": Case("selective", False, FLOORS, "lz4", seed=4),
    "write_back-bg-2tenants-int8": Case("write_back", True, {"a": {}, "b": {}}, "int8", seed=5),
    "write_through-bg-3tenants-hostint8-lz4": Case(
        "write_through", True, FLOORS, "lz4", seed=7, host_codec="int8"
    ),
    "write_through-bg-2tenants-remote": Case(
        "write_through", True, {"a": {}, "b": {}}, remote=True, seed=6
    ),
}


def make_config(case: Case, disk: Path, nodes: list[str] | None) -> Any:
    tiers: dict[str, Any] = {
        "gpu": {"capacity": 8 * BLOCK_BYTES, "device": "cpu"},
        "host": {"capacity": 12 * BLOCK_BYTES, "pinned": False, "codec": case.host_codec},
        "disk": {"capacity": 40 * 3 * BLOCK_BYTES, "path": str(disk), "codec": case.codec},
    }
    for name in ("gpu", "host"):  # the background mover demotes by watermark too
        tiers[name].update(high_watermark=0.8, low_watermark=0.5)
    if nodes is not None:
        prefix = f"soak{os.getpid()}x{case.seed}x{time.monotonic_ns() % 10**9}"
        tiers["remote"] = {"nodes": nodes, "secret": "soak-secret-0123456789", "key_prefix": prefix}
    return parse_config(
        {
            "model": MODEL,
            "block_tokens": BT,
            "tiers": tiers,
            "policy": {
                "write": case.write,
                "selective_hits": 2,
                "disk_admission_hits": 0,
                "lease_ttl_s": 10.0,
                "reservation_quarantine_s": QUARANTINE_S,
            },
            "mover": {
                "background": case.background,
                "store_wait_s": 0.01,
                "lift_on_lookup": case.lift,
            },
            "tenants": case.tenants,
        }
    )


# ---- the KV of a (tenant, prefix), and what may be served for it ---------------------------


class Reference:
    """`block_kv(tenant, tokens, b)`: block b's KV, `[layers, 2, BT, heads, dim]`, a function
    of the tenant and tokens[: (b + 1) * BT] (a BLAKE2b of them seeds it). Small integers
    (lz4 shrinks them) unless `lossy`, whose codec's round trips `accepts` too."""

    def __init__(self, store: KVStore, lossy: str | None) -> None:
        self.shape = tuple(store.layout.block_shape)
        self.codec = None if lossy is None else QuantCodec(QuantSpec(lossy), store.layout)
        self._cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def block_kv(self, tenant: str, tokens: list[int], b: int) -> torch.Tensor:
        prefix = tuple(tokens[: (b + 1) * BT])
        found = self._cache.get((tenant, prefix))
        if found is not None:
            return found
        digest = hashlib.blake2b(tenant.encode() + array("I", prefix).tobytes(), digest_size=8)
        gen = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
        if self.codec is None:
            kv = (torch.randint(0, 16, self.shape, generator=gen) - 8).to(torch.float16)
        else:
            kv = torch.randn(self.shape, generator=gen).to(torch.float16)
        self._cache[(tenant, prefix)] = kv
        return kv

    def prompt_kv(self, tenant: str, tokens: list[int]) -> torch.Tensor:
        """`[layers, 2, len(tokens), heads, dim]`: the blocks' KV, then a partial tail's."""
        full = len(tokens) // BT
        parts = [self.block_kv(tenant, tokens, b) for b in range(full)]
        tail = len(tokens) - full * BT
        parts.append(torch.full((*self.shape[:2], tail, *self.shape[3:]), 3.0, dtype=torch.float16))
        return torch.cat(parts, dim=2)

    def accepts(self, got: torch.Tensor, want: torch.Tensor) -> bool:
        """`got` (one block) is `want`, bit for bit, or (lossy) its round trip, once or twice."""
        if torch.equal(got.view(torch.int16), want.view(torch.int16)):
            return True
        if self.codec is None:
            return False
        once = self.codec.decode(self.codec.encode(want[None]))
        twice = self.codec.decode(self.codec.encode(once))
        return any(
            torch.equal(got.view(torch.int16), c[0].view(torch.int16)) for c in (once, twice)
        )

    def check_blocks(self, what: str, tenant: str, tokens: list[int], first: int,
                     blocks: torch.Tensor) -> None:  # fmt: skip
        """`blocks` `[n, *block_shape]` are blocks first.. of (tenant, tokens)."""
        for i in range(blocks.shape[0]):
            want = self.block_kv(tenant, tokens, first + i)
            assert self.accepts(blocks[i], want), (
                f"{what}: wrong bytes in block {first + i} of {tenant}'s {tokens[:6]}..."
            )

    def check_layers(self, what: str, tenant: str, tokens: list[int], start: int,
                     kv: torch.Tensor) -> None:  # fmt: skip
        """`kv` `[layers, 2, tokens, heads, dim]` holds whole blocks from token `start` on."""
        n = kv.shape[2] // BT
        blocks = kv.reshape(kv.shape[0], 2, n, BT, *kv.shape[3:]).permute(2, 0, 1, 3, 4, 5)
        self.check_blocks(what, tenant, tokens, start // BT, blocks)


def prompts(tenants: list[str]) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """Prompts every tenant stores (families sharing a 2-block head, tails of 1-2 blocks, some
    with a partial block; two keyed chains), and each tenant's private ones (no one else
    stores them, everyone probes them)."""
    shared = []
    for f in range(6):
        head = [1000 * f + j for j in range(2 * BT)]
        for v in range(3):
            tail = [1000 * f + 100 * (v + 1) + j for j in range((1 + v % 2) * BT + v)]
            shared.append(head + tail)
    keyed = KeyedPages(8, "soak")
    shared += [keyed.tokens([b"k0", b"k1", b"k2"]), keyed.tokens([b"k0", b"k1", b"k3"])]
    private = {
        t: [[60000 + 1000 * i + 100 * p + j for j in range(3 * BT)] for p in range(2)]
        for i, t in enumerate(tenants)
    }
    return shared, private


# ---- what the soak found, each on its own ------------------------------------------------


def test_a_commit_below_a_prefix_stored_and_demoted_since_the_reserve_keeps_prefix_closure(
    tmp_path: Path,
) -> None:
    """A reservation of 3 new blocks (gpu slots); meanwhile another writer stores the first 2
    of them, and they are demoted to host. The commit must not hang its third block on gpu
    below a parent that is only on host (DESIGN invariant 3): it was an `AssertionError` in
    the index (`new blocks would break prefix closure`), and with `python -O` a broken index."""
    case = Case("write_back", False, {"default": {}})
    store = KVStore(make_config(case, tmp_path / "disk", None))
    try:
        ref = Reference(store, None)
        tokens = [7000 + j for j in range(3 * BT)]
        r = store.reserve(tokens, ttl_s=5.0)
        assert (r.tier, r.cached_tokens, r.num_tokens) == ("gpu", 0, 3 * BT)
        store.store(tokens[: 2 * BT], ref.prompt_kv("default", tokens[: 2 * BT]))
        assert store.evict("gpu", 2) == 2  # the head leaves gpu; the reserved slots stay
        assert store.lookup(tokens).gpu_tokens == 0
        for i, slot in enumerate(r.slots):
            store.gpu_pool.buffer[slot] = ref.block_kv("default", tokens, i)
        result = store.commit(r)
        store.check()
        assert result.cached_tokens + result.dropped_tokens == 3 * BT, result
        loaded = store.load(tokens)
        assert loaded.num_tokens == result.cached_tokens
        ref.check_layers("load", "default", tokens, 0, loaded.kv)
        store.clear()
        assert [p.num_free for p in store.pools] == [p.num_slots for p in store.pools]
    finally:
        store.close()


# ---- the soak -----------------------------------------------------------------------------


class Soak:
    """One store, its reference and the threads' counts; `op(rng)` is one random call."""

    def __init__(self, store: KVStore, ref: Reference, tenants: list[str]) -> None:
        self.store, self.ref, self.tenants = store, ref, tenants
        self.shared, self.private = prompts(tenants)
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def op(self, rng: random.Random) -> None:
        tenant = rng.choice(self.tenants)
        pool = self.shared + self.private[tenant]
        tokens = rng.choice(pool)
        x = rng.random()
        table: list[tuple[float, Callable[[random.Random, str, list[int]], None]]] = [
            (0.22, self.do_store),
            (0.30, self.do_store_tail),
            (0.34, self.do_probe),
            (0.48, self.do_load),
            (0.56, self.do_load_out),
            (0.70, self.do_prefetch),
            (0.80, self.do_prefetch_nowait),
            (0.92, self.do_reserve),
            (0.965, self.do_evict),
            (0.985, self.do_status),
            (1.01, self.do_clear),
        ]
        for edge, action in table:
            if x < edge:
                action(rng, tenant, tokens)
                return

    def do_store(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        kv = self.ref.prompt_kv(tenant, tokens)
        full = len(tokens) // BT
        if rng.random() < 0.3:  # pages, the last one partly filled when the prompt is
            pages = -(-len(tokens) // BT)
            padded = torch.zeros((*kv.shape[:2], pages * BT, *kv.shape[3:]), dtype=kv.dtype)
            padded[:, :, : len(tokens)] = kv
            blocks = padded.reshape(kv.shape[0], 2, pages, BT, *kv.shape[3:])
            result = self.store.store(tokens, blocks.permute(2, 0, 1, 3, 4, 5), tenant=tenant,
                                      layout="blocks")  # fmt: skip
        else:
            result = self.store.store(tokens, kv, tenant=tenant)
        assert result.cached_tokens <= full * BT and result.cached_tokens % BT == 0, result
        self.count("store")

    def do_store_tail(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        full = len(tokens) // BT
        start = rng.randrange(1, full + 1) * BT
        kv = self.ref.prompt_kv(tenant, tokens)[:, :, start:]
        result = self.store.store(tokens, kv, tenant=tenant, start=start)
        assert result.cached_tokens <= full * BT, result
        self.count("store_tail")

    def do_probe(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        """Lookups, and another tenant's private prompt: never a hit."""
        hit = self.store.lookup(tokens, tenant=tenant)
        assert hit.num_tokens % BT == 0 and hit.num_tokens <= len(tokens), hit
        others = [t for t in self.tenants if t != tenant]
        theirs = rng.choice(self.private[rng.choice(others)])
        assert self.store.lookup(theirs, tenant=tenant).num_tokens == 0, "another tenant's hit"
        assert self.store.load(theirs, tenant=tenant).num_tokens == 0, "another tenant's load"
        self.count("probe")

    def do_load(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        start = rng.randrange(0, len(tokens) // BT + 1) * BT
        if rng.random() < 0.3:  # pages `[blocks, *block_shape]`
            loaded = self.store.load(tokens, tenant=tenant, start=start, layout="blocks")
            n = loaded.num_tokens
            assert loaded.kv.shape[0] == max(0, n - start) // BT, (loaded.kv.shape, n, start)
            self.ref.check_blocks("load(blocks)", tenant, tokens, start // BT, loaded.kv)
        else:
            loaded = self.store.load(tokens, tenant=tenant, start=start)
            n = loaded.num_tokens
            assert loaded.kv.shape[2] == max(0, n - start), (loaded.kv.shape, n, start)
            self.ref.check_layers("load", tenant, tokens, start, loaded.kv)
        assert n % BT == 0 and n <= len(tokens), n
        self.count("load")

    def do_load_out(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        start = rng.randrange(0, len(tokens) // BT + 1) * BT
        shape = (2, 2, len(tokens) - start, 2, 64)
        out = torch.full(shape, -777.0, dtype=torch.float16)
        loaded = self.store.load(tokens, tenant=tenant, start=start, out=out)
        held = max(0, loaded.num_tokens - start)
        assert loaded.kv.data_ptr() == out.data_ptr() or held == 0
        self.ref.check_layers("load(out=)", tenant, tokens, start, out[:, :, :held])
        assert bool((out[:, :, held:] == -777.0).all()), "load wrote past the prefix into out"
        self.count("load_out")

    def check_lease_pages(self, what: str, tenant: str, tokens: list[int], lease: Any) -> None:
        pages = self.store.gpu_pool.buffer[list(lease.block_table)]
        assert lease.num_tokens == len(lease.block_table) * BT
        self.ref.check_blocks(what, tenant, tokens, 0, pages)

    def do_prefetch(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        try:
            lease = self.store.prefetch(tokens, tenant=tenant, ttl_s=10.0)
        except CapacityError:  # QuotaError too
            self.count("prefetch_refused")
            return
        self.check_lease_pages("prefetch", tenant, tokens, lease)
        self.store.release(lease)
        self.count("prefetch")

    def do_prefetch_nowait(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        abandon = rng.random() < 0.2
        try:
            lease = self.store.prefetch(tokens, tenant=tenant, ttl_s=0.2 if abandon else 10.0,
                                        wait=False)  # fmt: skip
        except CapacityError:
            self.count("prefetch_refused")
            return
        if abandon:  # left to expire
            self.count("abandoned")
            return
        if rng.random() < 0.3:
            try:
                self.store.cancel(lease)
            except LeaseError:  # only if it was released already: never
                raise AssertionError(f"cancel of a live lease refused: {lease.state}") from None
            self.count("cancelled")
            return
        assert lease.wait(20), f"a lease stayed {lease.state} for 20 s"
        self.check_lease_pages("prefetch(wait=False)", tenant, tokens, lease)
        loaded = self.store.load(tokens, tenant=tenant)  # a leased prefix stays cached
        assert loaded.num_tokens >= lease.num_tokens, (loaded.num_tokens, lease.num_tokens)
        self.ref.check_layers("load under a lease", tenant, tokens, 0, loaded.kv)
        self.store.release(lease)
        self.count("prefetch_nowait")

    def do_reserve(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        how = rng.random()
        abandon = 0.3 <= how < 0.35  # left to expire, then to quarantine
        try:
            r = self.store.reserve(tokens, tenant=tenant, ttl_s=0.3 if abandon else 5.0)
        except CapacityError:  # QuotaError
            self.count("reserve_refused")
            return
        if r.num_tokens == 0:
            self.count("reserve_empty")
            return
        pool = next(p for p in self.store.pools if p.name == r.tier)
        first = r.cached_tokens // BT
        buffer = pool.buffer  # type: ignore[attr-defined]
        written = r.slots if how >= 0.15 else r.slots[:-1]
        for i, slot in enumerate(written):
            buffer[slot] = self.ref.block_kv(tenant, tokens, first + i)
        if how < 0.15:  # half-written: refused, still live, then aborted
            with pytest.raises(NotWrittenError):
                self.store.commit(r)
            self.store.abort(r)
            self.count("reserve_half")
        elif how < 0.3:
            self.store.abort(r)
            self.count("reserve_abort")
        elif abandon:
            self.count("reserve_abandoned")
        else:
            result = self.store.commit(r)  # blocks may be dropped (closure), never lost
            whole = len(tokens) // BT * BT  # a store's sum: those it had no room for dropped too
            assert result.cached_tokens + result.dropped_tokens == whole, (result, r)
            self.count("commit")

    def do_evict(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        """Evict mostly; now and then a checkpoint or a drain, as an operator would."""
        x = rng.random()
        if x < 0.1:
            self.store.persist()
        elif x < 0.2:
            assert self.store.drain(30), "drain took over 30 s"
        else:
            self.store.evict(rng.choice(["gpu", "host", "disk"]), rng.randrange(1, 4))
        self.count("evict")

    def do_status(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        status = self.store.status(tenant if rng.random() < 0.5 else None)
        assert isinstance(status, dict)
        self.count("status")

    def do_clear(self, rng: random.Random, tenant: str, tokens: list[int]) -> None:
        self.store.clear(tenant if rng.random() < 0.7 else None)
        self.count("clear")


def run_round(soak: Soak, seeds: list[int], seconds: float) -> None:
    """`THREADS` workers (thread i: `random.Random(seeds[i])`) and a checker for `seconds`;
    a thread still alive 60 s after the end dumps every stack and fails the test."""
    stop = time.monotonic() + seconds
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop and not errors:
                soak.op(rng)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    def checker() -> None:
        try:
            while time.monotonic() < stop and not errors:
                soak.store.check()
                time.sleep(0.02)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in seeds]
    threads.append(threading.Thread(target=checker, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, stop - time.monotonic()) + 60)
        if thread.is_alive():
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            pytest.fail("a thread is stuck (stacks above)")
    if errors:
        raise errors[0]
    soak.store.check()


def finish(store: KVStore) -> None:
    """No lease or reservation left once the short ones expire; cleared, every tier empty."""
    assert store.drain(30), "the mover did not drain in 30 s"
    deadline = time.monotonic() + 15
    while (store.leases() or len(store.reservations)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.leases() == [], store.leases()
    time.sleep(QUARANTINE_S + 0.05)  # abandoned reservations leave quarantine
    store.clear()
    store.check()
    assert len(store.reservations) == 0
    status = store.status()
    for pool in store.pools:
        assert pool.num_free == pool.num_slots, (pool.name, pool.num_free, pool.num_slots)
    assert store.index.num_blocks == 0
    assert status["mover"]["step_errors"] == 0, status["mover"].get("last_error")


def soak(case: Case, tmp_path: Path, nodes: list[str] | None, rounds: int, seconds: float) -> None:
    store = KVStore(make_config(case, tmp_path / "disk", nodes))
    try:
        tenants = list(case.tenants)
        ref = Reference(store, case.lossy)
        soak_ = Soak(store, ref, tenants)
        for r in range(rounds):
            seeds = [case.seed * 1000 + r * THREADS + i for i in range(THREADS)]
            run_round(soak_, seeds, seconds)
        finish(store)
        status = store.status()
        print(case, soak_.counts, status["tiers"]["disk"].get("bytes_in"))
        assert status["tiers"]["disk"]["bytes_in"] > 0, "nothing reached disk"
        assert soak_.counts.get("commit", 0) > 0 and soak_.counts.get("prefetch", 0) > 0
    finally:
        store.close()


def nodes_for(case: Case, request: pytest.FixtureRequest) -> list[str] | None:
    if not case.remote:
        return None
    nodes: list[str] = request.getfixturevalue("redis_nodes")
    return nodes


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case.remote])
def test_soak(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    case = CASES[name]
    soak(case, tmp_path, nodes_for(case, request), rounds=2, seconds=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_soak_long(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    case = CASES[name]
    rounds = max(2, int(SLOW_S // 5))
    soak(case, tmp_path, nodes_for(case, request), rounds=rounds, seconds=SLOW_S / rounds)


def test_close_under_load_ends_every_call_typed(tmp_path: Path) -> None:
    """`close()` while four threads call: each call either works (bytes exact) or raises
    `ClosedError` (`LeaseError` for a lease the close ended); no thread hangs."""
    case = CASES["write_through-bg-3tenants-lz4"]
    store = KVStore(make_config(case, tmp_path / "disk", None))
    soak_ = Soak(store, Reference(store, None), list(case.tenants))
    errors: list[BaseException] = []
    ended: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while True:
                soak_.op(rng)
        except (ClosedError, LeaseError) as exc:
            ended.append(exc)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(900 + i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.7)
    store.close()
    for thread in threads:
        thread.join(60)
        if thread.is_alive():
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            pytest.fail("a thread is stuck after close (stacks above)")
    if errors:
        raise errors[0]
    assert len(ended) == 4
