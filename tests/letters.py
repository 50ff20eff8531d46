"""Index test helpers: keys written one letter per block.

`key("ABD")` is the tokens A A A A B B B B D D D D (block_tokens 4), so "ABC" and "ABD" share
the blocks A and B and diverge at the third. Tiers: 0 gpu, 1 host, 2 disk.
"""

from __future__ import annotations

from kvtier.blocks import TOKEN_NBYTES, BlockHasher, BlockId, encode_tokens, tenant_salt
from kvtier.index import BlockRef, InsertResult, RadixIndex

BT = 4
KB = BT * TOKEN_NBYTES
GPU, HOST, DISK = 0, 1, 2
HASHER = BlockHasher()
NS = HASHER.seed(b"layout-fingerprt", tenant_salt("alice"))
NS_BOB = HASHER.seed(b"layout-fingerprt", tenant_salt("bob"))


def key(blocks: str, extra: int = 0) -> bytes:
    """One block of 4 equal tokens per letter, then `extra` tokens of a partial block."""
    return encode_tokens([ord(c) for c in blocks for _ in range(BT)] + [1] * extra)


def new_index(tiers: tuple[str, ...] = ("gpu", "host", "disk")) -> RadixIndex:
    return RadixIndex(tiers, block_tokens=BT, hasher=HASHER)


def put(ix: RadixIndex, blocks: str, slots: dict[int, list[int]], ns: BlockId = NS) -> InsertResult:
    """Insert the blocks of `blocks` after their cached prefix, then check the index."""
    result = ix.insert(ix.match(ns, key(blocks)), key(blocks), slots)
    ix.check()
    return result


def ref(ix: RadixIndex, blocks: str, ns: BlockId = NS) -> BlockRef:
    """The last block of the path `blocks`, found without splitting any node."""
    node, pos = ix.root(ns), 0
    while True:
        assert node.children is not None
        node = node.children[key(blocks[pos])]
        assert node.key.startswith(key(blocks[pos : pos + node.size]))
        if pos + node.size >= len(blocks):
            return BlockRef(node, len(blocks) - 1 - pos)
        pos += node.size
