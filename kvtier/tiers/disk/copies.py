"""Block copies on the disk tier: written in group commits, read back verified.

The write path of the disk tier: block copies written in group commits.

    write_blocks(slots, blocks, metas)
      1. jobs on the I/O threads: encode, checksum, header, then one `pwritev` per job of
         [ header region | payload ] at the slot's offset, or, for a run of copies into
         consecutive slots of one slab, of [ header | payload | header | payload | ... ]
      2. one sync per slab that took a copy (`fsync: batch`; none under `fsync: none`)
      3. a copy is reported durable (True) only when its write and its slab's sync returned

Why runs: a copy of a small block is a small I/O (132 KiB for a 128 KiB block), and a virtual
disk or an NVMe queue served that way reaches under half its bandwidth (`bench_mover.py` (b));
plain copies into consecutive slots (a fresh tier hands slots out in order, and a batch is
sorted by slot) go out as writes of up to `RUN_BYTES`, as large as the raw benchmark's chunks.

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
from typing import NamedTuple

import numpy as np
import torch

from kvtier.blocks import KVLayout
from kvtier.errors import InvalidArgumentError
from kvtier.tiers.disk.codec import Codec, CorruptPayload, QuantBytes, codec_for
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


RUN_BYTES = 2 << 20
"""The most bytes one `pwritev` of a run carries: the raw benchmark's chunk size; a batch of
tens of blocks still spreads over several I/O threads."""


UNKEPT = "unquantizable"
"""What a write job returns for a block its quantized codec refused."""


class _Copy(NamedTuple):
    """One copy of a batch: its slot, what it records, its bytes (flat: the block's, or with
    `encoded` the payload of the tier's codec), its number."""

    slot: int
    meta: BlockMeta
    data: torch.Tensor
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
        raw = [block.contiguous().view(torch.uint8).reshape(-1) for block in blocks]
        with self._seq_lock:
            first = self._seq + 1
            self._seq += len(slots)
        copies = [
            _Copy(slot, meta, data, seq, encoded)
            for seq, (slot, meta, data) in enumerate(zip(slots, metas, raw, strict=True), first)
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
        """The copies of a batch as the jobs that write them: runs of plain copies (no codec,
        sector-aligned memory filling the payload region) into consecutive slots of one slab,
        of at most `RUN_BYTES`; every other copy alone."""
        per_slab, slot_bytes = self._slabs.slots_per_slab, self._slabs.slot_bytes
        longest = max(1, RUN_BYTES // slot_bytes)
        runs: list[list[_Copy]] = []
        run: list[_Copy] = []
        for copy in sorted(copies, key=lambda c: c.slot):
            if copy.encoded or not self._in_place(copy.data):
                runs.append([copy])
                continue
            if (
                run
                and copy.slot == run[-1].slot + 1
                and copy.slot % per_slab
                and len(run) < longest
            ):
                run.append(copy)
                continue
            if run:
                runs.append(run)
            run = [copy]
        if run:
            runs.append(run)
        return runs

    def _in_place(self, data: torch.Tensor) -> bool:
        """Whether a copy's payload goes to disk as it is and fills its slot's payload region."""
        return (
            self.codec.name == "none"
            and data.numel() == self._slabs.slot_bytes - self.header_region
            and direct_ready(data)
        )

    def _header(self, copy: _Copy, payload: memoryview, codec: str, raw_nbytes: int) -> bytes:
        """The header region of `copy` whose stored payload is `payload`."""
        header = BlockHeader(
            block_id=copy.meta.block_id,
            parent_id=copy.meta.parent_id,
            namespace=copy.meta.namespace,
            tenant=copy.meta.tenant,
            layout=self.layout.fingerprint,
            tokens=copy.meta.tokens,
            codec=codec,
            raw_nbytes=raw_nbytes,
            payload_nbytes=len(payload),
            payload_checksum=checksum(payload),
            seq=copy.seq,
        )
        return encode_header(header, self.header_region)

    def _run_job(self, run: list[_Copy]) -> Callable[[], None]:
        """A run's write, on an I/O thread: each copy's header, then one `pwritev` of every
        header and payload in slot order, in place."""
        slab, offset = self._slabs.where(run[0].slot)
        region = self.header_region

        def job() -> None:
            heads = staging_buffer(region * len(run))
            buffers: list[memoryview] = []
            for k, copy in enumerate(run):
                payload = copy.data.numpy().data
                head = heads[k * region : (k + 1) * region]
                head[:] = self._header(copy, payload, "none", len(payload))
                buffers += (head, payload)
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
            raw = copy.data.numpy().data
            try:
                encoded = raw if copy.encoded else self.codec.encode(raw, self.layout.itemsize)
            except InvalidArgumentError:  # quantized, and KV it cannot keep (not finite)
                return UNKEPT
            codec_name = self.codec.name
            if not self.codec.lossy and len(encoded) >= len(raw):  # incompressible: plain
                encoded, codec_name = raw, "none"
            header = self._header(copy, memoryview(encoded), codec_name, self.layout.block_bytes)
            if encoded is raw and not copy.encoded and direct_ready(copy.data):
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
        flat = [block.view(torch.uint8).reshape(-1) for block in dest]
        jobs = [
            self._read_job(slot, flat[i], block_ids[i], encoded) for i, slot in enumerate(slots)
        ]
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

    def _read_job(
        self, slot: int, dest: torch.Tensor, block_id: bytes, encoded: bool
    ) -> Callable[[], bool]:
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
            decoded = self._verify(head, payload, block_id, encoded)
            if decoded is None:
                return False
            if decoded is not target:
                np.frombuffer(target, dtype=np.uint8)[:] = np.frombuffer(decoded, dtype=np.uint8)
            return True

        return job

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
        stored = payload[: header.payload_nbytes]
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
