"""Victims from the recency queue against the heap pass they replace, on random histories.

`reference_victims` is a faithful copy of `eviction.victims` as it was before the candidates
were kept in recency order across calls (every call heapified every candidate). Two indexes
live through the same random history (inserts, lookups, splits, leases, recovered namespaces
whose nodes tie at tick 0, floors, owners); on one, passes run through `RadixIndex.victims`
(or `victim_runs`), on the other through the reference, the caller making the same choices
(take, leave, stop; a nested pass on the next tier, as the demoter makes room below). The
blocks offered must be the same, in the same order, and the two indexes must stay equal.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from letters import DISK, GPU, HASHER, HOST, NS, NS_BOB, key, new_index

from kvtier.blocks import BlockId
from kvtier.index import BlockRef, Node, RadixIndex
from kvtier.index.restore import RestoreEntry, restore_namespace

LOWEST = DISK
NS_RESTORED = HASHER.seed(b"layout-fingerprt", b"restored-tenant!")
SPACES = (NS, NS_BOB, NS_RESTORED)


def reference_victims(ix: RadixIndex, tier: int, owner: bytes | None) -> Iterator[BlockRef]:
    """`eviction.victims` before this change: a heap of every candidate, built per call."""
    candidates = ix.candidates(tier)
    floors, resident_in = ix.residency.floors, ix.residency.resident_in

    def rank(node: Node) -> int | None:
        namespace = node.root.ids
        floor = floors.get(namespace)
        if not floors or floor is None or resident_in(namespace, tier) > floor[tier]:
            return 0
        return 1 if namespace == owner else None

    heap = []
    for seq, node in enumerate(candidates):
        first = rank(node)
        if first is not None:
            heap.append((first, node.tick, seq, node))
    heapq.heapify(heap)
    seq = len(candidates)
    queued = {entry[3] for entry in heap}
    skipped: set[Node] = set()
    while heap:
        was, tick, _, node = heapq.heappop(heap)
        queued.discard(node)
        if node not in candidates or node in skipped:
            continue
        now = rank(node)
        if now is None:
            continue
        if node.tick != tick or now != was:
            heapq.heappush(heap, (now, node.tick, seq, node))
            seq += 1
            queued.add(node)
            continue
        before = (node.size, node.depth[tier])
        parent = node.parent
        yield BlockRef(node, node.depth[tier] - 1)
        if node.parent is not None and (node.size, node.depth[tier]) == before:
            skipped.add(node)
            continue
        for nxt in (node, parent):
            if nxt is not None and nxt in candidates and nxt not in queued and nxt not in skipped:
                nxt_rank = rank(nxt)
                if nxt_rank is not None:
                    heapq.heappush(heap, (nxt_rank, nxt.tick, seq, nxt))
                    seq += 1
                    queued.add(nxt)


def runs_one_by_one(ix: RadixIndex, tier: int, owner: bytes | None) -> Iterator[BlockRef]:
    """`victim_runs`, offered to the caller one block at a time: a run is cut where the
    caller leaves a block (the rest of the run is then given up, as the contract says)."""
    for run in ix.victim_runs(tier, owner):
        for i in range(run.hi - 1, run.lo - 1, -1):
            yield BlockRef(run.node, i)
            if run.node.parent is None or run.node.depth[tier] != i:
                break


Pass = Callable[[RadixIndex, int, bytes | None], Iterator[BlockRef]]


class World:
    """One index and the caller's side of its history."""

    def __init__(self, victims: Pass) -> None:
        self.ix = new_index()
        self.victims = victims
        self.slot = 0
        self.leases: list[int] = []
        self.offered: list[tuple[int, bytes]] = []  # (tier, block id) of every victim offered

    def fresh(self) -> int:
        self.slot += 1
        return self.slot

    def insert(self, namespace: BlockId, path: str, fastest: int, lower: bool) -> None:
        match = self.ix.match(namespace, key(path))
        count = len(path) - match.num_blocks
        if count <= 0:
            return
        first = max(fastest, match.end.fastest_last())
        tiers = {first} | ({LOWEST} if lower else set())
        self.ix.insert(match, key(path), {t: [self.fresh() for _ in range(count)] for t in tiers})

    def lease(self, namespace: BlockId, path: str, tier: int) -> None:
        match = self.ix.match(namespace, key(path))
        if match.num_blocks:
            record = self.ix.leases.acquire(
                match.end, (tier,), 1e9, match.num_blocks, resident=False
            )
            self.leases.append(record.lease_id)

    def release(self, which: int) -> None:
        if self.leases:
            self.ix.leases.release(self.leases.pop(which % len(self.leases)))  # type: ignore[arg-type]

    def restore(self, paths: list[str]) -> None:
        if NS_RESTORED in {r.ids for r in self.ix.roots()}:
            return
        scratch = new_index()
        for path in paths:
            match = scratch.match(NS_RESTORED, key(path))
            scratch.insert(match, key(path), {HOST: [0] * (len(path) - match.num_blocks)})
        entries = []
        for end in _leaves(scratch, NS_RESTORED):
            for ref in scratch.blocks(end):
                entries.append(
                    RestoreEntry(
                        bytes(scratch.block_id(ref)),
                        scratch.parent_id(ref),
                        ref.node.key[ref.i * len(key("a")) : (ref.i + 1) * len(key("a"))],
                        {HOST: self.fresh(), DISK: self.fresh()},
                    )
                )
        unique = {e.block_id: e for e in entries}
        restore_namespace(self.ix, NS_RESTORED, unique.values())

    def run_pass(self, tier: int, owner: bytes | None, choices: list[int], depth: int = 0) -> None:
        """Choices per victim: 0 leave it, 3 stop, else take it (2: and make room below)."""
        for n, ref in enumerate(self.victims(self.ix, tier, owner)):
            self.offered.append((tier, bytes(self.ix.block_id(ref))))
            choice = choices[n % len(choices)] if n < 4 * len(choices) else 1
            if choice == 3:
                return
            if choice == 0:
                continue
            if choice == 2 and depth == 0 and tier < LOWEST:
                self.run_pass(tier + 1, owner, [1, 1, 3], depth + 1)  # room below, as make_room
                if ref.node.parent is None or ref.node.depth[tier] != ref.i + 1:
                    continue  # that changed this node: leave the victim, as the demoter does
            self.take(ref, tier)
            self.ix.check()

    def take(self, ref: BlockRef, tier: int) -> None:
        node, i = ref
        if tier == LOWEST or not any(node.slots[t][i] is not None for t in range(tier, 3)):
            if not any(node.locks or ()):  # as `decide`: a leaf locked in any tier is skipped
                self.ix.drop(ref)
            return
        if all(node.slots[t][i] is None for t in range(tier + 1, 3)):
            self.ix.set_slot(ref, tier + 1, self.fresh())
        if self.ix.can_clear(ref, tier):
            self.ix.clear_slot(ref, tier)
        elif node.children is None and i == node.size - 1 and not any(node.locks or ()):
            self.ix.drop(ref)

    def state(self) -> list[tuple[bytes, list[list[int | None]], int]]:
        out = []
        for root in self.ix.roots():
            for end in _all_nodes(root):
                out.append((end.ids, [list(f) for f in end.slots], end.tick))
        return sorted(out, key=lambda s: s[0])


def _all_nodes(root: Node) -> list[Node]:
    nodes, stack = [], list((root.children or {}).values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend((node.children or {}).values())
    return nodes


def _leaves(ix: RadixIndex, namespace: bytes) -> list[Node]:
    return [n for n in _all_nodes(ix.root(namespace)) if n.children is None]  # type: ignore[arg-type]


paths = st.text(alphabet="abcd", min_size=1, max_size=7)
spaces = st.sampled_from(SPACES[:2])
steps = st.one_of(
    st.tuples(st.just("insert"), spaces, paths, st.integers(GPU, DISK), st.booleans()),
    st.tuples(st.just("lookup"), st.sampled_from(SPACES), paths),
    st.tuples(st.just("match"), st.sampled_from(SPACES), paths),
    st.tuples(st.just("lease"), st.sampled_from(SPACES), paths, st.integers(GPU, DISK)),
    st.tuples(st.just("release"), st.integers(0, 9)),
    st.tuples(st.just("restore"), st.lists(paths, min_size=1, max_size=6)),
    st.tuples(st.just("floors"), st.integers(0, 6), st.integers(0, 6)),
    st.tuples(
        st.just("pass"),
        st.integers(GPU, DISK),
        st.sampled_from((None, NS, NS_BOB)),
        st.lists(st.integers(0, 3), min_size=1, max_size=8),
    ),
)


def replay(world: World, history: list[tuple[object, ...]]) -> None:
    for step in history:
        op, *args = step
        if op == "insert":
            world.insert(*args)  # type: ignore[arg-type]
        elif op == "lookup":
            world.ix.lookup(args[0], key(args[1]))  # type: ignore[arg-type]
        elif op == "match":
            world.ix.match(args[0], key(args[1]))  # type: ignore[arg-type]
        elif op == "lease":
            world.lease(*args)  # type: ignore[arg-type]
        elif op == "release":
            world.release(args[0])  # type: ignore[arg-type]
        elif op == "restore":
            world.restore(args[0])  # type: ignore[arg-type]
        elif op == "floors":
            a, b = int(args[0]), int(args[1])  # type: ignore[call-overload]
            floors: dict[bytes, tuple[int, ...]] = {NS: (a, a, a), NS_RESTORED: (b, b, b)}
            world.ix.set_floors(floors if a or b else {})
        else:
            world.run_pass(*args)  # type: ignore[arg-type]
        world.ix.check()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(steps, min_size=1, max_size=40))
def test_victims_match_the_heap_pass_they_replace(history: list[tuple[object, ...]]) -> None:
    new, old = World(lambda ix, t, o: ix.victims(t, o)), World(reference_victims)
    replay(new, history)
    replay(old, history)
    assert new.offered == old.offered
    assert new.state() == old.state()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(steps, min_size=1, max_size=40))
def test_victim_runs_offer_the_same_blocks_in_the_same_order(
    history: list[tuple[object, ...]],
) -> None:
    new, old = World(runs_one_by_one), World(reference_victims)
    replay(new, history)
    replay(old, history)
    assert new.offered == old.offered
    assert new.state() == old.state()


def test_a_run_is_a_whole_tail_and_one_drop_tail_frees_it() -> None:
    """Three nodes used in turn: the least recent one's gpu run comes as one run of 3, and
    drop_tail takes it in one edit."""
    ix = new_index(("gpu",))
    for n, path in enumerate(("AXYZ", "BXYZ", "CXYZ")):
        ix.insert(ix.match(NS, key(path)), key(path), {GPU: [10 * n + i for i in range(4)]})
    ix.lookup(NS, key("BXYZ"))
    ix.lookup(NS, key("AXYZ"))
    runs = ix.victim_runs(GPU)
    run = next(runs)
    assert (run.node.key[: len(key("C"))], run.lo, run.hi) == (key("C"), 0, 4)
    assert ix.drop_tail(run.node, 2) == [[23, 22]]  # last block first
    ix.check()
    run = next(runs)  # it took fewer than offered: the node waits for the next pass
    assert run.node.key[: len(key("B"))] == key("B") and (run.lo, run.hi) == (0, 4)
    assert ix.drop_tail(run.node, 4) == [[13, 12, 11, 10]]
    ix.check()
    assert ix.num_blocks == 6 and ix.resident(GPU) == 6


def test_a_pass_stopped_early_leaves_every_candidate_queued() -> None:
    ix = new_index(("gpu",))
    for n, path in enumerate(("A", "B", "C", "D")):
        ix.insert(ix.match(NS, key(path)), key(path), {GPU: [n]})
    for ref in ix.victims(GPU):
        ix.drop(ref)
        break
    ix.check()  # check() counts candidates missing from the queue
    assert [ix.block_id(v) for v in ix.victims(GPU)] == [
        ix.block_id(BlockRef(ix.root(NS).children[key(p)], 0))  # type: ignore[index]
        for p in ("B", "C", "D")
    ]


def test_clear_tail_is_clear_slot_from_the_end_and_stops_where_closure_would() -> None:
    """Blocks A..E on gpu, each with a host copy but D, which has a disk one: clearing gpu
    copies from the end takes E, then stops at D (it would sit on disk above E on host), in
    one edit as one at a time: the same slots, depth and counts."""
    one, bulk = new_index(), new_index()
    for ix in (one, bulk):
        ix.insert(ix.match(NS, key("ABCDE")), key("ABCDE"), {GPU: [0, 1, 2, 3, 4]})
        for i, tier in enumerate((HOST, HOST, HOST, DISK, HOST)):
            ix.set_slot(BlockRef(ix.root(NS).children[key("A")], i), tier, 10 + i)  # type: ignore[index]
    node = one.root(NS).children[key("A")]  # type: ignore[index]
    freed = []
    for i in (4, 3, 2):
        if not one.can_clear(BlockRef(node, i), GPU):
            break
        freed.append(one.clear_slot(BlockRef(node, i), GPU))
    assert freed == [4]
    assert bulk.clear_tail(bulk.root(NS).children[key("A")], GPU, 3) == freed  # type: ignore[index]
    bulk.check()
    assert [bulk.resident(t) for t in (GPU, HOST, DISK)] == [4, 4, 1]
    assert bulk.root(NS).children[key("A")].depth == node.depth == [4, 5, 5]  # type: ignore[index]
    assert bulk.clear_tail(bulk.root(NS).children[key("A")], GPU, 1) == []  # type: ignore[index]
