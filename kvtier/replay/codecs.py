"""`kvtier replay --codec none,int8,int4`: the host and disk tiers at a fixed byte budget, each
run keeping its copies in one codec, so that the planner sees the hit rate of fitting more
blocks in the same bytes.

The replay's store is scaled down (`runner.py`: blocks of a few KiB), and a scaled block's
quantized payload rounds up to the same 4 KiB disk slot as its raw one, so the bytes a codec
saves are those of a block of the real model: `layout` (the default config's, SmolLM2-135M's
bf16 blocks of 16 tokens, unless given). A tier of fraction f of the trace's unique blocks in
raw bytes holds, under a codec,

    host: f * raw_bytes / payload_bytes            blocks (`Codec.payload_bound`)
    disk: f * raw_slot / slot(payload_bytes)       blocks (slots: a header region, the payload
                                                   rounded up to 4 KiB, `tiers/disk/format.py`)

and the run replays that many blocks. Hit rates depend on where blocks are, not on their bytes
(the scaled KV is zeros), so this is the hit rate the real model's tiers would have;
`tests/test_disk_quant.py` checks that a real disk tier holds those extra blocks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvtier.blocks import BlockHasher, KVLayout
from kvtier.config import KVTierConfig
from kvtier.errors import InvalidArgumentError, shown
from kvtier.quant import KINDS
from kvtier.replay.report import MOST, Sizing
from kvtier.tiers.disk.codec import tier_codec
from kvtier.tiers.disk.format import header_region_size, slot_size

CODECS = ("none", *KINDS)
"""What `--codec` takes: the codecs whose payload size does not depend on the data (lz4's
does, so a byte budget says nothing of how many blocks it holds)."""


@dataclass(frozen=True)
class CodecFit:
    """How many more blocks a codec fits in a byte budget: host (payload) and disk (slots)."""

    codec: str
    host: float
    disk: float


def parse_codecs(text: str) -> list[str]:
    """`--codec`'s comma-separated names, in order; `InvalidArgumentError` naming a bad one."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in CODECS:
            raise InvalidArgumentError(
                f"--codec: got {shown(name)}, expected some of {list(CODECS)}"
            )
    if not names or len(set(names)) != len(names):
        raise InvalidArgumentError(
            f"--codec: got {shown(text)}, expected distinct names of {CODECS}"
        )
    return names


def fit(codec: str, layout: KVLayout | None = None) -> CodecFit:
    """The block ratios of `codec` on `layout` (default: the default config's)."""
    layout = layout or KVTierConfig().layout
    raw = layout.block_bytes
    payload = tier_codec(codec, layout).payload_bound(raw)
    digest = BlockHasher(KVTierConfig().hashing.algorithm).digest_size
    region = header_region_size(layout.block_tokens, digest)
    return CodecFit(codec, raw / payload, slot_size(region, raw) / slot_size(region, payload))


def codec_sizing(base: Sizing, codec: CodecFit) -> Sizing:
    """`base` with host and disk holding the blocks their bytes hold under `codec` (gpu keeps
    the engine's dtype); labelled with the codec's name. A typed size whose blocks under the
    codec pass a tier's bound (100 times the trace's unique blocks) is refused naming the value
    typed, not the scaled one the user never wrote."""
    for name, ratio in (("host", codec.host), ("disk", codec.disk)):
        typed = getattr(base, name)
        if typed * ratio > MOST:
            raise InvalidArgumentError(
                f"--{name}: got {shown(typed)}, which under --codec {codec.codec} holds "
                f"{ratio:.2f}x the blocks ({typed * ratio:.1f} times the trace's unique "
                f"blocks), expected at most {math.floor(MOST / ratio * 100) / 100:g} "
                f"({MOST:g} / {ratio:.4g})"
            )
    return dataclasses.replace(
        base, label=codec.codec, host=base.host * codec.host, disk=base.disk * codec.disk
    )
