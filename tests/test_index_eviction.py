"""RadixIndex victims and drop: least-recently-used leaves of a tier, removed leaf-first.

Keys are one letter per block (`key("ABD")`: A A A A B B B B D D D D); a block is named by its
path, so "ABD" is the block D below A B. Tiers: 0 gpu, 1 host, 2 disk.
"""

from __future__ import annotations

import math

import pytest
from letters import DISK, GPU, HOST, KB, NS, key, new_index, put, ref

from kvtier.index import BlockRef, PrefixHit, RadixIndex


def name(ix: RadixIndex, block: BlockRef) -> str:
    """The path of a block, e.g. "ABD"."""
    path = [chr(r.node.key[r.i * KB]) for r in ix.blocks(block.node)]
    return "".join(path[: len(path) - block.node.size + block.i + 1])


def skip_all(ix: RadixIndex, tier: int) -> list[str]:
    """One victims pass in which the caller frees nothing."""
    return [name(ix, v) for v in ix.victims(tier)]


def drop_all(ix: RadixIndex, tier: int) -> list[str]:
    """One victims pass in which the caller drops every victim."""
    names = []
    for victim in ix.victims(tier):
        names.append(name(ix, victim))
        ix.drop(victim)
        ix.check()
    return names


def demote_all(ix: RadixIndex, tier: int, next_slot: int = 100) -> list[str]:
    """One victims pass in which the caller copies every victim one tier down, then frees it."""
    names = []
    for victim in ix.victims(tier):
        names.append(name(ix, victim))
        if victim.node.slots[tier + 1][victim.i] is None:
            ix.set_slot(victim, tier + 1, next_slot)
            next_slot += 1
        ix.clear_slot(victim, tier)
        ix.check()
    return names


def trunk_with_two_branches(slots: dict[int, list[int]]) -> RadixIndex:
    """A B with children C and D, every block with copies in the tiers of `slots`."""
    ix = new_index()
    put(ix, "ABC", {t: s[:3] for t, s in slots.items()})
    put(ix, "ABD", {t: s[3:] for t, s in slots.items()})
    return ix


# ---- victims ------------------------------------------------------------------------------


def test_leaves_come_least_recently_used_first() -> None:
    ix = new_index()
    put(ix, "A", {GPU: [0]})
    put(ix, "B", {GPU: [1]})
    put(ix, "C", {GPU: [2]})
    assert skip_all(ix, GPU) == ["A", "B", "C"]
    ix.lookup(NS, key("A"))
    assert skip_all(ix, GPU) == ["B", "C", "A"]
    ix.lookup(NS, key("BX"))
    assert skip_all(ix, GPU) == ["C", "A", "B"]
    assert (skip_all(ix, HOST), skip_all(ix, DISK)) == ([], [])


def test_a_node_offers_its_blocks_last_first_before_a_newer_node() -> None:
    ix = new_index()
    put(ix, "AB", {GPU: [0, 1], HOST: [0, 1]})
    put(ix, "CD", {GPU: [2, 3], HOST: [2, 3]})
    assert demote_all(ix, GPU) == ["AB", "A", "CD", "C"]
    assert ix.resident(GPU) == 0
    assert ix.lookup(NS, key("AB")) == PrefixHit(2, (0, 2, 0))


def test_a_node_used_during_the_pass_goes_to_the_back_of_the_line() -> None:
    ix = new_index()
    for slot, letter in enumerate("ABC"):
        put(ix, letter, {GPU: [slot]})
    names = []
    for victim in ix.victims(GPU):
        names.append(name(ix, victim))
        if len(names) == 1:
            ix.lookup(NS, key("B"))
    assert names == ["A", "C", "B"]


def test_an_interior_node_becomes_a_victim_once_its_children_leave_the_tier() -> None:
    ix = trunk_with_two_branches({GPU: [0, 1, 2, 3], HOST: [0, 1, 2, 3]})
    assert skip_all(ix, GPU) == ["ABC", "ABD"]
    assert demote_all(ix, GPU) == ["ABC", "ABD", "AB", "A"]
    assert (ix.resident(GPU), ix.resident(HOST)) == (0, 4)
    assert ix.lookup(NS, key("ABC")) == PrefixHit(3, (0, 3, 0))


def test_dropping_every_victim_empties_the_index_leaf_first() -> None:
    ix = trunk_with_two_branches({GPU: [0, 1, 2, 3]})
    assert drop_all(ix, GPU) == ["ABC", "ABD", "AB", "A"]
    assert (ix.num_blocks, ix.num_nodes, ix.num_namespaces, ix.resident(GPU)) == (0, 0, 0, 0)
    assert ix.lookup(NS, key("ABC")) == PrefixHit(0, (0, 0, 0))


def test_victims_of_each_tier_end_its_run_of_blocks() -> None:
    """The eviction.py picture: A[g g g] - B[g g h], and C[g h h] below A."""
    ix = new_index()
    put(ix, "AAAB", {GPU: [0, 1, 2, 3], HOST: [0, 1, 2, 3]})
    put(ix, "AAABBC", {HOST: [4, 5]})
    ix.set_slot(ref(ix, "AAABB"), GPU, 4)
    put(ix, "AAAC", {GPU: [6], HOST: [6]})
    put(ix, "AAACCC", {HOST: [7, 8]})
    ix.check()
    assert (ref(ix, "AAAB").node.depth, ref(ix, "AAAC").node.depth) == ([2, 3, 3], [1, 3, 3])
    assert sorted(skip_all(ix, GPU)) == ["AAABB", "AAAC"]
    assert sorted(skip_all(ix, HOST)) == ["AAABBC", "AAACCC"]
    assert skip_all(ix, DISK) == []


def test_locked_nodes_are_never_victims() -> None:
    ix = trunk_with_two_branches({GPU: [0, 1, 2, 3]})
    ix.leases.acquire(ix.match(NS, key("AB")).end, (GPU,), math.inf, 2)
    assert drop_all(ix, GPU) == ["ABC", "ABD"]
    assert (ix.num_blocks, skip_all(ix, GPU)) == (2, [])
    ix = trunk_with_two_branches({GPU: [0, 1, 2, 3]})
    ix.leases.acquire(ix.match(NS, key("ABC")).end, (GPU,), math.inf, 3)
    assert drop_all(ix, GPU) == ["ABD"]
    assert ix.lookup(NS, key("ABC")) == PrefixHit(3, (3, 0, 0))


def test_a_lease_on_one_tier_does_not_protect_another() -> None:
    ix = trunk_with_two_branches({GPU: [0, 1, 2, 3], HOST: [0, 1, 2, 3]})
    ix.leases.acquire(ix.match(NS, key("ABC")).end, (HOST,), math.inf, 3)  # uses A B C
    assert demote_all(ix, GPU) == ["ABD", "ABC", "AB", "A"]
    assert skip_all(ix, HOST) == ["ABD"]


def test_a_skipped_victim_is_not_offered_again_in_the_same_pass() -> None:
    ix = new_index()
    put(ix, "AB", {GPU: [0, 1], HOST: [0, 1]})
    put(ix, "C", {GPU: [2], HOST: [2]})
    put(ix, "D", {GPU: [3], HOST: [3]})
    names = []
    for victim in ix.victims(GPU):
        names.append(name(ix, victim))
        if name(ix, victim) == "C":
            ix.clear_slot(victim, GPU)
            ix.check()
    # B was left, so A behind it is never offered; C was taken; D was left
    assert names == ["AB", "C", "D"]
    assert [ix.lookup(NS, key(k)) for k in ("AB", "C", "D")] == [
        PrefixHit(2, (2, 0, 0)),
        PrefixHit(1, (0, 1, 0)),
        PrefixHit(1, (1, 0, 0)),
    ]
    assert skip_all(ix, GPU) == ["AB", "D"]


def test_an_exhausted_pass_stops() -> None:
    ix = new_index()
    put(ix, "A", {GPU: [0]})
    victims = ix.victims(GPU)
    assert name(ix, next(victims)) == "A"
    with pytest.raises(StopIteration):
        next(victims)


# ---- drop ---------------------------------------------------------------------------------


def test_drop_returns_the_exact_copies_to_free() -> None:
    ix = new_index()
    put(ix, "ABC", {GPU: [3, 4, 5], DISK: [10, 11, 12]})
    put(ix, "ABD", {DISK: [13]})
    assert ix.num_nodes == 3
    assert ix.drop(ref(ix, "ABD")) == [(DISK, 13)]
    ix.check()
    assert (ix.num_blocks, ix.num_nodes) == (3, 2)
    assert ix.drop(ref(ix, "ABC")) == [(GPU, 5), (DISK, 12)]
    ix.check()
    assert (ix.num_blocks, ix.num_nodes) == (2, 1)
    assert ix.drop(ref(ix, "AB")) == [(GPU, 4), (DISK, 11)]
    ix.check()
    assert ix.lookup(NS, key("ABC")) == PrefixHit(1, (1, 0, 0))
    assert ix.drop(ref(ix, "A")) == [(GPU, 3), (DISK, 10)]
    ix.check()
    assert (ix.num_blocks, ix.num_nodes, ix.num_namespaces) == (0, 0, 0)
    assert [ix.resident(t) for t in range(3)] == [0, 0, 0]
    put(ix, "AB", {HOST: [0, 1]})  # the namespace comes back with new blocks
    assert (ix.num_namespaces, ix.lookup(NS, key("AB"))) == (1, PrefixHit(2, (0, 2, 0)))


def test_drop_refuses_anything_but_an_unlocked_leaf_block() -> None:
    ix = trunk_with_two_branches({GPU: [0, 1, 2, 3]})
    with pytest.raises(AssertionError):
        ix.drop(ref(ix, "AB"))  # B has children
    put(ix, "ABCE", {GPU: [4]})
    with pytest.raises(AssertionError):
        ix.drop(ref(ix, "ABC"))  # C is not the last block of its node
    ix.leases.acquire(ix.match(NS, key("ABD")).end, (GPU,), math.inf, 3)
    with pytest.raises(AssertionError, match="leased"):
        ix.drop(ref(ix, "ABD"))
    ix.check()
    assert (ix.num_blocks, ix.num_nodes) == (5, 3)
