"""Leases on the radix index: locks on whole prefixes, exact release, expiry by the clock given.

Keys are one letter per block (`key("ABD")`: A A A A B B B B D D D D). Tiers: 0 gpu, 1 host,
2 disk.
"""

from __future__ import annotations

import math

import pytest
from letters import GPU, HOST, NS, key, new_index, put

from kvtier.errors import LeaseError
from kvtier.index import LeaseId, LeaseRecord, Node, PrefixHit, RadixIndex


def lease(ix: RadixIndex, blocks: str, tiers: tuple[int, ...], expires_at: float) -> LeaseRecord:
    match = ix.match(NS, key(blocks))
    record = ix.leases.acquire(match.end, tiers, expires_at, match.num_blocks)
    ix.check()
    return record


def node(ix: RadixIndex, blocks: str) -> Node:
    """The node that ends exactly at the path `blocks`."""
    found = ix.match(NS, key(blocks)).end
    assert found.key.endswith(key(blocks[-1]))
    return found


def gpu_victims(ix: RadixIndex) -> list[int]:
    """Sizes of the path up to each gpu victim, in the order offered, dropping each one."""
    depths = []
    for victim in ix.victims(GPU):
        depths.append(sum(n.size for n in ix.path(victim.node)) - victim.node.size + victim.i + 1)
        ix.drop(victim)
        ix.check()
    return depths


def trunk_with_two_branches() -> RadixIndex:
    ix = new_index()
    put(ix, "ABC", {GPU: [0, 1, 2], HOST: [0, 1, 2]})
    put(ix, "ABD", {GPU: [3], HOST: [3]})
    return ix


def test_a_lease_locks_every_node_of_its_path_and_release_unlocks_them() -> None:
    ix = trunk_with_two_branches()
    first = lease(ix, "ABC", (GPU,), 10.0)
    assert (first.num_blocks, first.tiers) == (3, (GPU,)) and 0 < first.lease_id < 2**63
    trunk, c, d = node(ix, "AB"), node(ix, "ABC"), node(ix, "ABD")
    assert (trunk.locks, c.locks, d.locks) == ([1, 0, 0], [1, 0, 0], None)
    second = lease(ix, "ABD", (GPU, HOST), 10.0)
    assert (trunk.locks, c.locks, d.locks) == ([2, 1, 0], [1, 0, 0], [1, 1, 0])
    assert (len(ix.leases), first.lease_id in ix.leases, ix.leases.get(second.lease_id)) == (
        2,
        True,
        second,
    )
    assert ix.leases.release(first.lease_id) == first
    ix.check()
    assert (trunk.locks, c.locks, d.locks) == ([1, 1, 0], [0, 0, 0], [1, 1, 0])
    ix.leases.release(second.lease_id)
    ix.check()
    assert (trunk.locks, c.locks, d.locks, len(ix.leases)) == ([0, 0, 0], [0, 0, 0], [0, 0, 0], 0)


def test_unknown_or_double_release_is_a_lease_error() -> None:
    ix = trunk_with_two_branches()
    record = lease(ix, "AB", (GPU,), 10.0)
    ix.leases.release(record.lease_id)
    gone = f"^lease {record.lease_id}: unknown, released or expired$"
    with pytest.raises(LeaseError, match=gone):
        ix.leases.release(record.lease_id)
    with pytest.raises(LeaseError, match=r"^lease 99: unknown, released or expired$"):
        ix.leases.release(LeaseId(99))
    with pytest.raises(LeaseError, match=gone):
        ix.leases.get(record.lease_id)
    ix.check()
    assert node(ix, "AB").locks == [0, 0, 0]


def test_expire_releases_exactly_the_leases_due_by_then() -> None:
    ix = trunk_with_two_branches()
    due_10 = lease(ix, "ABC", (GPU,), 10.0)
    due_5 = lease(ix, "ABD", (GPU,), 5.0)
    forever = lease(ix, "AB", (HOST,), math.inf)
    released_early = lease(ix, "ABC", (HOST,), 7.0)
    ix.leases.release(released_early.lease_id)
    assert ix.leases.expire(4.9) == []
    assert ix.leases.expire(10.0) == [due_5, due_10]
    ix.check()
    assert [r.lease_id for r in ix.leases] == [forever.lease_id]
    assert ix.leases.expire(1e18) == []
    assert node(ix, "AB").locks == [0, 1, 0]
    with pytest.raises(LeaseError):
        ix.leases.release(due_5.lease_id)


def test_a_lease_ending_inside_a_node_covers_exactly_its_blocks() -> None:
    ix = new_index()
    put(ix, "ABCD", {GPU: [0, 1, 2, 3]})
    record = lease(ix, "AB", (GPU,), 10.0)  # match splits ABCD into AB + CD
    assert (record.num_blocks, ix.num_nodes) == (2, 2)
    assert (node(ix, "AB").locks, node(ix, "ABCD").locks) == ([1, 0, 0], None)
    assert gpu_victims(ix) == [4, 3]
    assert ix.lookup(NS, key("ABCD")) == PrefixHit(2, (2, 0, 0))
    ix.leases.release(record.lease_id)
    ix.check()
    assert gpu_victims(ix) == [2, 1]
    assert ix.num_blocks == 0


def test_splitting_a_leased_node_keeps_the_whole_lease() -> None:
    ix = new_index()
    put(ix, "ABCD", {GPU: [0, 1, 2, 3]})
    record = lease(ix, "ABCD", (GPU,), 10.0)
    ix.match(NS, key("ABX"))  # splits the leased node; the head inherits its locks
    ix.check()
    assert (node(ix, "AB").locks, node(ix, "ABCD").locks) == ([1, 0, 0], [1, 0, 0])
    assert gpu_victims(ix) == []
    ix.leases.release(record.lease_id)
    ix.check()
    assert gpu_victims(ix) == [4, 3, 2, 1]


def test_blocks_added_after_a_leased_leaf_are_not_leased() -> None:
    ix = new_index()
    put(ix, "AB", {GPU: [0, 1], HOST: [0, 1]})
    record = lease(ix, "AB", (GPU,), 10.0)
    put(ix, "ABC", {HOST: [2]})  # C has no gpu copy, so the gpu lease must not cover it
    put(ix, "ABCD", {HOST: [3]})
    assert (ix.num_nodes, node(ix, "AB").locks, node(ix, "ABCD").locks) == (2, [1, 0, 0], None)
    assert ix.leases.get(record.lease_id).num_blocks == 2
    host_victims = [v.i for v in ix.victims(HOST)]
    assert host_victims == [1]  # D, the last block of node CD: a host leaf, not leased
    ix.leases.release(record.lease_id)
    ix.check()
    assert node(ix, "AB").locks == [0, 0, 0]


def test_an_empty_lease_at_a_namespace_root_locks_nothing() -> None:
    ix = new_index()
    record = lease(ix, "AB", (GPU,), 10.0)
    assert (record.num_blocks, ix.num_namespaces) == (0, 0)
    put(ix, "AB", {GPU: [0, 1]})
    assert node(ix, "AB").locks is None
    ix.leases.release(record.lease_id)
    ix.check()
