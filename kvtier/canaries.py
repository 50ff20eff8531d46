"""Canaries: proof that a reserved slot was written before it is published (DESIGN invariant 8).

A freshly reserved slot still holds what its last user left there: a block that LRU dropped,
possibly another tenant's. A writer that commits without writing would publish those bytes
under its own tokens (a read of the other tenant's KV through `load`, and cache poisoning).
`Canaries.plant` writes a fresh random word (64 bits in any real layout) at a random aligned
offset of every piece of each slot; `unwritten()` reads them back and names the slots where one
is still there. A slot is cut into pieces at every 4 KiB page boundary AND at every boundary of
its per-layer K and V halves (`blocks.KVLayout`: a slot is `[layers, 2, block_tokens, heads,
dim]`, so each (layer, K|V) is one contiguous segment of `block_bytes / (2 * layers)` bytes):

    slot s:  | L0 K      | L0 V      | L1 K      | L1 V      | ...      (segments)
             | page 0          | page 1          | page 2    ...         (4 KiB pages)
             |  ^  |    ^ |  ^ |^   |    ^      | ^ ...                  (one canary a piece)

What is deterministic: a writer that left any whole page, or any whole layer's K or V half,
unwritten leaves that piece's canary, so its commit is refused, always. Engines write layer by
layer (vLLM saves per layer), so a writer that stopped after some layers is the realistic
failure; before, a block under 4 KiB had one canary and such a commit passed about a quarter
of the time, publishing the previous occupant's layers. What stays probabilistic: a writer that
wrote part of a segment and part of a page is refused only if it missed a canary: with odds
(unwritten bytes of the piece) / (bytes of the piece) for each piece it touched.

A writer that writes whole blocks overwrites every canary; a client that cannot map the pool
(a body-only client, another Unix user) cannot touch them and never learns them, so its commit
is refused. A writer whose own data happens to repeat a canary word is refused wrongly, with
odds 2**-64 a canary (2**-(8 * width) where a segment is shorter than 8 bytes: a toy layout).
The words come from a generator seeded from the operating system per reservation: they must be
fresh, not secret, since the only party that could exploit a prediction (by writing the
canaries and nothing else) is one that maps the pool, which can read them anyway. The slots are
not scrubbed: zeroing them would cost a memset per block, and a slot with a canary left is
never published, so what else it holds is never read.

Cost: one scatter at `plant` and one gather at `unwritten` of 8 bytes per piece, on the pool's
device: CPU, shared memory and CUDA alike; pieces are at most pages + 2 * layers per slot
(SmolLM2, 30 layers, 360 KiB blocks: 120 pieces against 90 pages). The cut of a slot into
pieces is computed once per layout. On CUDA `plant` synchronises the device, so a writer in
another process (CUDA IPC) writes after the canaries.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvtier.tiers.pool import SlotPool

PAGE_BYTES = 4096
WORD_BYTES = 8
_ELEMENTS = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}
"""The pool is read as elements of the widest size that divides every piece, a layer's K or V
half (8 bytes for any real layout), so that a canary is one element, or a few consecutive ones,
and pieces and slots stay aligned."""


class Canaries:
    """The canary words planted in `slots` of `pool`, for one reservation.

    The index arithmetic and, for a pool in CPU memory, the scatter and the gather run in NumPy
    on the calling thread: torch would hand these small operations to its worker threads, which
    then spin for a while on the server's cores, just when its client writes the reserved slots
    (measured: the client's first write into the slots 20% slower)."""

    def __init__(self, pool: SlotPool, slots: Sequence[int]) -> None:
        """Plant: write a fresh random word into every piece (module doc) of each of `slots`
        (allocated, owned by the caller) now."""
        layout = pool.layout
        block_bytes = layout.block_bytes
        buffer = pool.buffer  # slots of whole blocks (not a quantized tier's payloads)
        assert buffer.stride(0) * buffer.element_size() == block_bytes, "a pool of blocks"
        self.pool = pool
        self.slots = tuple(slots)
        assert self.slots, "a reservation has slots"
        cut = _pieces(block_bytes, block_bytes // (2 * layout.num_layers))
        self._dtype = _ELEMENTS[cut.element]
        self._pieces = cut.count  # per slot
        # seeded from the OS for each reservation; the words need not resist prediction (see
        # the module doc: who could use a prediction can read them anyway), only be fresh, and
        # reading the OS source for every page cost more than the rest of the reservation.
        # Drawn as 64-bit integers (`rng.bytes` took 7x as long) and laid out [slot, piece],
        # the per-piece arithmetic done once per layout (`_pieces`), one index per canary when
        # it is one element (measured, 256 MiB of 1 MiB blocks, 65,536 canaries, three
        # alternating runs: planted in 5.9-6.3 -> 4.2-4.3 ms, checked in 3.7-4.1 -> 3.0-3.3 ms;
        # the scatter and the gather themselves, about 2 and 2.5 ms, are one cache miss each)
        rng = np.random.default_rng(secrets.randbits(128))
        shape = (len(self.slots), cut.count)
        raw = rng.integers(0, 1 << 64, size=(*shape, 1), dtype=np.uint64)  # a word a canary
        values = raw.view(self._dtype)[..., : cut.per].reshape(
            (-1, cut.per) if cut.per > 1 else (-1,)
        )
        if cut.uniform:  # one bound for every piece: drawn 3x as fast
            draws = rng.integers(0, int(cut.places[0]), size=shape)
        else:
            draws = (rng.random(shape) * cut.places).astype(np.int64)
        slot_start = np.asarray(self.slots, dtype=np.int64)[:, None] * (block_bytes // cut.element)
        starts = (slot_start + (cut.starts + draws * cut.step)).reshape(-1)  # [slot, piece]
        index = starts if cut.per == 1 else starts[:, None] + np.arange(cut.per, dtype=np.int64)
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
            per_slot = kept.reshape(len(self.slots), self._pieces).any(axis=1).tolist()
        else:
            assert isinstance(self._values, torch.Tensor)
            equal_t = torch.eq(self._device_elements()[self._index], self._values)
            left = equal_t if equal_t.dim() == 1 else equal_t.all(dim=1)
            per_slot = left.view(len(self.slots), self._pieces).any(dim=1).tolist()
        return [slot for slot, kept in zip(self.slots, per_slot, strict=True) if kept]

    def _host_elements(self) -> np.ndarray:
        flat: np.ndarray = self.pool.buffer.view(-1).view(torch.uint8).numpy()
        return flat.view(self._dtype)

    def _device_elements(self) -> torch.Tensor:
        flat = self.pool.buffer.view(-1).view(torch.uint8)
        return flat.view(_TORCH[self._dtype])


@dataclass(frozen=True)
class Cut:
    """Where the canaries of one slot may go, in elements of `element` bytes from the slot's
    start: piece i begins at `starts[i]` and its canary (`per` elements) at one of its
    `places[i]` positions, `step` elements apart."""

    element: int  # bytes of the element the pool is read as
    per: int  # elements of one canary
    step: int  # elements between two places of a canary
    starts: np.ndarray  # [pieces] int64
    places: np.ndarray  # [pieces] int64, >= 1
    uniform: bool  # every piece has as many places

    @property
    def count(self) -> int:
        return len(self.starts)


@lru_cache(maxsize=64)
def _pieces(block_bytes: int, segment_bytes: int) -> Cut:
    """A slot of `block_bytes` cut at every page and every (layer, K|V) segment of
    `segment_bytes` (module doc). Elements and canaries are as wide as every piece allows (8
    bytes in any real layout), so no canary crosses a piece's end; offsets are word-aligned
    (8 bytes) where the elements allow, so a canary is one aligned load."""
    element = math.gcd(WORD_BYTES, segment_bytes)  # divides pages, segments and blocks
    bounds = np.union1d(
        np.arange(0, block_bytes, PAGE_BYTES, dtype=np.int64),
        np.arange(0, block_bytes, segment_bytes, dtype=np.int64),
    )
    lengths = np.diff(np.append(bounds, block_bytes))
    width = min(WORD_BYTES, int(lengths.min()))  # bytes of one canary, a multiple of element
    step = (WORD_BYTES if width == WORD_BYTES else element) // element
    places = (lengths - width) // (step * element) + 1
    return Cut(
        element,
        width // element,
        step,
        bounds // element,
        places,
        bool((places == places[0]).all()),
    )


_TORCH = {
    np.int64: torch.int64,
    np.int32: torch.int32,
    np.int16: torch.int16,
    np.uint8: torch.uint8,
}
