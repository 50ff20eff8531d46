"""Payload codecs of the disk and remote tiers: how a block's bytes are stored in a copy.

A codec turns the raw bytes of one block into the stored payload and back. Its name is recorded
in every copy (`format.BlockHeader.codec`, a remote value's header), so one tier can hold copies
written with different codecs; readers look the codec up by that name (`codec_for`).

    "none":  stored = raw                                    (the same object: no copy)
    "lz4":   stored = lz4_block(shuffle(raw, itemsize))      (no size prefix; the header has it)
    "fp8", "i8k60v60", "i4kcv40", ...                        quantized (`kvtier.quant`): lossy

Byte-plane shuffle, for itemsize >= 2: element i's byte k moves to plane k. The high bytes of
16-bit floats (sign and exponent) vary slowly across a KV block and compress; the low bytes
(mantissa) barely do, and mixed together neither does.

    raw     = [a0 a1 | b0 b1 | c0 c1]                 3 elements, itemsize 2
    shuffle = [a0 b0 c0 | a1 b1 c1]                   planes: [n, itemsize] -> [itemsize, n]

Contract:
- Lossless codecs (`lossy` False): `decode(encode(raw, s), nbytes(raw), s)` is bit-identical
  to `raw` (DESIGN.md invariant 7). A quantized codec (`QuantBytes`) decodes to what its
  payload says, the same bits wherever it is decoded; what it loses is measured
  (`benchmarks/bench_quant.py`), and its payload is at most `payload_bound` bytes, so its
  tier's slots shrink to that. A tier never writes one whose payload is larger than the plain
  block (`tier_codec` refuses it at start). Its `encode` refuses KV it cannot keep
  (`InvalidArgumentError`: a value not finite or beyond fp16's range), and the tier then keeps
  no copy of that block.
- `decode` raises `CorruptPayload` for any stored bytes that do not decode to exactly
  `raw_nbytes` bytes, and for a `raw_nbytes` that is not a multiple of `itemsize`; nothing else.
  Callers check `raw_nbytes` against the layout before decoding, so a corrupt size cannot ask
  for an absurd allocation.
- `encode` may return more bytes than it was given (incompressible data); the tier then stores
  the copy with "none" instead, so a payload is never larger than its block.
- "lz4" returns `bytes` or a flat byte-format (`"B"`) `memoryview`, so `len()` is the byte
  count; "none" returns the very object it was given.
"""

from __future__ import annotations

import functools
from typing import Protocol

import lz4.block  # type: ignore[import-untyped]
import numpy as np
import numpy.typing as npt
import torch

from kvtier.blocks import KVLayout
from kvtier.errors import ConfigError, InvalidArgumentError, KVTierError
from kvtier.quant import CorruptQuantPayload, QuantCodec, QuantSpec


class CorruptPayload(KVTierError):
    """Stored payload bytes that do not decode to the block they claim to be."""


class Codec(Protocol):
    """A payload codec. `encode` checks its arguments (`InvalidArgumentError`); `decode` treats
    its input as untrusted disk bytes (`CorruptPayload`)."""

    name: str
    lossy: bool

    def payload_bound(self, raw_nbytes: int) -> int:
        """The most bytes a payload of a `raw_nbytes` block takes (stored plain, if need be)."""
        ...

    def encode(self, raw: bytes | memoryview, itemsize: int) -> bytes | memoryview:
        """The payload to store for `raw`, whose length is a multiple of `itemsize`."""
        ...

    def decode(
        self, stored: bytes | memoryview, raw_nbytes: int, itemsize: int
    ) -> bytes | memoryview:
        """The `raw_nbytes` raw bytes that `stored` encodes; `CorruptPayload` if it does not."""
        ...


class NoneCodec:
    """Stores the raw bytes as they are; both directions return their input object."""

    name = "none"
    lossy = False

    def payload_bound(self, raw_nbytes: int) -> int:
        return raw_nbytes

    def encode(self, raw: bytes | memoryview, itemsize: int) -> bytes | memoryview:
        return raw

    def decode(
        self, stored: bytes | memoryview, raw_nbytes: int, itemsize: int
    ) -> bytes | memoryview:
        nbytes = memoryview(stored).nbytes
        if nbytes != raw_nbytes:
            raise CorruptPayload(f"'none' payload of {nbytes} bytes, expected {raw_nbytes}")
        return stored


class Lz4Codec:
    """Byte-plane shuffle (for itemsize >= 2), then an LZ4 block without a size prefix."""

    name = "lz4"
    lossy = False

    def payload_bound(self, raw_nbytes: int) -> int:
        return raw_nbytes  # one that does not shrink is stored plain

    def encode(self, raw: bytes | memoryview, itemsize: int) -> bytes | memoryview:
        planes = shuffle(raw, itemsize)
        compressed: bytes = lz4.block.compress(planes, store_size=False)
        return compressed

    def decode(
        self, stored: bytes | memoryview, raw_nbytes: int, itemsize: int
    ) -> bytes | memoryview:
        if itemsize < 1:
            raise InvalidArgumentError(f"itemsize: got {itemsize}, expected >= 1")
        if raw_nbytes < 1 or raw_nbytes % itemsize:
            raise CorruptPayload(
                f"raw size {raw_nbytes} is not a positive multiple of itemsize {itemsize}"
            )
        try:
            planes: bytes = lz4.block.decompress(stored, uncompressed_size=raw_nbytes)
        except (lz4.block.LZ4BlockError, ValueError, OverflowError) as e:  # 2**31: Overflow
            raise CorruptPayload(f"lz4 payload does not decode: {e}") from e
        if len(planes) != raw_nbytes:
            raise CorruptPayload(f"lz4 payload decodes to {len(planes)} bytes, not {raw_nbytes}")
        return unshuffle(planes, itemsize)


class QuantBytes:
    """A quantized codec (`kvtier.quant.QuantCodec`) over one block's raw bytes: the tiers'
    face of it. Its `name` is the codec's id (`i4k20v40`), which with the layout says all that
    decoding needs."""

    lossy = True

    def __init__(self, quant: QuantCodec) -> None:
        self.quant = quant
        self.name = quant.id

    def payload_bound(self, raw_nbytes: int) -> int:
        return self.quant.payload_nbytes

    def encode(self, raw: bytes | memoryview, itemsize: int) -> bytes | memoryview:
        layout = self.quant.layout
        block = _tensor(raw).view(layout.dtype).reshape(1, *layout.block_shape)
        payload: memoryview = self.quant.encode(block).reshape(-1).numpy().data
        return payload

    def valid(self, stored: bytes | memoryview) -> bool:
        """Whether `stored` is a payload this codec decodes (size, scales, codes), without
        decoding it: what a tier that keeps payloads as they are checks."""
        if memoryview(stored).nbytes != self.quant.payload_nbytes:
            return False
        try:
            self.quant.validate(_tensor(stored).reshape(1, -1))
        except CorruptQuantPayload:
            return False
        return True

    def decode(
        self, stored: bytes | memoryview, raw_nbytes: int, itemsize: int
    ) -> bytes | memoryview:
        if raw_nbytes != self.quant.layout.block_bytes:
            raise CorruptPayload(
                f"{self.name} copy of {raw_nbytes} raw bytes, expected "
                f"{self.quant.layout.block_bytes}"
            )
        payload = _tensor(stored).reshape(1, -1)
        try:
            block = self.quant.decode(payload)
        except CorruptQuantPayload as e:
            raise CorruptPayload(str(e)) from e
        decoded: memoryview = block.view(torch.uint8).reshape(-1).numpy().data
        return decoded


CODECS: dict[str, Codec] = {codec.name: codec for codec in (NoneCodec(), Lz4Codec())}
"""The lossless codecs by name (quantized ones depend on the layout: `codec_for`)."""

CODEC_NAMES = ("none", "lz4", "fp8", "int8", "int4")
"""What `tiers.<tier>.codec` accepts."""


def get_codec(name: str) -> Codec:
    """The lossless codec called `name`; `InvalidArgumentError` (a `ValueError`) naming the
    known ones."""
    codec = CODECS.get(name)
    if codec is None:
        raise InvalidArgumentError(f"unknown codec {name!r}, expected one of {sorted(CODECS)}")
    return codec


def tier_codec(
    name: str,
    layout: KVLayout,
    group: int | None = None,
    keys: str = "token",
    field: str = "",
) -> Codec:
    """The codec a tier configured with `codec: name` writes (`CODEC_NAMES`); `ConfigError`
    for a group that does not divide the layout's rows, or a quantized codec whose payload is
    larger than the plain block (a float8 model's, or tiny groups: 3 bytes of scale and zero
    point each), which would keep fewer blocks, and lossy ones, than no codec; its field under
    `field` (the tier's config section, `tiers.disk`) when given."""
    if name in CODECS:
        return CODECS[name]
    try:
        quant = QuantCodec(QuantSpec(name, group, keys), layout)
        if quant.payload_nbytes > layout.block_bytes:
            grouped = f" with codec_group {group}" if group is not None else ""
            codes = layout.block_bytes // layout.dtype.itemsize * (4 if name == "int4" else 8) // 8
            hint = "codec none"  # a larger group helps only where the codes alone fit
            if name != "fp8" and codes < layout.block_bytes:
                hint += ", or a larger codec_group" + (", codec_keys token" * (keys == "channel"))
            raise ConfigError(
                "codec",
                name,
                f"a codec whose payload is no larger than the plain block: {name}{grouped} "
                f"makes {quant.payload_nbytes} bytes of a {layout.block_bytes}-byte "
                f"{layout.dtype_name} block ({hint})",
            )
        return _quantized(quant.id, layout)
    except ConfigError as e:
        if not field:
            raise
        raise ConfigError(f"{field}.{e.field}", e.value, e.expected) from None


def codec_for(name: str, layout: KVLayout | None) -> Codec:
    """The codec a copy that records `name` was written with, for blocks of `layout` (None: a
    tier that holds no quantized copy); `CorruptPayload` for a name no codec has (the name is
    untrusted bytes from a disk or a cluster)."""
    codec = CODECS.get(name)
    if codec is not None:
        return codec
    if QuantSpec.from_id(name) is None or layout is None:
        raise CorruptPayload(f"unknown codec {name!r}")
    try:
        return _quantized(name, layout)
    except ValueError as e:  # a group that does not divide this layout's rows
        raise CorruptPayload(f"codec {name!r} does not fit the layout: {e}") from e


def known_codec(name: str) -> bool:
    """Whether this build has a codec of `name` (a plain one, or a quantized codec's id)."""
    return name in CODECS or QuantSpec.from_id(name) is not None


@functools.lru_cache(maxsize=64)
def _quantized(codec_id: str, layout: KVLayout) -> QuantBytes:
    spec = QuantSpec.from_id(codec_id)
    assert spec is not None
    return QuantBytes(QuantCodec(spec, layout))


def _tensor(data: bytes | memoryview) -> torch.Tensor:
    """`data` as a flat uint8 tensor: a view where the buffer is writable, else a copy (torch
    does not take read-only memory)."""
    view = memoryview(data)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8)


def shuffle(raw: bytes | memoryview, itemsize: int) -> bytes | memoryview:
    """Byte planes of `raw`: `[n, itemsize] -> [itemsize, n]`, contiguous. itemsize 1: `raw`.

    One pass per plane: measured ~4 GB/s for 2 MiB of bf16 here, where a plain transposing copy
    of the [n, itemsize] view runs at the same speed but its inverse at under 1 GB/s.
    """
    items = _as_items(raw, itemsize)
    if itemsize == 1:
        return raw
    planes = np.empty((itemsize, items.shape[0]), dtype=np.uint8)
    for k in range(itemsize):
        planes[k] = items[:, k]
    return planes.reshape(-1).data


def unshuffle(planes: bytes | memoryview, itemsize: int) -> bytes | memoryview:
    """The inverse of `shuffle`: `[itemsize, n] -> [n, itemsize]`, contiguous."""
    by_plane = _as_items(planes, itemsize).reshape(itemsize, -1)
    if itemsize == 1:
        return planes
    items = np.empty((by_plane.shape[1], itemsize), dtype=np.uint8)
    for k in range(itemsize):
        items[:, k] = by_plane[k]
    return items.reshape(-1).data


def _as_items(data: bytes | memoryview, itemsize: int) -> npt.NDArray[np.uint8]:
    """`data` as a read-only `[n, itemsize]` uint8 array, without a copy."""
    if itemsize < 1:
        raise InvalidArgumentError(f"itemsize: got {itemsize}, expected >= 1")
    flat = np.frombuffer(data, dtype=np.uint8)
    if flat.size % itemsize:
        raise InvalidArgumentError(
            f"{flat.size} bytes are not a whole number of {itemsize}-byte elements"
        )
    return flat.reshape(-1, itemsize)
