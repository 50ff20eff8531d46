"""Audit AJ of the radix index and its eviction: hit counts per block, and the index against a
brute-force model (recency, fair-share ranks, runs, restore).

A leaf that an insert extends used to hand its hit count to the new blocks, which no lookup had
walked: with `disk_admission_hits: 1` a block stored once, never reused, was written to disk
when it hung from a leaf (and dropped when it hung from a branch). `Node.steps` keeps the
earlier blocks' counts apart (`index/node.py`).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import disk_config
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from index_blocks import BT, Block, find, key, name

from kvtier.blocks import BlockHasher, encode_tokens, tenant_salt
from kvtier.errors import InvariantError
from kvtier.index import BlockRef, Node, PrefixHit, RadixIndex
from kvtier.index import node as node_module
from kvtier.index.restore import RestoreEntry, restore_namespace
from kvtier.store import KVStore


def block_hits(ref: BlockRef) -> int:
    """The index's count of walks through a block (before the fix: its node's count)."""
    count = getattr(node_module, "block_hits", None)
    return int(count(ref)) if count is not None else ref.node.hits


def kv(n_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, n_tokens, 2, 64), generator=gen).half()


def test_a_block_appended_to_a_walked_leaf_is_not_admitted_to_disk(tmp_path: Path) -> None:
    """Store A, then A+B (A's leaf is extended by B): B was never looked up, so at demotion it
    is dropped, as it is when A has another child; A, walked by the second store, goes to disk."""
    store = KVStore(disk_config(tmp_path, admission_hits=1, gpu_blocks=8, host_blocks=8))
    a, b = list(range(16)), list(range(1000, 1016))
    store.store(a, kv(16))
    store.store(a + b, kv(32, 1))
    store.evict("gpu", 100)
    store.evict("host", 100)
    store.check()
    hit = store.lookup(a + b)
    assert (hit.num_tokens, hit.disk_tokens) == (16, 16)
    store.close()


def test_hit_counts_stay_per_block_across_extension_split_and_cut() -> None:
    hasher = BlockHasher()
    seed = hasher.seed(b"layout-fingerprt", tenant_salt("t"))
    ix = RadixIndex(("gpu", "host"), block_tokens=1, hasher=hasher)
    ix.insert(ix.match(seed, encode_tokens([1, 2, 3])), encode_tokens([1, 2, 3]), {0: [0, 1, 2]})
    ix.lookup(seed, encode_tokens([1, 2, 3]))  # A walked once; the match below, twice
    grown = encode_tokens([1, 2, 3, 4, 5])
    end = ix.insert(ix.match(seed, grown), grown, {0: [3, 4]}).end
    assert end.size == 5  # the leaf was extended, not given a child
    assert [block_hits(BlockRef(end, i)) for i in range(5)] == [2, 2, 2, 0, 0]
    # a run of victims holds blocks of one count: B's two, then A's three
    run = next(iter(ix.victim_runs(0)))
    assert (run.node, run.lo, run.hi) == (end, 3, 5)
    ix.drop_tail(end, 2)
    assert (end.size, end.hits) == (3, 2)
    ix.check()
    # a lookup that ends inside the extended leaf splits it: each part keeps its blocks' counts
    end = ix.insert(ix.match(seed, grown), grown, {0: [3, 4]}).end
    ix.lookup(seed, encode_tokens([1, 2, 3, 4]))
    head = end.parent
    assert head is not None and (head.size, end.size) == (4, 1)
    counts = [block_hits(BlockRef(head, i)) for i in range(4)] + [block_hits(BlockRef(end, 0))]
    assert counts == [4, 4, 4, 1, 0]
    ix.check()


def test_check_formats_no_message_for_a_consistent_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check()` runs after every step of the tests and on `kvtier check`: it used to format a
    message (with the node's repr) for every node and child that passed, half its time."""
    hasher = BlockHasher()
    seed = hasher.seed(b"layout-fingerprt", tenant_salt("t"))
    ix = RadixIndex(("gpu", "host"), block_tokens=1, hasher=hasher)
    slot = 0
    for tokens in ([1, 2, 3], [1, 2, 4], [1, 5], [6]):
        match = ix.match(seed, encode_tokens(tokens))
        new = len(tokens) - match.num_blocks
        ix.insert(match, encode_tokens(tokens), {0: list(range(slot, slot + new))})
        slot += new
    reprs: list[Node] = []
    real = Node.__repr__

    def counted(node: Node) -> str:
        reprs.append(node)
        return real(node)

    monkeypatch.setattr(Node, "__repr__", counted)
    ix.check()
    assert reprs == []
    leaf = ix.match(seed, encode_tokens([6])).end
    leaf.held = 5  # a failure still names the node and the numbers that disagree
    with pytest.raises(InvariantError, match=r"Node\(size=1, .*\): held 5 != held locks 0"):
        ix.check()


# ---- the index against a brute-force model --------------------------------------------------

TIERS = ("gpu", "host", "disk")
LOWEST = len(TIERS) - 1
HASHER = BlockHasher()
SEEDS = [HASHER.seed(b"layout-fingerprt", tenant_salt(t)) for t in ("alice", "bob", "carol")]
NS = len(SEEDS)
paths = st.text(alphabet="abcd", min_size=1, max_size=6)
tiers = st.integers(0, LOWEST)
owners = st.one_of(st.none(), st.integers(0, NS - 1))


class ModelIndex(RuleBasedStateMachine):
    """Every block's copies, last use (a counter of walks) and hits in plain dicts; each victim
    offered must be a leaf of its tier, unleased, of the best fair-share rank, least recently
    used among those (ties allowed), whatever the node shapes (`node_blocks` 1 to unbounded)."""

    @initialize(node_blocks=st.sampled_from([1, 2, 3, 1 << 20]))
    def start(self, node_blocks: int) -> None:
        self.ix = RadixIndex(TIERS, block_tokens=BT, hasher=HASHER, node_blocks=node_blocks)
        self.copies: dict[Block, dict[int, int]] = {}
        self.used: dict[Block, int] = {}
        self.hits: dict[Block, int] = {}
        self.clock = 0
        self.slots = [0] * len(TIERS)
        self.leases: dict[int, tuple[int, str, tuple[int, ...]]] = {}
        self.floors: dict[int, tuple[int, ...]] = {}

    def slot(self, tier: int) -> int:
        self.slots[tier] += 1
        return self.slots[tier]

    def fastest(self, block: Block) -> int:
        return min(self.copies[block]) if block[1] else 0

    def cached(self, ns: int, path: str) -> int:
        return next(n for n in range(len(path), -1, -1) if n == 0 or (ns, path[:n]) in self.copies)

    def children(self, block: Block) -> list[Block]:
        return [(block[0], block[1] + c) for c in "abcd" if (block[0], block[1] + c) in self.copies]

    def leased(self, block: Block, tier: int) -> bool:
        return any(
            ns == block[0] and path.startswith(block[1]) and tier in leased
            for ns, path, leased in self.leases.values()
        )

    def walk(self, ns: int, path: str, n: int) -> None:
        self.clock += 1
        for i in range(1, n + 1):
            self.used[(ns, path[:i])] = self.clock
            self.hits[(ns, path[:i])] += 1

    def find(self, block: Block) -> BlockRef:
        return find(self.ix, SEEDS, block)

    def name(self, ref: BlockRef) -> Block:
        return name(self.ix, SEEDS, ref)

    def resident_in(self, ns: int, tier: int) -> int:
        return sum(1 for b, c in self.copies.items() if b[0] == ns and tier in c)

    def rank(self, ns: int, tier: int, owner: int | None) -> int | None:
        floor = self.floors.get(ns)
        if floor is None or self.resident_in(ns, tier) > floor[tier]:
            return 0
        return 1 if ns == owner else None

    def expect_victim(self, block: Block, tier: int, owner: int | None) -> None:
        """`block` is the next victim the model allows, and leaves its `tier` copy."""
        best: list[tuple[int, int, Block]] = []
        for b, c in self.copies.items():
            leaf = all(self.fastest(child) > tier for child in self.children(b))
            rank = self.rank(b[0], tier, owner)
            if min(c) == tier and leaf and not self.leased(b, tier) and rank is not None:
                best.append((rank, self.used[b], b))
        assert best, f"{block} offered, none expected"
        mine = [(r, u) for r, u, b in best if b == block]
        assert mine and mine[0] == min((r, u) for r, u, _ in best), (block, sorted(best)[:4])
        if tier == LOWEST:
            del self.copies[block]
        else:
            self.copies[block].setdefault(tier + 1, self.slot(tier + 1))
            self.copies[block].pop(tier)

    def expect_dry(self, tier: int, owner: int | None) -> None:
        for b, c in self.copies.items():
            if min(c) == tier and not self.leased(b, tier) and self.rank(b[0], tier, owner) == 0:
                assert any(self.fastest(child) <= tier for child in self.children(b)), b

    @rule(ns=st.integers(0, NS - 1), path=paths, fastest=tiers, more=st.sets(tiers))
    def insert(self, ns: int, path: str, fastest: int, more: set[int]) -> None:
        match = self.ix.match(SEEDS[ns], key(path))
        cached = self.cached(ns, path)
        assert match.num_blocks == cached
        self.walk(ns, path, cached)
        fastest = max(fastest, self.fastest((ns, path[:cached])))
        chosen = sorted({fastest} | {t for t in more if t > fastest})
        new = path[cached:]
        slots = {t: [self.slot(t) for _ in new] for t in chosen}
        assert self.ix.insert(match, key(path), slots).new_blocks == len(new)
        for i in range(len(new)):
            block = (ns, path[: cached + i + 1])
            self.copies[block] = {t: s[i] for t, s in slots.items()}
            self.hits[block] = 0
            self.used[block] = self.clock

    @rule(data=st.data(), ns=st.integers(0, NS - 1), suffix=paths, fastest=tiers)
    def grow(self, data: st.DataObject, ns: int, suffix: str, fastest: int) -> None:
        """Extend a cached leaf (where the index appends to a node rather than hang a child)."""
        leaves = sorted(p for n, p in self.copies if n == ns and not self.children((n, p)))
        if leaves:
            self.insert(ns, data.draw(st.sampled_from(leaves)) + suffix[:2], fastest, set())

    @rule(ns=st.integers(0, NS - 1), path=paths)
    def lookup(self, ns: int, path: str) -> None:
        cached = self.cached(ns, path)
        counts = [0] * len(TIERS)
        for n in range(1, cached + 1):
            counts[self.fastest((ns, path[:n]))] += 1
        assert self.ix.lookup(SEEDS[ns], key(path)) == PrefixHit(cached, tuple(counts))
        self.walk(ns, path, cached)

    @precondition(lambda self: self.copies)
    @rule(data=st.data(), tier=tiers)
    def promote(self, data: st.DataObject, tier: int) -> None:
        block = data.draw(st.sampled_from(sorted(self.copies)))
        parent = (block[0], block[1][:-1])
        if tier in self.copies[block] or self.fastest(parent) > tier < self.fastest(block):
            return  # a copy there already, or one that would hang below a slower parent
        self.copies[block][tier] = self.slot(tier)
        self.ix.set_slot(self.find(block), tier, self.copies[block][tier])

    @rule(data=st.data(), ns=st.integers(0, NS - 1))
    def lease(self, data: st.DataObject, ns: int) -> None:
        cached = sorted(p for n, p in self.copies if n == ns)
        if not cached:
            return
        path = data.draw(st.sampled_from(cached))
        match = self.ix.match(SEEDS[ns], key(path))
        self.walk(ns, path, match.num_blocks)
        whole = [
            t
            for t in range(len(TIERS))
            if all(t in self.copies[(ns, path[:n])] for n in range(1, len(path) + 1))
        ]
        if whole:
            leased = tuple(sorted(data.draw(st.sets(st.sampled_from(whole), min_size=1))))
            record = self.ix.leases.acquire(match.end, leased, math.inf, match.num_blocks)
            self.leases[record.lease_id] = (ns, path, leased)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        self.ix.leases.release(lease_id)  # type: ignore[arg-type]
        del self.leases[lease_id]

    @rule(floors=st.dictionaries(st.integers(0, NS - 1), st.tuples(*[st.integers(0, 4)] * 3)))
    def set_floors(self, floors: dict[int, tuple[int, ...]]) -> None:
        self.floors = floors
        self.ix.set_floors({SEEDS[ns]: floor for ns, floor in floors.items()})

    @rule(tier=tiers, budget=st.integers(1, 12), owner=owners)
    def evict(self, tier: int, budget: int, owner: int | None) -> None:
        victims = self.ix.victims(tier, SEEDS[owner] if owner is not None else None)
        for taken, victim in enumerate(victims, 1):
            block = self.name(victim)
            had = dict(self.copies[block])
            self.expect_victim(block, tier, owner)
            if tier == LOWEST:
                self.ix.drop(victim)
            else:
                if tier + 1 not in had:
                    self.ix.set_slot(victim, tier + 1, self.copies[block][tier + 1])
                self.ix.clear_slot(victim, tier)
            if taken == budget:
                return
        self.expect_dry(tier, owner)

    @rule(tier=tiers, budget=st.integers(1, 12), owner=owners, data=st.data())
    def evict_runs(self, tier: int, budget: int, owner: int | None, data: st.DataObject) -> None:
        taken = 0
        for run in self.ix.victim_runs(tier, SEEDS[owner] if owner is not None else None):
            k = data.draw(st.integers(0, run.hi - run.lo), label="taken")
            for j in range(k):
                ref = BlockRef(run.node, run.hi - 1 - j)
                block = self.name(ref)
                had = dict(self.copies[block])
                self.expect_victim(block, tier, owner)
                if tier < LOWEST and tier + 1 not in had:
                    self.ix.set_slot(ref, tier + 1, self.copies[block][tier + 1])
            if k and tier == LOWEST:
                self.ix.drop_tail(run.node, k)
            elif k:
                assert len(self.ix.clear_tail(run.node, tier, k)) == k
            taken += k
            if k < run.hi - run.lo or taken >= budget:
                return
        self.expect_dry(tier, owner)

    @precondition(lambda self: self.copies)
    @rule(ns=st.integers(0, NS - 1), node_blocks=st.sampled_from([1, 2, 1 << 20]))
    def restore(self, ns: int, node_blocks: int) -> None:
        """The namespace's blocks, restored into a fresh index in any order, read the same
        there and in no other namespace."""
        mine = sorted(p for n, p in self.copies if n == ns)
        entries = []
        for path in mine:
            ref = self.find((ns, path))
            entries.append(
                RestoreEntry(
                    self.ix.block_id(ref),
                    self.ix.parent_id(ref),
                    key(path[-1]),
                    dict(self.copies[(ns, path)]),
                )
            )
        fresh = RadixIndex(TIERS, block_tokens=BT, hasher=HASHER, node_blocks=node_blocks)
        report = restore_namespace(fresh, SEEDS[ns], reversed(entries))
        assert (len(report.restored), report.orphans, report.bad_ids) == (len(entries), [], [])
        fresh.check()
        for path in mine:
            counts = [0] * len(TIERS)
            for n in range(1, len(path) + 1):
                counts[self.fastest((ns, path[:n]))] += 1
            assert fresh.lookup(SEEDS[ns], key(path)) == PrefixHit(len(path), tuple(counts))
            assert fresh.lookup(SEEDS[(ns + 1) % NS], key(path)).num_blocks == 0

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "ix"):
            return
        self.ix.check()
        assert self.ix.num_blocks == len(self.copies)
        for tier in range(len(TIERS)):
            for ns in range(NS):
                assert self.ix.resident_in(SEEDS[ns], tier) == self.resident_in(ns, tier)
        for block in self.copies:
            assert block_hits(self.find(block)) == self.hits[block], block


ModelIndex.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_index_against_a_brute_force_model = ModelIndex.TestCase


def test_selective_copies_the_walked_blocks_of_an_extended_leaf_to_host() -> None:
    """`selective` (2 hits): A is stored, then A+B extends A's leaf; a load of A+B walks A a
    second time and B a first: A's blocks get their host copy then, B's not (`writes.py` reads
    each block's count: with the node's, the least of them, A's were left out too)."""
    from conftest import TINY_BLOCK_TOKENS as BT
    from conftest import build_store, kv_for

    store = build_store(write="selective", selective_hits=2, background=False)
    a, b = list(range(2 * BT)), list(range(1000, 1000 + 2 * BT))
    store.store(a, kv_for(store, 2 * BT))
    store.store(a + b, kv_for(store, 4 * BT))
    store.load(a + b)
    store.check()
    tiers = store.status()["tiers"]
    assert (tiers["gpu"]["blocks"], tiers["host"]["blocks"]) == (4, 2)
    store.close()
