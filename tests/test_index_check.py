"""RadixIndex.check(): each kind of corruption is caught, with the numbers that disagree.

The scenario: trunk A B (gpu+host) with children C (gpu+host) and D (host only). Each test
tampers with one field the index keeps, the way a bug would, and expects check() to name it.
"""

from __future__ import annotations

import math
import re

import pytest
from letters import BT, DISK, GPU, HASHER, HOST, NS, key, ref

from kvtier.errors import InvariantError
from kvtier.index import RadixIndex


def scenario() -> RadixIndex:
    ix = RadixIndex(("gpu", "host", "disk"), block_tokens=BT, hasher=HASHER)
    ix.insert(ix.match(NS, key("ABC")), key("ABC"), {GPU: [0, 1, 2], HOST: [0, 1, 2]})
    ix.insert(ix.match(NS, key("ABD")), key("ABD"), {HOST: [3]})
    ix.check()
    return ix


def expect(ix: RadixIndex, message: str) -> None:
    with pytest.raises(InvariantError, match=re.escape(message)):
        ix.check()


def test_the_untouched_scenario_passes() -> None:
    ix = scenario()
    assert (ix.num_nodes, ix.num_blocks, [ix.resident(t) for t in range(3)]) == (3, 4, [3, 4, 0])


def test_a_wrong_depth_is_caught() -> None:
    ix = scenario()
    ref(ix, "AB").node.depth[GPU] = 1
    expect(ix, "depth [1, 2, 2] != recount [2, 2, 2]")


def test_a_wrong_child_count_is_caught() -> None:
    ix = scenario()
    ref(ix, "AB").node.child_res[HOST] = 1
    expect(ix, "child_res [1, 1, 2] != [1, 2, 2]")


def test_a_slot_used_twice_is_caught() -> None:
    ix = scenario()
    ref(ix, "ABD").node.slots[HOST][0] = 2  # C's host slot
    expect(ix, "host slot 2 holds two blocks")


def test_a_block_without_any_copy_is_caught() -> None:
    ix = scenario()
    ref(ix, "ABD").node.slots[HOST][0] = None
    expect(ix, "block 0 of Node(size=1, depth=[0, 1, 1]")


def test_broken_prefix_closure_is_caught() -> None:
    ix = scenario()
    trunk = ref(ix, "AB").node
    trunk.slots[GPU][1] = None  # B leaves the gpu behind C's back...
    trunk.depth = [1, 2, 2]  # ...and the derived fields are "fixed up" to match
    ix.candidates(GPU)[trunk] = 0
    ix.residency._resident[GPU] -= 1  # fault injection into the index's counts
    expect(ix, "prefix closure broken: block 0 of Node(size=1, depth=[1, 1, 1]")
    expect(ix, "is on tier 0 below a parent block on tier 1")


def test_wrong_counts_are_caught() -> None:
    ix = scenario()
    ix.residency._resident[DISK] = 1
    expect(ix, "resident blocks per tier [3, 4, 1] != recount [3, 4, 0]")
    ix = scenario()
    ix.forest.num_blocks = 6
    expect(ix, "num_blocks 6 != recount 4")
    ix = scenario()
    ix.forest.num_nodes = 2
    expect(ix, "num_nodes 2 != recount 3")


def test_a_lock_without_a_lease_is_caught() -> None:
    ix = scenario()
    ref(ix, "ABC").node.locks = [1, 0, 0]
    expect(ix, "locks [1, 0, 0] != leases covering it [0, 0, 0]")


def test_a_leased_copy_that_vanished_is_caught() -> None:
    ix = scenario()
    record = ix.leases.acquire(ix.match(NS, key("ABC")).end, (GPU,), math.inf, 3)
    ix.check()
    ref(ix, "ABC").node.slots[GPU][0] = None
    expect(ix, f"lease {record.lease_id}: 1 blocks of a leased node lost their gpu copy")


def test_a_missing_or_stale_eviction_candidate_is_caught() -> None:
    ix = scenario()
    ix.candidates(GPU).pop(ref(ix, "ABC").node)
    expect(ix, "gpu candidate is False, expected True")
    ix = scenario()
    ix.candidates(GPU)[ref(ix, "AB").node] = 0  # C still hangs below B on gpu
    expect(ix, "gpu candidate is True, expected False")


def test_a_child_filed_under_a_wrong_key_is_caught() -> None:
    ix = scenario()
    trunk = ref(ix, "AB").node
    assert trunk.children is not None
    trunk.children[key("X")] = trunk.children.pop(key("D"))
    expect(ix, "is filed under another key")
