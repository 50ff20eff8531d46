"""A caller's blocks seen as a pool, so that one transfer can write them where they go.

`StagedBlocks(layout, blocks)` is a `SlotPool` of `len(blocks)` slots whose buffer is `blocks`
itself (`[n, *block_shape]` in the layout's dtype; slot i is block i): nothing is copied or
allocated. The write path uses it when a call waits for its own disk insert (an inline mover,
`transfer/background.py`): the insert's transfer then reads the caller's tensor directly,
where a background insert stages the blocks in host slots first (the caller may reuse its
tensor once `store` returns). Its slots are never allocated from, and it is never an index tier.
"""

from __future__ import annotations

import torch

from kvtier.blocks import KVLayout
from kvtier.tiers.pool import SlotPool


class StagedBlocks(SlotPool):
    def __init__(self, layout: KVLayout, blocks: torch.Tensor) -> None:
        assert tuple(blocks.shape[1:]) == tuple(layout.block_shape), "whole blocks of the layout"
        self._blocks = blocks.contiguous()
        name = "host" if blocks.device.type == "cpu" else "gpu"
        super().__init__(name, layout, max(1, blocks.shape[0]), blocks.device)

    def _allocate_buffer(self) -> torch.Tensor:
        return self._blocks
