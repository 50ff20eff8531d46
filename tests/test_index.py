"""RadixIndex scenarios: lookups, splits, ids, tiers, namespaces.

Keys are written one letter per block: `key("ABD")` is the tokens A A A A B B B B D D D D, so
"ABC" and "ABD" share the blocks A and B and diverge at the third. Tiers: 0 gpu, 1 host, 2 disk.
"""

from __future__ import annotations

import pytest
from letters import BT, DISK, GPU, HASHER, HOST, KB, NS, NS_BOB, key, new_index, put, ref

from kvtier.blocks import BlockId, tenant_salt
from kvtier.index import InsertResult, PrefixHit, RadixIndex
from kvtier.index.restore import RestoreEntry, restore_namespace


def hit(ix: RadixIndex, blocks: str, extra: int = 0, ns: BlockId = NS) -> PrefixHit:
    return ix.lookup(ns, key(blocks, extra))


# ---- lookup and insert ------------------------------------------------------------------


def test_empty_index_finds_nothing() -> None:
    ix = new_index()
    assert hit(ix, "ABC") == PrefixHit(0, (0, 0, 0))
    assert (ix.num_blocks, ix.num_nodes, ix.num_namespaces) == (0, 0, 0)
    ix.check()


def test_three_blocks_on_gpu_are_found_on_gpu_and_partial_blocks_are_ignored() -> None:
    ix = new_index()
    result = put(ix, "ABC", {GPU: [0, 1, 2]}, ns=NS)
    assert result.new_blocks == 3
    assert hit(ix, "ABC") == PrefixHit(3, (3, 0, 0))
    assert hit(ix, "ABC", extra=3) == PrefixHit(3, (3, 0, 0))
    assert hit(ix, "ABCD") == PrefixHit(3, (3, 0, 0))
    assert hit(ix, "AB", extra=2) == PrefixHit(2, (2, 0, 0))
    assert hit(ix, "", extra=3) == PrefixHit(0, (0, 0, 0))
    assert hit(ix, "BAC") == PrefixHit(0, (0, 0, 0))
    # the lookup of "AB" split ABC so that C keeps its own recency
    assert (ix.num_blocks, ix.num_nodes, [ix.resident(t) for t in range(3)]) == (3, 2, [3, 0, 0])


def test_insert_indexes_whole_blocks_only() -> None:
    ix = new_index()
    match = ix.match(NS, key("AB", extra=3))
    assert ix.insert(match, key("AB", extra=3), {GPU: [0, 1]}).new_blocks == 2
    ix.check()
    match = ix.match(NS, key("", extra=3))
    assert ix.insert(match, key("", extra=3), {}) == InsertResult(0, match.end)
    assert put(ix, "AB", {}).new_blocks == 0  # already cached: nothing to add
    assert ix.num_blocks == 2


def test_divergence_splits_the_shared_node() -> None:
    ix = new_index()
    put(ix, "ABC", {GPU: [0, 1, 2]})
    put(ix, "ABDE", {GPU: [3, 4]})
    assert (ix.num_nodes, ix.num_blocks) == (3, 5)
    trunk = ref(ix, "AB").node
    assert trunk.key == key("AB") and trunk.children is not None
    assert sorted(child.key for child in trunk.children.values()) == [key("C"), key("DE")]
    assert hit(ix, "ABC") == PrefixHit(3, (3, 0, 0))
    assert hit(ix, "ABDE") == PrefixHit(4, (4, 0, 0))
    assert hit(ix, "ABX") == PrefixHit(2, (2, 0, 0))
    assert hit(ix, "ABDX") == PrefixHit(3, (3, 0, 0))


def test_lookup_and_match_split_a_node_matched_in_part() -> None:
    ix = new_index()
    put(ix, "ABCD", {GPU: [0, 1, 2, 3]})
    assert hit(ix, "ABCD") == PrefixHit(4, (4, 0, 0))
    assert ix.num_nodes == 1  # a whole match splits nothing
    assert hit(ix, "AB") == PrefixHit(2, (2, 0, 0))
    ix.check()
    assert [n.key for n in ix.path(ref(ix, "ABCD").node)] == [key("AB"), key("CD")]
    assert hit(ix, "ABX") == PrefixHit(2, (2, 0, 0))
    assert ix.num_nodes == 2  # ends on the boundary now
    match = ix.match(NS, key("ABCX"))
    ix.check()
    assert (match.num_blocks, match.end.key, ix.num_nodes) == (3, key("C"), 3)
    assert match.end.children is not None
    assert [child.key for child in match.end.children.values()] == [key("D")]
    assert hit(ix, "ABCD") == PrefixHit(4, (4, 0, 0))
    whole = ix.match(NS, key("ABCDE"))
    assert (whole.num_blocks, whole.end.key, ix.num_nodes) == (4, key("D"), 3)


def test_lookups_and_matches_count_hits_and_stamp_recency() -> None:
    ix = new_index()
    put(ix, "ABCD", {GPU: [0, 1, 2, 3]})
    node = ref(ix, "A").node
    hits, tick = node.hits, node.tick
    hit(ix, "ABCDE")
    hit(ix, "X")  # a miss walks no node
    assert (node.hits, node.tick) == (hits + 1, tick + 1)
    hit(ix, "AB")  # splits: only the head is used, the tail keeps its count and stamp
    head = ref(ix, "AB").node
    assert head is not node and ref(ix, "ABCD").node is node
    assert (head.hits, node.hits, head.tick, node.tick) == (hits + 2, hits + 1, tick + 3, tick + 1)
    assert ix.match(NS, key("A")).end.key == key("A")  # splits again: A is used, B is not
    assert (ref(ix, "A").node.tick, ref(ix, "AB").node.tick) == (tick + 4, tick + 3)


def test_insert_extends_a_leaf_but_hangs_a_child_under_an_interior_node() -> None:
    ix = new_index()
    put(ix, "AB", {GPU: [0, 1]})
    put(ix, "ABC", {GPU: [2]})
    assert (ix.num_nodes, ref(ix, "A").node.key) == (1, key("ABC"))
    put(ix, "ABD", {GPU: [3]})  # splits ABC into AB + C, adds D
    assert ix.num_nodes == 3
    put(ix, "ABCE", {GPU: [4]})  # C is a leaf: extended
    assert (ix.num_nodes, ref(ix, "ABC").node.key) == (3, key("CE"))
    put(ix, "ABF", {GPU: [5]})  # AB is interior: a new child
    assert (ix.num_nodes, ix.num_blocks) == (4, 6)
    assert hit(ix, "ABCE") == PrefixHit(4, (4, 0, 0))


def new_ids(ix: RadixIndex, result: InsertResult) -> list[BlockId]:
    """The ids of the blocks an insert added (the last of the path to its end)."""
    path = [ix.block_id(r) for r in ix.blocks(result.end)]
    return path[len(path) - result.new_blocks :]


def test_new_ids_chain_from_the_namespace_seed_and_shared_blocks_share_them() -> None:
    ix = new_index()
    first = put(ix, "ABC", {GPU: [0, 1, 2]})
    assert first.end.ids == b""  # chained when first read, not on insert
    assert b"".join(new_ids(ix, first)) == HASHER.chain(NS, key("ABC"), KB)
    id_a, id_b, id_c = new_ids(ix, first)
    second = put(ix, "ABDE", {GPU: [3, 4]})
    assert b"".join(new_ids(ix, second)) == HASHER.chain(id_b, key("DE"), KB)
    via_c = [ix.block_id(r) for r in ix.blocks(ref(ix, "ABC").node)]
    via_e = [ix.block_id(r) for r in ix.blocks(ref(ix, "ABDE").node)]
    assert via_c == [id_a, id_b, id_c]
    assert via_e[:2] == [id_a, id_b]
    assert via_e[2:] == new_ids(ix, second)


def test_ids_read_late_survive_splits_extensions_and_cuts() -> None:
    """A node that never had its ids read is split, extended and cut; the ids read afterwards
    are the chain of each path, and a node read in part keeps the prefix it had."""
    ix = new_index()
    put(ix, "ABCD", {GPU: [0, 1, 2, 3]})
    assert ix.block_id(ref(ix, "AB")) == HASHER.chain(NS, key("AB"), KB)[-HASHER.digest_size :]
    put(ix, "ABCDEF", {GPU: [4, 5]})  # extends the leaf whose ids are complete
    put(ix, "ABX", {GPU: [6]})  # splits it after B
    put(ix, "ABXYZ", {GPU: [7, 8]})  # extends a leaf with no ids read
    ix.drop_tail(ref(ix, "ABXYZ").node, 1)  # cuts it
    ix.check()
    for path in ("ABCDEF", "ABXY", "AB"):
        ids = [ix.block_id(r) for r in ix.blocks(ref(ix, path).node)]
        assert b"".join(ids) == HASHER.chain(NS, key(path), KB), path
        assert ix.parent_id(ref(ix, path)) == (ids[-2] if len(ids) > 1 else NS)
    ix.check()


# ---- tiers --------------------------------------------------------------------------------


def tiered_path() -> RadixIndex:
    """A B on gpu+host, C D on host only, E F on disk only: one node of six blocks."""
    ix = new_index()
    put(ix, "AB", {GPU: [0, 1], HOST: [0, 1]})
    put(ix, "ABCD", {HOST: [2, 3]})
    put(ix, "ABCDEF", {DISK: [0, 1]})
    assert ix.num_nodes == 1
    return ix


def test_lookup_splits_a_path_by_the_fastest_copy_of_each_block() -> None:
    ix = tiered_path()
    assert ref(ix, "A").node.depth == [2, 4, 6]
    assert hit(ix, "ABCDEF") == PrefixHit(6, (2, 2, 2))
    assert hit(ix, "ABC") == PrefixHit(3, (2, 1, 0))
    assert hit(ix, "ABCDE") == PrefixHit(5, (2, 2, 1))
    assert [ix.resident(t) for t in range(3)] == [2, 4, 2]


def test_promotion_and_demotion_keep_depth_and_closure() -> None:
    ix = tiered_path()
    node = ref(ix, "A").node
    ix.set_slot(ref(ix, "ABC"), GPU, 5)
    ix.check()
    assert (node.depth, hit(ix, "ABCDEF")) == ([3, 4, 6], PrefixHit(6, (3, 1, 2)))
    ix.set_slot(ref(ix, "ABCDE"), HOST, 9)  # E: disk -> host, after D on host
    ix.check()
    assert (node.depth, hit(ix, "ABCDEF")) == ([3, 5, 6], PrefixHit(6, (3, 2, 1)))
    ix.set_slot(ref(ix, "AB"), DISK, 7)  # a slower extra copy changes no depth
    ix.check()
    assert (node.depth, ix.resident(DISK)) == ([3, 5, 6], 3)
    assert ix.clear_slot(ref(ix, "ABC"), GPU) == 5
    ix.check()
    assert (node.depth, hit(ix, "ABCDEF")) == ([2, 5, 6], PrefixHit(6, (2, 3, 1)))
    assert ix.clear_slot(ref(ix, "AB"), HOST) == 1  # B keeps its gpu copy: depth unchanged
    ix.check()
    assert (node.depth, [ix.resident(t) for t in range(3)]) == ([2, 5, 6], [2, 4, 3])


def test_promotion_out_of_order_is_refused() -> None:
    ix = tiered_path()
    with pytest.raises(AssertionError, match="whole prefixes"):
        ix.set_slot(ref(ix, "ABCD"), GPU, 5)  # C is still on host
    with pytest.raises(AssertionError, match="already has a gpu copy"):
        ix.set_slot(ref(ix, "A"), GPU, 5)
    ix.check()  # a refused promotion changes nothing
    assert (hit(ix, "ABCDEF"), ix.resident(GPU)) == (PrefixHit(6, (2, 2, 2)), 2)


def test_promotion_of_a_child_before_its_parent_node_is_refused() -> None:
    ix = new_index()
    put(ix, "ABC", {HOST: [0, 1, 2]})
    put(ix, "ABD", {HOST: [3]})  # trunk AB, children C and D
    with pytest.raises(AssertionError, match="whole prefixes"):
        ix.set_slot(ref(ix, "ABD"), GPU, 0)
    ix.check()
    ix.set_slot(ref(ix, "A"), GPU, 0)
    ix.set_slot(ref(ix, "AB"), GPU, 1)
    ix.set_slot(ref(ix, "ABD"), GPU, 2)
    ix.check()
    assert (hit(ix, "ABD"), hit(ix, "ABC")) == (PrefixHit(3, (3, 0, 0)), PrefixHit(3, (2, 1, 0)))
    assert ref(ix, "AB").node.child_res == [1, 2, 2]


def test_clearing_a_copy_that_a_child_needs_is_refused() -> None:
    ix = new_index()
    put(ix, "ABC", {GPU: [0, 1, 2], HOST: [0, 1, 2]})
    put(ix, "ABD", {HOST: [3]})
    b, c, d = ref(ix, "AB"), ref(ix, "ABC"), ref(ix, "ABD")
    assert [ix.can_clear(b, GPU), ix.can_clear(b, HOST)] == [False, True]
    with pytest.raises(AssertionError, match="prefix closure"):
        ix.clear_slot(b, GPU)  # C hangs below B on gpu
    assert [ix.can_clear(d, HOST), ix.can_clear(d, GPU), ix.can_clear(c, DISK)] == [False] * 3
    with pytest.raises(AssertionError, match="prefix closure"):
        ix.clear_slot(d, HOST)  # D's last copy
    ix.check()
    assert ix.can_clear(c, GPU)
    assert ix.clear_slot(c, GPU) == 2
    assert ix.can_clear(b, GPU) and not ix.can_clear(ref(ix, "A"), GPU)
    assert ix.clear_slot(b, GPU) == 1
    ix.check()
    assert (hit(ix, "ABC"), hit(ix, "ABD")) == (PrefixHit(3, (1, 2, 0)), PrefixHit(3, (1, 2, 0)))


def test_a_two_tier_index_has_two_counts() -> None:
    ix = new_index(("gpu", "host"))
    put(ix, "AB", {GPU: [0, 1], HOST: [0, 1]})
    put(ix, "ABC", {HOST: [2]})
    assert hit(ix, "ABC") == PrefixHit(3, (2, 1))


# ---- namespaces ---------------------------------------------------------------------------


def test_namespaces_are_separate_trees() -> None:
    ix = new_index()
    alice = put(ix, "ABC", {GPU: [0, 1, 2]}, ns=NS)
    bob = put(ix, "AB", {HOST: [0, 1]}, ns=NS_BOB)
    assert (ix.num_namespaces, ix.num_nodes, ix.num_blocks) == (2, 2, 5)
    assert hit(ix, "ABC", ns=NS) == PrefixHit(3, (3, 0, 0))
    assert hit(ix, "ABC", ns=NS_BOB) == PrefixHit(2, (0, 2, 0))
    assert hit(ix, "ABC", ns=HASHER.seed(b"layout-fingerprt", tenant_salt("eve"))).num_blocks == 0
    assert ref(ix, "A", ns=NS).node is not ref(ix, "A", ns=NS_BOB).node
    assert set(new_ids(ix, alice)).isdisjoint(new_ids(ix, bob))


def test_matching_in_an_unknown_namespace_leaves_no_namespace_behind() -> None:
    ix = new_index()
    match = ix.match(NS, key("AB"))
    ix.check()
    assert (match.num_blocks, ix.num_namespaces) == (0, 0)
    ix.insert(match, key("AB"), {GPU: [0, 1]})
    ix.check()
    assert (ix.num_namespaces, hit(ix, "AB")) == (1, PrefixHit(2, (2, 0, 0)))


def test_a_node_never_holds_more_blocks_than_its_event_range() -> None:
    """`node_blocks` (`EVENT_RANGE` by default: a node's blocks take event numbers ev + i of a
    range of that size) bounds every node: an insert of a longer run hangs a chain of nodes, a
    leaf grows only while it fits, and recovery's restore cuts a long chain of entries alike;
    lookups see the same blocks either way."""
    ix = RadixIndex(("gpu", "host", "disk"), block_tokens=BT, hasher=HASHER, node_blocks=4)
    letters = "ABCDEFGHIJ"  # 10 blocks: nodes of 4, 4 and 2
    put(ix, letters, {GPU: list(range(10))})
    end = ix.match(NS, key(letters)).end
    sizes = []
    node = end
    while node.parent is not None:
        sizes.append(node.size)
        node = node.parent
    assert sizes == [2, 4, 4]
    put(ix, letters + "KL", {GPU: [10, 11]})  # the last node grows to 4
    assert ix.match(NS, key(letters + "KL")).end is end and end.size == 4
    put(ix, letters + "KLM", {GPU: [12]})  # 5 would not fit: a child
    assert ix.match(NS, key(letters + "KLM")).end.parent is end
    assert hit(ix, letters + "KLM") == PrefixHit(13, (13, 0, 0))
    ix.check()

    restored = RadixIndex(("gpu", "host", "disk"), block_tokens=BT, hasher=HASHER, node_blocks=4)
    tokens = key(letters)
    ids = HASHER.chain(NS, tokens, KB)
    ds = HASHER.digest_size
    entries = [
        RestoreEntry(
            ids[i * ds : (i + 1) * ds],
            ids[(i - 1) * ds : i * ds] if i else bytes(NS),
            tokens[i * KB : (i + 1) * KB],
            {DISK: 100 + i},
        )
        for i in range(10)
    ]
    report = restore_namespace(restored, NS, entries)
    assert len(report.restored) == 10 and not report.orphans and not report.bad_ids
    assert restored.num_nodes == 3 and hit(restored, letters, ns=NS) == PrefixHit(10, (0, 0, 10))
    restored.check()
