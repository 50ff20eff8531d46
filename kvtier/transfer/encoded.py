"""Copies in and out of a quantized host tier (`tiers/quantized.py`), for the executors.

    gpu  -> host   the blocks gathered on the gpu pool's device, encoded there (torch), the
                   payloads copied into the host slots; a block the codec cannot keep is left
                   out (its copy fails: the demoter drops or keeps it, as for any failed copy)
    host -> gpu    the payloads copied to the gpu pool's device and decoded into its slots:
                   the Triton kernel on CUDA (`kernels/dequant.py`), torch elsewhere; a layer
                   range decodes whole blocks and copies those layers
    host -> disk   a disk tier of the same codec writes the payloads as they are; another
                   decodes them first (and encodes with its own codec, if it has one)
    disk -> host   the same: payloads as they are from a disk tier of the same codec (checked,
                   not decoded), else blocks read, then encoded

Each returns, per block, whether its copy is complete, as `InlineExecutor.run` does.

`unkeepable(src, dst, slot)` says whether a copy into `dst` failed for good: `dst`'s codec (a
quantized host pool, or a disk tier of a quantized codec) cannot keep the block (a NaN, or a
value past fp16's range), so no copy of it into `dst` will ever succeed; a demotion then drops
it rather than leave it stuck above (`demotion.drop_unkeepable`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.tiers.base import Tier
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.disk.codec import QuantBytes
from kvtier.tiers.pool import SlotPool
from kvtier.tiers.quantized import QuantPool


def same_codec(pool: QuantPool, disk: DiskTier) -> bool:
    """Whether `disk` keeps the payloads `pool` holds, as they are."""
    return disk.codec.name == pool.codec.id


def unkeepable(src: SlotPool, dst: Tier, slot: int) -> bool:
    """Whether `dst`'s quantized codec cannot keep the block in `src`'s `slot` (module doc);
    False for a `dst` without one (raw, lossless), which keeps any block."""
    if isinstance(dst, QuantPool):
        codec = dst.codec
    elif isinstance(dst, DiskTier) and isinstance(dst.codec, QuantBytes):
        codec = dst.codec.quant
    else:
        return False
    return not bool(codec.keepable(src.read([slot])).all())


def encode_into(
    dst: QuantPool, dst_slots: Sequence[int], blocks: torch.Tensor, ok: Sequence[bool]
) -> list[bool]:
    """Encode the blocks whose `ok` is True and the codec keeps into `dst_slots`; per block,
    whether it landed."""
    landed = [good and kept for good, kept in zip(ok, dst.keepable(blocks), strict=True)]
    rows = [i for i, good in enumerate(landed) if good]
    if rows:
        picked = blocks[rows] if len(rows) < len(landed) else blocks
        dst.put_payloads([dst_slots[i] for i in rows], dst.codec.encode(picked))
    return landed


def pool_to_pool(
    src: SlotPool,
    dst: SlotPool,
    src_slots: Sequence[int],
    dst_slots: Sequence[int],
    layers: tuple[int, int] | None,
) -> list[bool]:
    """A memory copy with a quantized pool on one side (module doc)."""
    if isinstance(dst, QuantPool):
        assert layers is None, "demotions carry whole blocks"
        blocks = src.read(list(src_slots))
        return encode_into(dst, dst_slots, blocks, [True] * len(src_slots))
    assert isinstance(src, QuantPool)
    payloads = src.payloads(list(src_slots)).to(dst.device)
    index = torch.tensor(list(dst_slots), dtype=torch.int64, device=dst.device)
    if layers is None:
        from kvtier.kernels.dequant import dequantize  # imports Triton: only once it decodes

        dequantize(src.codec, payloads, dst.buffer, index)
    else:
        first, stop = layers
        whole = src.codec.decode(payloads)  # torch; a layer group is a prefetch's slice
        dst.buffer[index, first:stop] = whole[:, first:stop].to(dst.device)
    return [True] * len(src_slots)


def host_to_disk(
    src: QuantPool,
    disk: DiskTier,
    src_slots: Sequence[int],
    dst_slots: Sequence[int],
    metas: Sequence[BlockMeta],
) -> list[bool]:
    if same_codec(src, disk):
        return disk.write_blocks(dst_slots, src.payloads(list(src_slots)), metas, encoded=True)
    return disk.write_blocks(dst_slots, src.read(list(src_slots)), metas)


def disk_to_host(
    disk: DiskTier,
    dst: QuantPool,
    src_slots: Sequence[int],
    dst_slots: Sequence[int],
    ids: Sequence[bytes],
) -> list[bool]:
    if same_codec(dst, disk):
        payloads, ok = disk.read_blocks(src_slots, ids, encoded=True)
        assert isinstance(payloads, torch.Tensor)
        rows = [i for i, good in enumerate(ok) if good]
        if rows:
            dst.put_payloads([dst_slots[i] for i in rows], payloads[rows])
        return ok
    blocks, ok = disk.read_blocks(src_slots, ids)
    assert isinstance(blocks, torch.Tensor)
    return encode_into(dst, dst_slots, blocks, ok)
