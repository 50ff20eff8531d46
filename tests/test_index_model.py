"""RadixIndex against a plain model: random inserts, lookups, promotions, demotions through
victims(), drops and leases, with check() and the model compared after every step.

The model is a dict from (namespace, path) to the block's copies {tier: slot}; a path is one
letter per block from a small alphabet, so keys share prefixes and diverge often.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from index_blocks import BT, KB, Block, find, key, name

from kvtier.blocks import BlockHasher, tenant_salt
from kvtier.errors import LeaseError
from kvtier.index import BlockRef, LeaseId, Node, PrefixHit, RadixIndex

TIERS = ("gpu", "host", "disk")
LOWEST = len(TIERS) - 1
HASHER = BlockHasher()
SEEDS = [HASHER.seed(b"layout-fingerprt", tenant_salt(t)) for t in ("alice", "bob")]

paths = st.text(alphabet="abc", min_size=1, max_size=5)
tiers = st.integers(0, LOWEST)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ix = RadixIndex(TIERS, block_tokens=BT, hasher=HASHER)
        self.copies: dict[Block, dict[int, int]] = {}
        self.leases: dict[LeaseId, tuple[int, str, tuple[int, ...], float]] = {}
        self.released: list[LeaseId] = []
        self.next_slot = [0] * len(TIERS)
        self.now = 0.0

    # ---- model helpers --------------------------------------------------------------------

    def slot(self, tier: int) -> int:
        self.next_slot[tier] += 1
        return self.next_slot[tier]

    def fastest(self, block: Block) -> int:
        if not block[1]:
            return 0  # the root: anything may hang below it
        return min(self.copies[block])

    def cached(self, ns: int, path: str) -> int:
        return next(n for n in range(len(path), -1, -1) if n == 0 or (ns, path[:n]) in self.copies)

    def children(self, block: Block) -> list[Block]:
        ns, path = block
        return [(ns, path + c) for c in "abc" if (ns, path + c) in self.copies]

    def leased(self, block: Block, tier: int) -> bool:
        ns, path = block
        return any(
            lns == ns and lpath.startswith(path) and tier in ltiers
            for lns, lpath, ltiers, _ in self.leases.values()
        )

    def find(self, block: Block) -> BlockRef:
        return find(self.ix, SEEDS, block)

    def name(self, ref: BlockRef) -> Block:
        return name(self.ix, SEEDS, ref)

    def blocks(self) -> list[Block]:
        return sorted(self.copies)

    # ---- rules ----------------------------------------------------------------------------

    def some_path(self, data: st.DataObject, ns: int) -> str:
        """A leased prefix, a cached leaf, a cached path or a random one: where leases end and
        where inserts extend a node are where the index has the most to get right."""
        cached = [path for n, path in self.blocks() if n == ns]
        leased = sorted({path for n, path, _, _ in self.leases.values() if n == ns and path})
        leaves = [path for path in cached if not self.children((ns, path))]
        choices = [st.sampled_from(c) for c in (leased, leaves, cached) if c]
        path: str = data.draw(st.one_of(*choices, paths))
        return path

    @rule(
        ns=st.integers(0, 1),
        path=paths,
        extra=st.integers(0, BT - 1),
        fastest=tiers,
        more=st.sets(tiers),
    )
    def insert(self, ns: int, path: str, extra: int, fastest: int, more: set[int]) -> None:
        match = self.ix.match(SEEDS[ns], key(path, extra))
        cached = self.cached(ns, path)
        assert match.num_blocks == cached
        fastest = max(fastest, self.fastest((ns, path[:cached])))
        chosen = sorted({fastest} | {t for t in more if t > fastest})
        new = path[cached:]
        slots = {t: [self.slot(t) for _ in new] for t in chosen}
        result = self.ix.insert(match, key(path, extra), slots)
        assert result.new_blocks == len(new)
        for i in range(len(new)):
            self.copies[(ns, path[: cached + i + 1])] = {t: s[i] for t, s in slots.items()}

    @rule(data=st.data(), ns=st.integers(0, 1))
    def read_ids(self, data: st.DataObject, ns: int) -> None:
        """Ids are chained when first read (`Forest.ids_of`): whenever that is, after splits,
        extensions and cuts of nodes that never had theirs, they are the chain of the path."""
        path = self.some_path(data, ns)
        path = path[: self.cached(ns, path)]
        if path:
            got = self.ix.block_id(self.find((ns, path)))
            assert got == HASHER.chain(SEEDS[ns], key(path), KB)[-HASHER.digest_size :]

    @rule(ns=st.integers(0, 1), path=paths, extra=st.integers(0, BT - 1))
    def lookup(self, ns: int, path: str, extra: int) -> None:
        nodes = self.ix.num_nodes
        cached = self.cached(ns, path)
        counts = [0] * len(TIERS)
        for n in range(1, cached + 1):
            counts[self.fastest((ns, path[:n]))] += 1
        last = self.find((ns, path[:cached])) if cached else None
        splits = last is not None and last.i < last.node.size - 1  # ends inside a node
        assert self.ix.lookup(SEEDS[ns], key(path, extra)) == PrefixHit(cached, tuple(counts))
        assert self.ix.num_nodes == nodes + splits

    @precondition(lambda self: self.copies)
    @rule(data=st.data(), tier=tiers)
    def promote(self, data: st.DataObject, tier: int) -> None:
        block = data.draw(st.sampled_from(self.blocks()))
        if tier in self.copies[block]:
            return
        ref = self.find(block)
        if tier < self.fastest(block) and self.fastest((block[0], block[1][:-1])) > tier:
            with pytest.raises(AssertionError, match="whole prefixes"):
                self.ix.set_slot(ref, tier, self.slot(tier))
            return
        slot = self.slot(tier)
        self.ix.set_slot(ref, tier, slot)
        self.copies[block][tier] = slot

    @precondition(lambda self: self.copies)
    @rule(data=st.data(), tier=tiers)
    def clear(self, data: st.DataObject, tier: int) -> None:
        block = data.draw(st.sampled_from(self.blocks()))
        copies = self.copies[block]
        others = sorted(t for t in copies if t != tier)
        can = tier in copies and bool(others)
        if can and tier == min(copies):
            can = all(self.fastest(child) >= others[0] for child in self.children(block))
        ref = self.find(block)
        assert self.ix.can_clear(ref, tier) == can
        if can and not self.leased(block, tier):
            assert self.ix.clear_slot(ref, tier) == copies.pop(tier)

    @precondition(lambda self: self.copies)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.blocks()))
        if any(self.leased(block, t) for t in range(len(TIERS))):
            return
        ref = self.find(block)
        if self.children(block):
            with pytest.raises(AssertionError):
                self.ix.drop(ref)
            return
        assert self.ix.drop(ref) == sorted(self.copies.pop(block).items())

    @rule(tier=tiers, budget=st.integers(1, 8), data=st.data())
    def demote(self, tier: int, budget: int, data: st.DataObject) -> None:
        """One victims pass: the caller takes each victim (copy down, or drop on the lowest
        tier) or leaves it, and stops after `budget` takes."""
        skipped: set[Node] = set()
        seen: set[Block] = set()
        taken = 0
        for victim in self.ix.victims(tier):
            block = self.name(victim)
            assert block not in seen, f"{block} offered twice in one pass"
            seen.add(block)
            assert self.fastest(block) == tier and not self.leased(block, tier)
            assert all(self.fastest(child) > tier for child in self.children(block))
            waiting = [n.tick for n in self.ix.candidates(tier) if n not in skipped]
            assert victim.node.tick == min(waiting), "victims must come least recently used first"
            if data.draw(st.integers(0, 3), label=f"leave {block} if 0") == 0:
                skipped.add(victim.node)
                continue
            if tier == LOWEST:
                assert self.ix.drop(victim) == sorted(self.copies.pop(block).items())
            else:
                if tier + 1 not in self.copies[block]:
                    self.copies[block][tier + 1] = self.slot(tier + 1)
                    self.ix.set_slot(victim, tier + 1, self.copies[block][tier + 1])
                assert self.ix.clear_slot(victim, tier) == self.copies[block].pop(tier)
            self.ix.check()
            taken += 1
            if taken == budget:
                return
        if not skipped:  # the pass ran dry: every tier-leaf left is leased
            for block in self.blocks():
                if self.fastest(block) == tier and not self.leased(block, tier):
                    assert any(self.fastest(c) <= tier for c in self.children(block)), block

    @rule(data=st.data(), ns=st.integers(0, 1), suffix=paths, fastest=tiers, more=st.sets(tiers))
    def extend(
        self, data: st.DataObject, ns: int, suffix: str, fastest: int, more: set[int]
    ) -> None:
        self.insert(ns, self.some_path(data, ns) + suffix[:2], 0, fastest, more)

    @rule(data=st.data(), ns=st.integers(0, 1), ttl=st.integers(1, 20))
    def acquire(self, data: st.DataObject, ns: int, ttl: int) -> None:
        """Lease a prefix in some of the tiers that hold all of it (none when it is empty)."""
        path = self.some_path(data, ns)
        match = self.ix.match(SEEDS[ns], key(path))
        held = [self.copies[(ns, path[:n])] for n in range(1, match.num_blocks + 1)]
        whole = [t for t in range(len(TIERS)) if held and all(t in c for c in held)]
        wanted = data.draw(st.sets(st.sampled_from(whole), min_size=1)) if whole else set()
        leased = tuple(sorted(wanted))
        expires_at = self.now + ttl
        record = self.ix.leases.acquire(match.end, leased, expires_at, match.num_blocks)
        self.leases[record.lease_id] = (ns, path[: match.num_blocks], leased, expires_at)

    @precondition(lambda self: self.leases or self.released)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        # in the order they were taken (ids are random: sorting them would draw differently
        # when hypothesis replays the same steps)
        lease_id = data.draw(st.sampled_from([*self.leases, *self.released]))
        if lease_id in self.leases:
            self.ix.leases.release(lease_id)
            del self.leases[lease_id]
            self.released.append(lease_id)
        else:
            with pytest.raises(LeaseError, match=f"lease {lease_id}: unknown"):
                self.ix.leases.release(lease_id)

    @rule(dt=st.integers(0, 3))
    def expire(self, dt: int) -> None:
        self.now += dt
        due = sorted((e, i) for i, (_, _, _, e) in self.leases.items() if e <= self.now)
        assert [r.lease_id for r in self.ix.leases.expire(self.now)] == [i for _, i in due]
        for _, lease_id in due:
            del self.leases[lease_id]
            self.released.append(lease_id)

    # ---- after every step -----------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.ix.check()
        resident = [sum(t in c for c in self.copies.values()) for t in range(len(TIERS))]
        assert [self.ix.resident(t) for t in range(len(TIERS))] == resident
        assert self.ix.num_blocks == len(self.copies)
        assert self.ix.num_namespaces == len({ns for ns, _ in self.copies})
        assert len(self.ix.leases) == len(self.leases)


IndexMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_index_against_model = IndexMachine.TestCase
