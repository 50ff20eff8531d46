"""`QuantPool`: the host tier keeping its blocks quantized (`tiers.host.codec: fp8 | int8 | int4`).

    buffer = [num_slots, payload_nbytes]   uint8: one `QuantCodec` payload a slot

The slot bookkeeping is `SlotPool`'s; what differs is what a slot holds, so every way a block
gets in or out encodes or decodes it:

    write(slots, blocks)        encode on the blocks' device, then copy the payloads in
    read(slots)                 decode (torch, on the CPU) into a new `[n, *block_shape]` tensor
    payloads(slots)             the payloads as they are (a gpu promotion decodes them there:
                                `kernels/dequant.py` on CUDA; a disk tier of the same codec
                                writes them as they are)
    put_payloads(slots, data)   payloads in, as they are (a disk copy of the same codec)

The mover's copies go through these (`transfer/copy.py`, `transfer/cuda.py`), so the pool's
memory is never read as blocks. A block is encoded once on its way down: a disk tier of the same
codec takes the payload as it is, rather than decoding and encoding again (which would round a
second time). The gpu tier always keeps the engine's dtype.

Contract:
- `write` refuses blocks the codec cannot keep (`InvalidKVError`: a value not finite or past
  fp16's range), before anything is written; `keepable(blocks)` says which those are, so that a
  demotion can leave them out and write the rest.
- The pool lives in plain (or pinned) memory, never in a shared segment: a sidecar client maps
  pools as blocks of the layout (`/v1/pools`), and this one holds payloads.
- `capacity_bytes` and `used_bytes` count payload bytes: the same bytes hold `block_bytes /
  payload_nbytes` times the blocks of a raw host tier.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError, InvalidKVError
from kvtier.quant import QuantCodec
from kvtier.tiers.host import resolve_pinned
from kvtier.tiers.pool import SlotPool


class QuantPool(SlotPool):
    """Slots of `codec` payloads in CPU memory (module doc)."""

    def __init__(
        self, codec: QuantCodec, num_slots: int, pin_memory: bool = False, name: str = "host"
    ) -> None:
        self.codec = codec
        super().__init__(name, codec.layout, num_slots, torch.device("cpu"), pin_memory)

    @classmethod
    def create_quantized(
        cls, codec: QuantCodec, capacity_bytes: int, pinned: str | bool = "auto"
    ) -> QuantPool:
        """A host pool of `capacity_bytes // codec.payload_nbytes` slots."""
        num_slots = capacity_bytes // codec.payload_nbytes
        if num_slots < 1:
            expected = f"at least one {codec.name} block of {codec.payload_nbytes} bytes"
            raise ConfigError("tiers.host.capacity", capacity_bytes, expected)
        return cls(codec, num_slots, resolve_pinned(pinned))

    def _slot_format(self) -> tuple[tuple[int, ...], torch.dtype]:
        return (self.codec.payload_nbytes,), torch.uint8

    def keepable(self, blocks: torch.Tensor) -> list[bool]:
        """Per block, whether `write` takes it (module doc)."""
        return [bool(ok) for ok in self.codec.keepable(blocks).tolist()]

    def write(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Encode `blocks` (`[len(slots), *block_shape]` of the layout's dtype, any device) and
        copy the payloads into `slots`; checks everything before writing."""
        expected = (len(slots), *self.layout.block_shape)
        if blocks.dtype != self.layout.dtype or tuple(blocks.shape) != expected:
            raise InvalidKVError(
                f"pool {self.name!r}: blocks of {blocks.dtype} {list(blocks.shape)}, expected "
                f"{self.layout.dtype} {list(expected)}"
            )
        if not all(self.keepable(blocks)):
            raise InvalidKVError(
                f"pool {self.name!r}: a value is not finite or beyond fp16's range; its "
                f"{self.codec.name} copies cannot keep it"
            )
        self.put_payloads(slots, self.codec.encode(blocks))

    def put_payloads(self, slots: Sequence[int], payloads: torch.Tensor) -> None:
        """Copy `payloads` (`[len(slots), payload_nbytes]` uint8, already encoded) into `slots`
        (`SlotPool.write`: a slot's format is a payload)."""
        super().write(slots, payloads)

    def payloads(self, slots: Sequence[int]) -> torch.Tensor:
        """A copy of the payloads of `slots`, `[len(slots), payload_nbytes]` uint8."""
        return super().read(slots)

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        """The blocks of `slots` decoded, `[len(slots), *block_shape]` of the layout's dtype."""
        return self.codec.decode(self.payloads(slots))

    def block(self, slot: int) -> torch.Tensor:
        """One slot decoded: a copy, not a view (the slot holds a payload)."""
        return self.read([slot])[0]
