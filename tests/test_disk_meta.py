"""What a disk copy records about its block (`Namespaces.describe`): one `BlockMeta` per block,
in the order asked, the same whether the blocks come one node at a time or mixed, and whatever
the ids read before."""

from __future__ import annotations

from letters import HASHER, HOST, KB, NS, NS_BOB, key, new_index, put, ref

from kvtier.index import BlockRef, RadixIndex
from kvtier.tenancy import Namespaces
from kvtier.tiers.disk import BlockMeta

NAMESPACES = Namespaces(["alice", "bob"], HASHER, b"layout-fingerprt", b"")


def one_by_one(ix: RadixIndex, r: BlockRef) -> BlockMeta:
    """The metadata of one block, read through the index's per-block accessors."""
    namespace = ix.namespace_of(r.node)
    tenant = NAMESPACES.tenant_of(namespace)
    assert tenant is not None
    tokens = r.node.key[r.i * KB : (r.i + 1) * KB]
    return BlockMeta(ix.block_id(r), ix.parent_id(r), namespace, tenant, tokens)


def test_describe_gives_each_blocks_ids_namespace_tenant_and_tokens_in_the_order_asked() -> None:
    ix = new_index()
    put(ix, "ABCDE", {HOST: [0, 1, 2, 3, 4]})
    put(ix, "ABXY", {HOST: [5, 6]})  # splits ABCDE after B: nodes AB, CDE, XY
    put(ix, "AQ", {HOST: [7, 8]}, ns=NS_BOB)
    assert NAMESPACES.seeds == {"alice": NS, "bob": NS_BOB}
    trunk, cde, xy = ref(ix, "AB").node, ref(ix, "ABCDE").node, ref(ix, "ABXY").node
    bob = ref(ix, "AQ", ns=NS_BOB).node
    refs = [BlockRef(cde, 2), BlockRef(cde, 0), BlockRef(trunk, 0), BlockRef(xy, 1)]
    refs += [BlockRef(bob, 1), BlockRef(cde, 1), BlockRef(trunk, 1), BlockRef(bob, 0)]
    metas = NAMESPACES.describe(ix, refs)  # no id read yet: describe chains them
    assert metas == tuple(one_by_one(ix, r) for r in refs)
    ids = HASHER.chain(NS, key("ABCDE"), KB)
    ds = HASHER.digest_size
    assert metas[0] == BlockMeta(ids[4 * ds :], ids[3 * ds : 4 * ds], NS, "alice", key("E"))
    assert metas[1].parent_id == ids[ds : 2 * ds]  # the first block of a node: the parent's last
    assert metas[2].parent_id == NS  # the first block of a namespace: its seed
    assert (metas[4].namespace, metas[4].tenant, metas[4].tokens) == (NS_BOB, "bob", key("Q"))
    assert NAMESPACES.describe(ix, []) == ()
