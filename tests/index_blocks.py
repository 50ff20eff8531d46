"""Blocks of a `RadixIndex` named for the model tests (`test_index_model.py`,
`test_index_audit_AJ.py`): a block is (namespace number, path), a path one letter per block of
`BT` tokens, so keys share prefixes and diverge often."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.blocks import TOKEN_NBYTES, BlockId, encode_tokens
from kvtier.index import BlockRef, RadixIndex

BT = 2
KB = BT * TOKEN_NBYTES
Block = tuple[int, str]  # (namespace, one letter per block)


def key(path: str, extra: int = 0) -> bytes:
    """The tokens of `path` (and `extra` tokens more, a partial block) as key bytes."""
    return encode_tokens([ord(c) for c in path for _ in range(BT)] + [7] * extra)


def find(ix: RadixIndex, seeds: Sequence[BlockId], block: Block) -> BlockRef:
    """Where `block` lives in `ix` (it must)."""
    ns, path = block
    node, pos = ix.root(seeds[ns]), 0
    while True:
        assert node.children is not None
        node = node.children[key(path[pos])]
        if pos + node.size >= len(path):
            return BlockRef(node, len(path) - 1 - pos)
        pos += node.size


def name(ix: RadixIndex, seeds: Sequence[BlockId], ref: BlockRef) -> Block:
    """The block at `ref`."""
    nodes = ix.path(ref.node)
    root = nodes[0].parent
    assert root is not None
    letters = "".join(chr(n.key[i * KB]) for n in nodes for i in range(n.size))
    return seeds.index(BlockId(root.ids)), letters[: len(letters) - ref.node.size + ref.i + 1]
