"""Verified reads of the disk tier: a copy is returned only when every check passes.

    read_blocks(slots, block_ids, out)
      1. each destination's bytes (`views.byte_views`, as for writes)
      2. jobs on the I/O threads: one `preadv` per job of [ header region | payload ] at the
         slot's offset or, for a run of copies from consecutive slots of one slab into
         destinations that take a payload in place, of [ header | payload | header | ... ]
         (`SlabSet.runs`, at most `RUN_BYTES`), then for each copy

      header checksum -> expected block id -> layout -> raw size -> payload checksum -> codec

Why runs: copies demoted together sit in consecutive slots, and a prefix comes back up in
batches of them (in the conversation replay, 18,292 copies read in 1,284 runs); one `preadv`
and one job per run rather than per copy saves a system call and a hand-off to an I/O thread
for each, which for small blocks cost more than checking them.

Contract:
- A copy that fails a check is reported so (False) and counted in `corrupt_reads`; one whose
  read fails, in `read_errors` (a failed read of a run fails each of its copies, as one system
  call does), a read that the slab's end cuts short (a file truncated under the tier) too.
  Neither raises, and neither is returned as valid: its destination holds garbage.
- Plain payloads land in place when the destination is page-aligned and exactly one payload
  long; others go through an aligned staging buffer and are copied (decoded) into place.
- Reads change nothing on disk and no state of the tier but its fault counters.
- Reads are urgent on the I/O threads (`IOPool`): a request waits on them, so their lanes go
  ahead of the writes, syncs and retires waiting for a worker.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.blocks import KVLayout
from kvtier.tiers.disk.codec import Codec, CorruptPayload, QuantBytes, codec_for
from kvtier.tiers.disk.format import CorruptHeader, checksum, decode_header
from kvtier.tiers.disk.io import SlabFile, staging_buffer
from kvtier.tiers.disk.slab_set import DiskHealth, SlabSet
from kvtier.tiers.disk.views import byte_views


def _read_whole(slab: SlabFile, offset: int, buffers: list[memoryview]) -> None:
    """Fill `buffers` from `offset`; an `OSError` (EIO) when the slab ends first (a file cut
    under the tier): the staging buffers still hold what an earlier read on this thread put
    there, and a header read back whole from them vouched for a copy the disk no longer holds."""
    want = sum(len(buffer) for buffer in buffers)
    got = slab.readv(offset, buffers)
    if got < want:
        raise OSError(
            errno.EIO, f"short read: {got} of {want} bytes at offset {offset}", str(slab.path)
        )


class VerifiedReader:
    """Reads copies of one layout from the slots of one tier and checks each."""

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
        self.payload_region = slabs.slot_bytes - header_region
        self._slabs = slabs
        self._health = health

    def read_blocks(
        self,
        slots: Sequence[int],
        block_ids: Sequence[bytes],
        out: Sequence[torch.Tensor] | None = None,
        encoded: bool = False,
    ) -> tuple[torch.Tensor | Sequence[torch.Tensor], list[bool]]:
        """Read and verify copies into `out` (n block tensors, e.g. pool slots; a new
        `[n, *block_shape]` tensor when None) and say, per block, whether it is valid. Plain
        payloads land in place when the destination is page-aligned; others go through an
        aligned staging buffer. With `encoded`, each destination takes the payload of the
        tier's quantized codec as it is (checked, not decoded). A destination whose copy failed
        holds garbage."""
        if out is not None:
            dest: torch.Tensor | Sequence[torch.Tensor] = out
        elif encoded:
            width = self.codec.payload_bound(self.layout.block_bytes)
            dest = torch.empty((len(slots), width), dtype=torch.uint8)
        else:
            dest = torch.empty((len(slots), *self.layout.block_shape), dtype=self.layout.dtype)
        targets, aligned = byte_views(dest)
        in_place = [
            a and len(t) == self.payload_region for t, a in zip(targets, aligned, strict=True)
        ]
        runs = self._slabs.runs(slots, in_place)
        jobs = [
            self._read_job(
                slots[run[0]],
                [targets[k] for k in run],
                [block_ids[k] for k in run],
                in_place[run[0]],
                encoded,
            )
            for run in runs
        ]
        ok = [False] * len(slots)
        for run, result in zip(runs, self._slabs.run(jobs, urgent=True), strict=True):
            if isinstance(result, OSError):
                self._health.count("read_errors", len(run))
                continue
            self._health.count("corrupt_reads", result.count(False))
            for k, good in zip(run, result, strict=True):
                ok[k] = good
        return dest, ok

    def _read_job(
        self,
        first: int,
        targets: list[memoryview],
        block_ids: list[bytes],
        in_place: bool,
        encoded: bool,
    ) -> Callable[[], list[bool]]:
        """The read of the copies in slots `first`, `first + 1`, ... into `targets`, on an I/O
        thread: one `preadv`, each payload into its target when `in_place` (else one copy,
        through a staging buffer), then each copy checked."""
        slab, offset = self._slabs.where(first)
        region, payload_region = self.header_region, self.payload_region

        def job() -> list[bool]:
            if in_place:
                heads = staging_buffer(region * len(targets))
                parts = [(heads[k * region : (k + 1) * region], t) for k, t in enumerate(targets)]
                buffers = [buffer for part in parts for buffer in part]
            else:
                assert len(targets) == 1, "only in-place copies are read in runs"
                image = staging_buffer(region + payload_region)
                parts = [(image[:region], image[region:])]
                buffers = [image]
            _read_whole(slab, offset, buffers)
            return [
                self._land(head, payload, target, block_id, encoded)
                for (head, payload), target, block_id in zip(parts, targets, block_ids, strict=True)
            ]

        return job

    def _land(
        self,
        head: memoryview,
        payload: memoryview,
        target: memoryview,
        block_id: bytes,
        encoded: bool,
    ) -> bool:
        """Check a copy read as `head` and `payload`; when valid, its decoded payload goes to
        `target` (unless it was read there) and it is True."""
        decoded = self._verify(head, payload, block_id, encoded)
        if decoded is None:
            return False
        if decoded is not target:
            np.frombuffer(target, dtype=np.uint8)[:] = np.frombuffer(decoded, dtype=np.uint8)
        return True

    def _verify(
        self, head: memoryview, payload: memoryview, block_id: bytes, encoded: bool = False
    ) -> bytes | memoryview | None:
        """The decoded payload of a slot if every check passes, else None; with `encoded`, the
        payload itself, which must be of the tier's quantized codec and pass its checks."""
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
        # a payload read in place that fills it is its target itself: nothing to copy
        stored = (
            payload if header.payload_nbytes == len(payload) else payload[: header.payload_nbytes]
        )
        if checksum(stored) != header.payload_checksum:
            return None
        if encoded:
            if not isinstance(self.codec, QuantBytes) or header.codec != self.codec.name:
                return None
            return stored if self.codec.valid(stored) else None
        if header.codec == "none":
            return stored if len(stored) == self.layout.block_bytes else None
        try:
            codec = codec_for(header.codec, self.layout)
            decoded = codec.decode(stored, header.raw_nbytes, self.layout.itemsize)
        except (CorruptPayload, ValueError):
            return None
        return bytes(decoded) if len(decoded) == self.layout.block_bytes else None
