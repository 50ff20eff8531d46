"""KVStore against a reference model: random store / lookup / load / prefetch / release / evict /
clock steps on one tiny store (gpu 6 blocks, host 10), with `check()` and the model's claims
verified after every step.

The reference holds the KV of every block ever stored, keyed by the token prefix that ends with
the block. Whatever the store reports as cached must be a prefix it was given, and must load as
exactly the reference KV; a live lease's gpu slots must hold exactly its prefix's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from conftest import build_store, kv_for, leased_kv
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.errors import CapacityError, LeaseError
from kvtier.results import Lease
from kvtier.store import KVStore

BT = 4
GPU_BLOCKS, HOST_BLOCKS = 6, 10
Prefix = tuple[int, ...]

# A sequence is up to 5 blocks, each one of 3 letters, then up to 3 tokens of a partial block:
# with so few letters, sequences share prefixes and branch often.
letters = st.lists(st.integers(0, 2), max_size=5)
tails = st.lists(st.just(7), max_size=3)


def tokens_of(blocks: list[int], tail: list[int]) -> list[int]:
    tokens = [10 * letter + j for letter in blocks for j in range(BT)] + tail
    return tokens or [7]


@dataclass
class HeldLease:
    lease: Lease
    prefix: Prefix  # the leased tokens
    expires_at: float


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = [0.0]
        self.reference: dict[Prefix, torch.Tensor] = {}  # prefix ending a block -> its KV
        self.held: list[HeldLease] = []
        self.released: list[int] = []
        self.store: KVStore | None = None

    @initialize(write=st.sampled_from(["write_through", "write_back", "selective"]))
    def build(self, write: str) -> None:
        self.store = build_store(
            gpu_blocks=GPU_BLOCKS, host_blocks=HOST_BLOCKS, write=write, clock=lambda: self.now[0]
        )

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()

    @property
    def s(self) -> KVStore:
        assert self.store is not None
        return self.store

    # ---- the reference ---------------------------------------------------------------------

    def expected_kv(self, tokens: list[int], num_tokens: int) -> torch.Tensor:
        """The reference KV of the first `num_tokens` (whole blocks) of `tokens`."""
        blocks = []
        for end in range(BT, num_tokens + 1, BT):
            prefix = tuple(tokens[:end])
            assert prefix in self.reference, f"cached prefix {prefix} was never stored"
            blocks.append(self.reference[prefix])
        layout = self.s.layout
        if not blocks:
            shape = (layout.num_layers, 2, 0, layout.num_kv_heads, layout.head_dim)
            return torch.empty(shape, dtype=layout.dtype)
        return torch.cat(blocks, dim=2)

    def verify_cached(self, tokens: list[int]) -> int:
        """lookup and load agree with each other and with the reference; the cached length."""
        hit = self.s.lookup(tokens)
        assert hit.num_tokens % BT == 0 and hit.num_tokens <= len(tokens) // BT * BT
        assert hit.gpu_tokens + hit.host_tokens + hit.disk_tokens == hit.num_tokens
        loaded = self.s.load(tokens, device="cpu")
        assert loaded.num_tokens == hit.num_tokens
        assert torch.equal(loaded.kv, self.expected_kv(tokens, hit.num_tokens))
        return hit.num_tokens

    def live(self) -> list[HeldLease]:
        return [h for h in self.held if h.expires_at > self.now[0]]

    # ---- rules -----------------------------------------------------------------------------

    @rule(blocks=letters, tail=tails, seed=st.integers(0, 2**16))
    def store_sequence(self, blocks: list[int], tail: list[int], seed: int) -> None:
        tokens = tokens_of(blocks, tail)
        full = len(tokens) // BT * BT
        kv = kv_for(self.s, len(tokens), seed)
        result = self.s.store(tokens, kv)
        assert result.cached_tokens + result.dropped_tokens == full
        # whole blocks; one short of room keeps its first ones (`writes.place`), the rest dropped
        assert result.stored_tokens % BT == 0 and result.dropped_tokens % BT == 0
        already = result.cached_tokens - result.stored_tokens
        if result.dropped_tokens:
            event("store dropped")
        for end in range(BT, already + 1, BT):
            assert tuple(tokens[:end]) in self.reference, "a cached prefix that was never stored"
        for end in range(already + BT, result.cached_tokens + 1, BT):
            self.reference[tuple(tokens[:end])] = kv[:, :, end - BT : end].clone()
        assert self.verify_cached(tokens) == result.cached_tokens

    @rule(blocks=letters, tail=tails)
    def lookup_and_load(self, blocks: list[int], tail: list[int]) -> None:
        self.verify_cached(tokens_of(blocks, tail))

    @rule(blocks=letters, tail=tails, ttl=st.sampled_from([1.0, 5.0, 30.0]))
    def prefetch(self, blocks: list[int], tail: list[int], ttl: float) -> None:
        tokens = tokens_of(blocks, tail)
        cached = self.s.lookup(tokens).num_tokens
        before = {lease.lease_id for lease in self.s.leases()}
        try:
            lease = self.s.prefetch(tokens, ttl_s=ttl)
        except CapacityError:
            event("prefetch refused")
            assert {lease.lease_id for lease in self.s.leases()} == before
            assert self.s.lookup(tokens).num_tokens == cached
            return
        assert lease.num_tokens == cached
        assert len(lease.block_table) == cached // BT
        assert lease.expires_at == self.now[0] + ttl
        assert self.s.lookup(tokens).gpu_tokens == cached
        self.held.append(HeldLease(lease, tuple(tokens[:cached]), lease.expires_at))

    @rule(pick=st.integers(0, 2**16), again=st.booleans())
    def release(self, pick: int, again: bool) -> None:
        if again and self.released:
            lease_id = self.released[pick % len(self.released)]
            try:
                self.s.release(lease_id)
            except LeaseError:
                return
            raise AssertionError(f"lease {lease_id} released twice")
        if not self.held:
            return
        held = self.held.pop(pick % len(self.held))
        self.released.append(held.lease.lease_id)
        if held.expires_at <= self.now[0]:
            try:
                self.s.release(held.lease)
            except LeaseError:
                return
            raise AssertionError(f"expired lease {held.lease.lease_id} released")
        self.s.release(held.lease)

    @rule(tier=st.sampled_from(["gpu", "host"]), n=st.integers(0, 8))
    def evict(self, tier: str, n: int) -> None:
        pool = self.s.pools[self.s.tier_names.index(tier)]
        used = pool.num_used
        freed = self.s.evict(tier, n)
        assert 0 <= freed <= n
        assert pool.num_used == used - freed

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def advance_clock(self, dt: float) -> None:
        self.now[0] += dt

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def store_checks(self) -> None:
        if self.store is not None:
            self.s.check()

    @invariant()
    def leases_hold_what_was_prefetched(self) -> None:
        if self.store is None:
            return
        live = self.live()
        assert self.s.leases() == [h.lease for h in live]
        leased_blocks: set[Prefix] = set()
        for held in live:
            table = held.lease.block_table
            assert len(table) * BT == held.lease.num_tokens == len(held.prefix)
            tokens = list(held.prefix)
            expected = self.expected_kv(tokens, len(tokens))
            assert torch.equal(leased_kv(self.s, held.lease), expected)
            leased_blocks.update(held.prefix[:end] for end in range(BT, len(tokens) + 1, BT))
        assert self.s.status()["tiers"]["gpu"]["leased_blocks"] == len(leased_blocks)
        assert self.s.status()["tiers"]["host"]["leased_blocks"] == 0


StoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_store_against_reference = StoreMachine.TestCase
