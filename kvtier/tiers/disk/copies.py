"""The write path of the disk tier: block copies written in group commits (reads: `reads.py`).

    write_blocks(slots, blocks, metas)
      0. each block's bytes (`views.byte_views`: one NumPy view for blocks in one storage) and
         a sequence number
      1. jobs on the I/O threads: encode, checksum, header, then one `pwritev` per job of
         [ header region | payload ] at the slot's offset, or, for a run of copies into
         consecutive slots of one slab, of [ header | payload | header | payload | ... ]
      2. one sync per slab that took a copy (`fsync: batch`; none under `fsync: none`),
         shared with the batches other threads write into that slab at the same time
         (`SlabFile.sync`: group commit across callers)
      3. a copy is reported durable (True) only when its write and its slab's sync returned

Why runs: a copy of a small block is a small I/O (132 KiB for a 128 KiB block), and a virtual
disk or an NVMe queue served that way reaches under half its bandwidth (`bench_mover.py` (b));
plain copies into consecutive slots (a fresh tier hands slots out in order, and a batch is
sorted by slot) go out as writes of up to `RUN_BYTES`, as large as the raw benchmark's chunks
(`SlabSet.runs`).

Contract:
- A failed write or sync fails that copy (counted in `write_errors` / `sync_errors`, and fed to
  the backoff), never raises.
- Every copy carries a sequence number larger than any copy written before it, on disk too
  (`resume_after` after the recovery scan): of two copies of one block, the newer wins.
- A payload that does not shrink under the tier's lossless codec is stored plain (`codec:
  none`). A block a quantized codec cannot keep (`QuantCodec.encode` refuses it) gets no copy:
  that copy fails, counted in `unquantizable`, with no backoff (the disk is fine).
- A plain payload whose memory is sector-aligned is written in place; anything else is first
  copied into an aligned staging buffer, as O_DIRECT requires. Plain, in-place payloads that
  fill their payload region are written in runs (above); a run's copies fail or succeed
  together, as one system call does.
- A header is the bytes `format.encode_header` gives for the copy's `BlockHeader`, built by
  the tier's `HeaderWriter` without one; a `BlockMeta` that breaks a rule of `BlockHeader`
  raises its `InvalidArgumentError` (a caller's bug) once every job of the batch has finished.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvtier.blocks import KVLayout
from kvtier.errors import InvalidArgumentError
from kvtier.tiers.disk.codec import Codec
from kvtier.tiers.disk.format import HeaderWriter
from kvtier.tiers.disk.io import staging_buffer
from kvtier.tiers.disk.slab_set import DiskHealth, SlabSet
from kvtier.tiers.disk.views import byte_views


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a disk copy records about its block besides the payload."""

    block_id: bytes
    parent_id: bytes
    namespace: bytes
    tenant: str
    tokens: bytes


UNKEPT = "unquantizable"
"""What a write job returns for a block its quantized codec refused."""


class _Copy(NamedTuple):
    """One copy of a batch: its slot, what it records, its bytes (flat: the block's, or with
    `encoded` the payload of the tier's codec) and whether O_DIRECT takes them as they are, its
    number."""

    slot: int
    meta: BlockMeta
    data: memoryview
    aligned: bool
    seq: int
    encoded: bool = False


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
        self._headers = HeaderWriter(header_region, layout.fingerprint, layout.block_bytes)
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
        encoded: bool = False,
    ) -> list[bool]:
        """`DiskTier.write_blocks`: one copy per slot, the batch made durable."""
        assert len(slots) == len(metas) == len(blocks)
        assert not encoded or self.codec.lossy, "payloads are of a quantized codec"
        raw = byte_views(blocks)
        with self._seq_lock:
            first = self._seq + 1
            self._seq += len(slots)
        copies = [
            _Copy(slot, meta, data, aligned, seq, encoded)
            for seq, (slot, meta, data, aligned) in enumerate(
                zip(slots, metas, raw.views, raw.aligned, strict=True), first
            )
        ]
        runs = self._runs(copies)
        jobs = [self._run_job(run) if len(run) > 1 else self._write_job(run[0]) for run in runs]
        outcome: dict[int, object] = {}  # slot -> its job's result
        for run, result in zip(runs, self._slabs.run(jobs), strict=True):
            outcome.update((copy.slot, result) for copy in run)
        results: list[object] = [outcome[slot] for slot in slots]
        ok = [not isinstance(r, OSError) and r is not UNKEPT for r in results]
        refused = ok.count(False)
        unkept = results.count(UNKEPT)
        self._health.count("write_errors", refused - unkept)
        self._health.count("unquantizable", unkept)
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

    def _runs(self, copies: list[_Copy]) -> list[list[_Copy]]:
        """The copies of a batch as the jobs that write them (`SlabSet.runs`): runs of plain
        copies (no codec, sector-aligned memory filling the payload region) into consecutive
        slots of one slab; every other copy alone."""
        payload_region = self._slabs.slot_bytes - self.header_region
        plain = self.codec.name == "none"
        joinable = [
            plain and not c.encoded and c.aligned and len(c.data) == payload_region for c in copies
        ]
        runs = self._slabs.runs([c.slot for c in copies], joinable)
        return [[copies[k] for k in run] for run in runs]

    def _run_job(self, run: list[_Copy]) -> Callable[[], None]:
        """A run's write, on an I/O thread: each copy's header, then one `pwritev` of every
        header and payload in slot order, in place."""
        slab, offset = self._slabs.where(run[0].slot)
        region, encode = self.header_region, self._headers.encode

        def job() -> None:
            heads = staging_buffer(region * len(run))
            buffers: list[memoryview] = []
            for k, copy in enumerate(run):
                head = heads[k * region : (k + 1) * region]
                head[:] = encode(copy.meta, "none", copy.data, copy.seq)
                buffers += (head, copy.data)
            slab.write(offset, buffers)

        return job

    def _write_job(self, copy: _Copy) -> Callable[[], str | None]:
        """One slot's write, run on an I/O thread: encode, checksum, header, one `pwritev`.
        A plain payload whose memory is sector-aligned (a pool slot or a gathered batch of
        whole blocks of 4 KiB multiples) is written in place; anything else is first copied
        into an aligned buffer, as O_DIRECT requires."""
        slab, offset = self._slabs.where(copy.slot)
        region = self.header_region

        def job() -> str | None:
            raw = copy.data
            try:
                encoded = raw if copy.encoded else self.codec.encode(raw, self.layout.itemsize)
            except InvalidArgumentError:  # quantized, and KV it cannot keep (not finite)
                return UNKEPT
            codec_name = self.codec.name
            if not self.codec.lossy and len(encoded) >= len(raw):  # incompressible: plain
                encoded, codec_name = raw, "none"
            header = self._headers.encode(copy.meta, codec_name, memoryview(encoded), copy.seq)
            if encoded is raw and not copy.encoded and copy.aligned:
                head = staging_buffer(region)
                head[:] = header
                slab.write(offset, [head, raw])
                return None
            image = staging_buffer(region + len(encoded))
            image[:region] = header
            np.frombuffer(image, dtype=np.uint8)[region : region + len(encoded)] = np.frombuffer(
                encoded, dtype=np.uint8
            )
            slab.write(offset, [image])
            return None

        return job
