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
2**-64. The words come from a generator seeded from the operating system per reservation: they
must be fresh, not secret, since the only party that could exploit a prediction (by writing
the canaries and nothing else) is one that maps the pool, which can read them anyway. The
slots are not scrubbed: zeroing them would cost a memset per block, and a slot with a canary
left is never published, so what else it holds is never read.

Cost: one scatter at `plant` and one gather at `unwritten` of 8 bytes per 4 KiB page (0.2% of
the block's bytes), on the pool's device: CPU, shared memory and CUDA alike. On CUDA `plant`
synchronises the device, so a writer in another process (CUDA IPC) writes after the canaries.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.tiers.pool import SlotPool

PAGE_BYTES = 4096
WORD_BYTES = 8
_ELEMENTS = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}
"""The pool is read as elements of the widest size that divides a block (8 bytes for any real
layout), so that a canary is one element, or a few consecutive ones, and slots stay aligned."""


class Canaries:
    """The canary words planted in `slots` of `pool`, for one reservation.

    The index arithmetic and, for a pool in CPU memory, the scatter and the gather run in NumPy
    on the calling thread: torch would hand these small operations to its worker threads, which
    then spin for a while on the server's cores, just when its client writes the reserved slots
    (measured: the client's first write into the slots 20% slower)."""

    def __init__(self, pool: SlotPool, slots: Sequence[int]) -> None:
        """Plant: write a fresh random word into every page of each of `slots` (allocated,
        owned by the caller) now."""
        block_bytes = pool.layout.block_bytes
        buffer = pool.buffer  # slots of whole blocks (not a quantized tier's payloads)
        assert buffer.stride(0) * buffer.element_size() == block_bytes, "a pool of blocks"
        self.pool = pool
        self.slots = tuple(slots)
        element = math.gcd(WORD_BYTES, block_bytes)
        self._dtype = _ELEMENTS[element]
        width = min(WORD_BYTES, block_bytes)  # bytes of one canary
        per = width // element  # elements of one canary
        self._pages = pages = -(-block_bytes // PAGE_BYTES)  # per slot
        assert self.slots, "a reservation has slots"
        # seeded from the OS for each reservation; the words need not resist prediction (see
        # the module doc: who could use a prediction can read them anyway), only be fresh, and
        # reading the OS source for every page cost more than the rest of the reservation.
        # Drawn as 64-bit integers (`rng.bytes` took 7x as long) and laid out [slot, page],
        # the per-page arithmetic done once for all slots, one index per canary when it is one
        # element (measured, 256 MiB of 1 MiB blocks, 65,536 canaries, three alternating runs:
        # planted in 5.9-6.3 -> 4.2-4.3 ms, checked in 3.7-4.1 -> 3.0-3.3 ms; the scatter and
        # the gather themselves, about 2 and 2.5 ms, are one cache miss per page)
        rng = np.random.default_rng(secrets.randbits(128))
        shape = (len(self.slots), pages)
        raw = rng.integers(0, 1 << 64, size=(*shape, 1), dtype=np.uint64)  # a word a canary
        values = raw.view(self._dtype)[..., :per].reshape((-1, per) if per > 1 else (-1,))
        page_start = np.arange(pages, dtype=np.int64) * PAGE_BYTES
        page_len = np.minimum(block_bytes - page_start, PAGE_BYTES)
        # a canary's place in its page, in words: any of the `words` that fit in the page (so
        # no canary crosses the block's end: a page shorter than a word is a whole block)
        words = np.maximum((page_len - width) // WORD_BYTES + 1, 1)
        if (words == words[0]).all():  # whole pages: one bound, drawn 3x as fast (0.35 ms)
            draws = rng.integers(0, int(words[0]), size=shape)
        else:
            draws = (rng.random(shape) * words).astype(np.int64)
        slot_start = np.asarray(self.slots, dtype=np.int64)[:, None] * (block_bytes // element)
        page_offset = page_start // element + draws * (WORD_BYTES // element)
        starts = (slot_start + page_offset).reshape(-1)  # in elements, [slot, page]
        index = starts if per == 1 else starts[:, None] + np.arange(per, dtype=np.int64)
        device = pool.buffer.device
        if device.type == "cpu":
            self._index: np.ndarray | torch.Tensor = index
            self._values: np.ndarray | torch.Tensor = values
            self._host_elements()[index] = values
            return
        self._index = torch.from_numpy(index).to(device)
        self._values = torch.from_numpy(values).to(device)
        self._device_elements()[self._index] = self._values
        torch.cuda.synchronize(device)

    def unwritten(self) -> list[int]:
        """The slots (in `slots` order) where a canary is still there: not (wholly) written."""
        per_slot: list[bool]
        if isinstance(self._index, np.ndarray):
            equal = np.equal(self._host_elements()[self._index], self._values)
            kept = equal if equal.ndim == 1 else equal.all(axis=1)
            per_slot = kept.reshape(len(self.slots), self._pages).any(axis=1).tolist()
        else:
            assert isinstance(self._values, torch.Tensor)
            equal_t = torch.eq(self._device_elements()[self._index], self._values)
            left = equal_t if equal_t.dim() == 1 else equal_t.all(dim=1)
            per_slot = left.view(len(self.slots), self._pages).any(dim=1).tolist()
        return [slot for slot, kept in zip(self.slots, per_slot, strict=True) if kept]

    def _host_elements(self) -> np.ndarray:
        flat: np.ndarray = self.pool.buffer.view(-1).view(torch.uint8).numpy()
        return flat.view(self._dtype)

    def _device_elements(self) -> torch.Tensor:
        flat = self.pool.buffer.view(-1).view(torch.uint8)
        return flat.view(_TORCH[self._dtype])


_TORCH = {
    np.int64: torch.int64,
    np.int32: torch.int32,
    np.int16: torch.int16,
    np.uint8: torch.uint8,
}
