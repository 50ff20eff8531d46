"""Canaries: proof that a reserved slot was written before it is published (DESIGN invariant 8).

A freshly reserved slot still holds what its last user left there: a block that LRU dropped,
possibly another tenant's. A writer that commits without writing would publish those bytes
under its own tokens (a read of the other tenant's KV through `load`, and cache poisoning).
`Canaries.plant` writes a fresh random 64-bit word at a random 8-byte-aligned offset of every
4 KiB page of each slot (one per slot at least, fewer bytes when a block is smaller than 8);
`unwritten()` reads them back and names the slots where one is still there:

    slot s:  | page 0            | page 1            | ... | page P-1 (maybe partial) |
                   ^ word r0*8          ^ word r1*8               ^ word (clamped to the end)

A writer that writes whole blocks overwrites every canary; a client that cannot map the pool
(a body-only client, another Unix user) cannot touch them and never learns them, so its commit
is refused. A word that the writer's own data happens to repeat passes wrongly with odds
2**-64. The slots are not scrubbed: zeroing them would cost a memset per block, and a slot
with a canary left is never published, so what else it holds is never read.

Cost: one scatter at `plant` and one gather at `unwritten` of 8 bytes per 4 KiB page (0.2% of
the block's bytes), on the pool's device: CPU, shared memory and CUDA alike. On CUDA `plant`
synchronises the device, so a writer in another process (CUDA IPC) writes after the canaries.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch

from kvtier.tiers.pool import SlotPool

PAGE_BYTES = 4096
WORD_BYTES = 8
_ELEMENTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
"""The pool is read as elements of the widest size that divides a block (8 bytes for any real
layout), so that a canary is one element, or a few consecutive ones, and slots stay aligned."""


class Canaries:
    """The canary words planted in `slots` of `pool`, for one reservation."""

    def __init__(self, pool: SlotPool, slots: Sequence[int]) -> None:
        """Plant: write a fresh random word into every page of each of `slots` (allocated,
        owned by the caller) now."""
        block_bytes = pool.layout.block_bytes
        self.pool = pool
        self.slots = tuple(slots)
        element = math.gcd(WORD_BYTES, block_bytes)
        self._dtype = _ELEMENTS[element]
        width = min(WORD_BYTES, block_bytes)  # bytes of one canary
        self._pages = -(-block_bytes // PAGE_BYTES)  # per slot
        count = len(self.slots) * self._pages
        assert count > 0, "a reservation has slots"
        values = _random(count * width // element, self._dtype).view(count, width // element)
        draws = _random(count, torch.int16).to(torch.int64) & 0xFFFF  # uniform in [0, 2**16)
        page = torch.arange(count, dtype=torch.int64) % self._pages
        page_len = torch.clamp(block_bytes - page * PAGE_BYTES, max=PAGE_BYTES)
        words = torch.clamp((page_len - width) // WORD_BYTES + 1, min=1)
        offset = torch.clamp(
            page * PAGE_BYTES + (draws % words) * WORD_BYTES, max=block_bytes - width
        )
        slot = torch.tensor(self.slots, dtype=torch.int64).repeat_interleave(self._pages)
        starts = (slot * block_bytes + offset) // element  # in elements
        device = pool.buffer.device
        self._index = (starts[:, None] + torch.arange(width // element)).to(device)
        self._values = values.to(device)
        self._elements()[self._index] = self._values
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def unwritten(self) -> list[int]:
        """The slots (in `slots` order) where a canary is still there: not (wholly) written."""
        left = (self._elements()[self._index] == self._values).all(dim=1)
        per_slot = left.view(len(self.slots), self._pages).any(dim=1).tolist()
        return [slot for slot, kept in zip(self.slots, per_slot, strict=True) if kept]

    def _elements(self) -> torch.Tensor:
        return self.pool.buffer.view(-1).view(self._dtype)


def _random(count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` values of `dtype` from the operating system's random source."""
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(bytearray(secrets.token_bytes(nbytes)), dtype=dtype)
