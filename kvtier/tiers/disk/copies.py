"""Block copies on the disk tier: written in group commits, read back verified.

The write path of the disk tier: block copies written in group commits.

    write_blocks(slots, blocks, metas)
      1. one job per copy, on the I/O threads: encode, checksum, header, one `pwritev` of
         [ header region | payload ] at the slot's offset
      2. one sync per slab that took a copy (`fsync: batch`; none under `fsync: none`)
      3. a copy is reported durable (True) only when its write and its slab's sync returned

Contract:
- A failed write or sync fails that copy (counted in `write_errors` / `sync_errors`, and fed to
  the backoff), never raises.
- Every copy carries a sequence number larger than any copy written before it, on disk too
  (`resume_after` after the recovery scan): of two copies of one block, the newer wins.
- A payload that does not shrink under the tier's codec is stored plain (`codec: none`).
- A plain payload whose memory is sector-aligned is written in place; anything else is first
  copied into an aligned staging buffer, as O_DIRECT requires.

Verified reads of the disk tier: a copy is returned only when every check passes.

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

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.blocks import KVLayout
from kvtier.tiers.disk.codec import Codec, CorruptPayload, get_codec
from kvtier.tiers.disk.format import (
    BlockHeader,
    CorruptHeader,
    checksum,
    decode_header,
    encode_header,
)
from kvtier.tiers.disk.io import staging_buffer
from kvtier.tiers.disk.slab_set import DiskHealth, SlabSet, direct_ready


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a disk copy records about its block besides the payload."""

    block_id: bytes
    parent_id: bytes
    namespace: bytes
    tenant: str
    tokens: bytes


class BlockWriter:
    """Group commits of block copies into the slots of one tier; safe from several threads."""

    def __init__(
        self,
        layout: KVLayout,
        codec: Codec,
        header_region: int,
        slabs: SlabSet,
        health: DiskHealth,
    ) -> None:
        self.layout = layout
        self.codec = codec
        self.header_region = header_region
        self._slabs = slabs
        self._health = health
        self._seq_lock = threading.Lock()  # batches are written from mover threads at once
        self._seq = 0

    def resume_after(self, seq: int) -> None:
        """Number the next copies above `seq` (the newest copy found on disk)."""
        with self._seq_lock:
            self._seq = max(self._seq, seq)

    def write_blocks(
        self,
        slots: Sequence[int],
        blocks: torch.Tensor | Sequence[torch.Tensor],
        metas: Sequence[BlockMeta],
    ) -> list[bool]:
        """`DiskTier.write_blocks`: one copy per slot, the batch made durable."""
        assert len(slots) == len(metas) == len(blocks)
        raw = [block.contiguous().view(torch.uint8).reshape(-1) for block in blocks]
        jobs: list[Callable[[], None]] = []
        with self._seq_lock:
            first = self._seq + 1
            self._seq += len(slots)
        for seq, (slot, meta, data) in enumerate(zip(slots, metas, raw, strict=True), first):
            jobs.append(self._write_job(slot, meta, data, seq))
        results: list[object] = list(self._slabs.run(jobs))
        ok = [not isinstance(r, OSError) for r in results]
        refused = ok.count(False)
        self._health.count("write_errors", refused)
        written = [s for s, good in zip(slots, ok, strict=True) if good] if refused else slots
        sync = self._slabs.sync_slabs_of(written)
        if sync.failed:
            per_slab = self._slabs.slots_per_slab
            ok = [
                good and slot // per_slab not in sync.failed
                for slot, good in zip(slots, ok, strict=True)
            ]
            self._health.count("sync_errors", len(sync.failed))
        results += sync.results
        self._health.note_writes(results)
        return ok

    def _write_job(
        self, slot: int, meta: BlockMeta, data: torch.Tensor, seq: int
    ) -> Callable[[], None]:
        """One slot's write, run on an I/O thread: encode, checksum, header, one `pwritev`.
        A plain payload whose memory is sector-aligned (a pool slot or a gathered batch of
        whole blocks of 4 KiB multiples) is written in place; anything else is first copied
        into an aligned buffer, as O_DIRECT requires."""
        slab, offset = self._slabs.where(slot)
        region = self.header_region

        def job() -> None:
            raw = data.numpy().data
            encoded = self.codec.encode(raw, self.layout.itemsize)
            codec_name = self.codec.name
            if len(encoded) >= len(raw):  # incompressible: store it plain
                encoded, codec_name = raw, "none"
            header = BlockHeader(
                block_id=meta.block_id,
                parent_id=meta.parent_id,
                namespace=meta.namespace,
                tenant=meta.tenant,
                layout=self.layout.fingerprint,
                tokens=meta.tokens,
                codec=codec_name,
                raw_nbytes=len(raw),
                payload_nbytes=len(encoded),
                payload_checksum=checksum(encoded),
                seq=seq,
            )
            if encoded is raw and direct_ready(data):
                head = staging_buffer(region)
                head[:] = encode_header(header, region)
                slab.write(offset, [head, raw])
                return
            image = staging_buffer(region + len(encoded))
            image[:region] = encode_header(header, region)
            np.frombuffer(image, dtype=np.uint8)[region : region + len(encoded)] = np.frombuffer(
                encoded, dtype=np.uint8
            )
            slab.write(offset, [image])

        return job


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
