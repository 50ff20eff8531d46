"""Verified reads of the disk tier: a copy is returned only when every check passes.

    read_blocks(slots, block_ids, out)
      one job per copy, on the I/O threads: one `preadv` of [ header region | payload ], then

      header checksum -> expected block id -> layout -> raw size -> payload checksum -> codec

Contract:
- A copy that fails a check is reported so (False) and counted in `corrupt_reads`; one whose
  read fails, in `read_errors`. Neither raises, and neither is returned as valid: its
  destination holds garbage.
- Plain payloads land in place when the destination is page-aligned and exactly one payload
  long; others go through an aligned staging buffer and are copied (decoded) into place.
- Reads change nothing on disk and no state of the tier but its fault counters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.tiers.disk.codec import CorruptPayload, get_codec
from kvtier.tiers.disk.format import CorruptHeader, checksum, decode_header
from kvtier.tiers.disk.health import DiskHealth
from kvtier.tiers.disk.io import staging_buffer
from kvtier.tiers.disk.slab_set import SlabSet, direct_ready


class VerifiedReader:
    """Reads copies of one layout from the slots of one tier and checks each."""

    def __init__(
        self, layout: KVLayout, header_region: int, slabs: SlabSet, health: DiskHealth
    ) -> None:
        self.layout = layout
        self.header_region = header_region
        self.payload_region = slabs.slot_bytes - header_region
        self._slabs = slabs
        self._health = health

    def read_blocks(
        self,
        slots: Sequence[int],
        block_ids: Sequence[bytes],
        out: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | Sequence[torch.Tensor], list[bool]]:
        """Read and verify copies into `out` (n block tensors, e.g. pool slots; a new
        `[n, *block_shape]` tensor when None) and say, per block, whether it is valid. Plain
        payloads land in place when the destination is page-aligned; others go through an
        aligned staging buffer. A destination whose copy failed holds garbage."""
        dest: torch.Tensor | Sequence[torch.Tensor] = (
            out
            if out is not None
            else torch.empty((len(slots), *self.layout.block_shape), dtype=self.layout.dtype)
        )
        flat = [block.view(torch.uint8).reshape(-1) for block in dest]
        jobs = [self._read_job(slot, flat[i], block_ids[i]) for i, slot in enumerate(slots)]
        ok = []
        for result in self._slabs.run(jobs):
            if isinstance(result, OSError):
                self._health.count("read_errors", 1)
                ok.append(False)
            elif not result:
                self._health.count("corrupt_reads", 1)
                ok.append(False)
            else:
                ok.append(True)
        return dest, ok

    def _read_job(self, slot: int, dest: torch.Tensor, block_id: bytes) -> Callable[[], bool]:
        slab, offset = self._slabs.where(slot)
        region, payload_region = self.header_region, self.payload_region

        def job() -> bool:
            target = dest.numpy().data
            if direct_ready(dest) and len(target) == payload_region:
                head = staging_buffer(region)
                slab.readv(offset, [head, target])
                payload = target
            else:
                image = staging_buffer(region + payload_region)
                slab.readv(offset, [image])
                head, payload = image[:region], image[region:]
            decoded = self._verify(head, payload, block_id)
            if decoded is None:
                return False
            if decoded is not target:
                np.frombuffer(target, dtype=np.uint8)[:] = np.frombuffer(decoded, dtype=np.uint8)
            return True

        return job

    def _verify(
        self, head: memoryview, payload: memoryview, block_id: bytes
    ) -> bytes | memoryview | None:
        """The decoded payload of a slot if every check passes, else None."""
        try:
            header = decode_header(head)
        except CorruptHeader:
            return None
        if (
            header is None
            or header.block_id != block_id
            or header.layout != self.layout.fingerprint
            or header.raw_nbytes != self.layout.block_bytes
            or header.payload_nbytes > len(payload)
        ):
            return None
        stored = payload[: header.payload_nbytes]
        if checksum(stored) != header.payload_checksum:
            return None
        if header.codec == "none":
            return stored if len(stored) == self.layout.block_bytes else None
        try:
            decoded = get_codec(header.codec).decode(
                stored, header.raw_nbytes, self.layout.itemsize
            )
        except (CorruptPayload, ValueError):
            return None
        return bytes(decoded) if len(decoded) == self.layout.block_bytes else None
