"""The on-disk form of one block copy: a self-describing slot in a slab file.

A disk tier is slab files of equal slots. Every slot holds one copy of one block (or nothing),
and says by itself what it holds, so that recovery needs nothing but the slots:

    slab file = [ slot 0 | slot 1 | ... ]                 slot i starts at i * slot_size

    0                                    header_region                      slot_size
    +------------------------------------+----------------------------------+
    | header region (k * SECTOR bytes)   | payload region                   |
    |  encode_header / decode_header     |  align_up(block_bytes) bytes     |
    +------------------------------------+----------------------------------+
                                          ^ sector-aligned, so O_DIRECT can read the payload alone

    header region (little-endian):

    0      4           6               10             10+L          10+L+16        region_size
    +------+-----------+---------------+--------------+-------------+--------------+
    | KVTB | version   | body_len = L  | body         | xxh3_128 of | zero padding |
    |      | u16 (=1)  | u32           | msgpack      | [0, 10+L)   |              |
    +------+-----------+---------------+--------------+-------------+--------------+

    body = msgpack array, in the order the fields of `BlockHeader` are declared:
           [block_id, parent_id, namespace, tenant, layout, tokens, codec,
            raw_nbytes, payload_nbytes, payload_checksum, seq]

Contract:
- `encode_header` returns exactly `region_size` bytes, or raises `ValueError` (an
  `InvalidArgumentError`) when the header does not fit or the region is not whole sectors.
- `decode_header` returns None for a never-written or retired slot (its first 16 bytes are
  zero), a `BlockHeader` when magic, version, length, header checksum and every field agree, and
  raises `CorruptHeader` otherwise. It raises nothing else, whatever the bytes.
- `header_region_size(block_tokens, digest_size)` is whole sectors and holds the largest valid
  header of that geometry, so `encode_header` never fails for a header whose `tokens` are
  `block_tokens` ids.
- `HeaderWriter(region_size, layout, raw_nbytes).encode(block, codec, payload, seq)` returns
  exactly the bytes of `encode_header(BlockHeader(...), region_size)` for the same fields, and
  raises the same `InvalidArgumentError` for a bad one, without building a `BlockHeader`: the
  write path of a tier, whose layout and block size are fixed, pays for no dataclass and no
  per-field loop. The layout and block size are validated once, when the writer is made.

Invariants (DESIGN.md invariant 7):
- The header checksum covers the body, and the body holds `payload_checksum`, so one chain
  covers header and payload: a copy is served only if both checksums match. A torn write of
  either part is detected whatever order the tier writes them in.
- `BlockHeader` validates its fields on construction, so a decoded header is always
  well-formed; whether it belongs to this tier (layout, token count, `raw_nbytes ==
  block_bytes`) is for the tier to check.
- Changing the byte layout or the field order needs a new `FORMAT_VERSION`.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, fields
from typing import Protocol

import msgpack  # type: ignore[import-untyped]
import xxhash

from kvtier.blocks import ALGORITHMS
from kvtier.errors import InvalidArgumentError, KVTierError

SECTOR = 4096
MAGIC = b"KVTB"
FORMAT_VERSION = 1

CHECKSUM_BYTES = 16
LAYOUT_FINGERPRINT_BYTES = 16
TOKEN_BYTES = 4  # uint32 little-endian, as in `blocks.py`
MAX_TENANT_CHARS = 64
MAX_CODEC_CHARS = 8
DIGEST_SIZES = frozenset(size for size, _ in ALGORITHMS.values())

_PREFIX = struct.Struct("<4sHI")  # magic, version, body_len
_EMPTY_PROBE = 16  # a slot whose first 16 bytes are zero was never written (or was retired)
_U64_MAX = 2**64 - 1


class CorruptHeader(KVTierError):
    """A header region that is neither empty nor a valid header; `reason` says what failed."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What one slot holds. Field order is the on-disk order. Raises `InvalidArgumentError`
    (a `ValueError`) on construction when a field has the wrong type or size."""

    block_id: bytes  # digest_size bytes (16 or 32)
    parent_id: bytes  # id of the previous block, or the namespace seed for a first block
    namespace: bytes  # the namespace seed (a hash of model fingerprint + tenant salt)
    tenant: str  # tenant id, an identifier (never a secret), 1..64 characters
    layout: bytes  # KVLayout.fingerprint, 16 bytes
    tokens: bytes  # the block's token ids, uint32 little-endian
    codec: str  # payload codec name, 1..8 characters ("none", "lz4")
    raw_nbytes: int  # block_bytes before the codec
    payload_nbytes: int  # bytes of payload as stored, 1..raw_nbytes
    payload_checksum: bytes  # checksum(stored payload), 16 bytes
    seq: int  # write sequence number; the higher wins when two copies claim one block id

    def __post_init__(self) -> None:
        for name, kind in _FIELD_TYPES.items():
            value = getattr(self, name)
            if type(value) is not kind:
                raise _bad_field(name, value, kind.__name__)
        digest = len(self.block_id)
        if not (  # every rule of `_rules` at once; the messages are built only on a failure
            digest in DIGEST_SIZES
            and len(self.parent_id) == digest
            and len(self.namespace) == digest
            and 1 <= len(self.tenant) <= MAX_TENANT_CHARS
            and len(self.layout) == LAYOUT_FINGERPRINT_BYTES
            and _is_token_bytes(self.tokens)
            and 1 <= len(self.codec) <= MAX_CODEC_CHARS
            and 1 <= self.raw_nbytes <= _U64_MAX
            and 1 <= self.payload_nbytes <= self.raw_nbytes
            and len(self.payload_checksum) == CHECKSUM_BYTES
            and 0 <= self.seq <= _U64_MAX
        ):
            for name, ok, expected in self._rules(digest):
                if not ok:
                    raise _bad_field(name, getattr(self, name), expected)

    def _rules(self, digest: int) -> tuple[tuple[str, bool, str], ...]:
        """Each field's rule: (field, whether it holds, what was expected)."""
        return (
            ("block_id", digest in DIGEST_SIZES, f"a digest of {sorted(DIGEST_SIZES)} bytes"),
            ("parent_id", len(self.parent_id) == digest, f"{digest} bytes, as block_id"),
            ("namespace", len(self.namespace) == digest, f"{digest} bytes, as block_id"),
            ("tenant", 1 <= len(self.tenant) <= MAX_TENANT_CHARS, "1 to 64 characters"),
            ("layout", len(self.layout) == LAYOUT_FINGERPRINT_BYTES, "16 bytes"),
            ("tokens", _is_token_bytes(self.tokens), "a positive multiple of 4 bytes"),
            ("codec", 1 <= len(self.codec) <= MAX_CODEC_CHARS, "1 to 8 characters"),
            ("raw_nbytes", 1 <= self.raw_nbytes <= _U64_MAX, "1 to 2**64-1"),
            ("payload_nbytes", 1 <= self.payload_nbytes <= self.raw_nbytes, "1 to raw_nbytes"),
            ("payload_checksum", len(self.payload_checksum) == CHECKSUM_BYTES, "16 bytes"),
            ("seq", 0 <= self.seq <= _U64_MAX, "0 to 2**64-1"),
        )


_FIELD_TYPES: dict[str, type] = {
    "block_id": bytes,
    "parent_id": bytes,
    "namespace": bytes,
    "tenant": str,
    "layout": bytes,
    "tokens": bytes,
    "codec": str,
    "raw_nbytes": int,
    "payload_nbytes": int,
    "payload_checksum": bytes,
    "seq": int,
}
_FIELDS = tuple(f.name for f in fields(BlockHeader))
assert tuple(_FIELD_TYPES) == _FIELDS, "every BlockHeader field needs its type here"


def _is_token_bytes(tokens: bytes) -> bool:
    return len(tokens) > 0 and len(tokens) % TOKEN_BYTES == 0


def _bad_field(name: str, value: object, expected: str) -> InvalidArgumentError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return InvalidArgumentError(f"BlockHeader.{name}: got {shown}, expected {expected}")


def align_up(n: int, to: int = SECTOR) -> int:
    """The smallest multiple of `to` that is >= `n` (n >= 0, to >= 1)."""
    if n < 0 or to < 1:
        raise InvalidArgumentError(f"align_up({n}, {to}): expected n >= 0 and to >= 1")
    return (n + to - 1) // to * to


def checksum(data: bytes | memoryview) -> bytes:
    """xxh3-128 of `data`: 16 bytes. Not cryptographic: it catches torn writes and bit rot.

    Measured here at ~80 GB/s on a cache-resident 2 MiB block and ~30 GB/s streaming from RAM,
    against ~1-2 GB/s of NVMe, so checksumming never limits disk bandwidth.
    """
    return xxhash.xxh3_128_digest(data)


def header_region_size(block_tokens: int, digest_size: int) -> int:
    """Whole sectors that hold the largest valid header of this geometry.

    The largest header has every variable field at its longest encoding: a 64-character tenant
    and an 8-character codec of 4-byte UTF-8 characters, and every integer at 2**64-1.
    E.g. 4096 for (16 tokens, 16-byte ids); 20480 for 4096 tokens.
    """
    if type(block_tokens) is not int or block_tokens < 1:
        raise InvalidArgumentError(f"block_tokens: got {block_tokens!r}, expected >= 1")
    if digest_size not in DIGEST_SIZES:
        raise InvalidArgumentError(
            f"digest_size: got {digest_size!r}, expected one of {sorted(DIGEST_SIZES)}"
        )
    widest_char = "\U0010ffff"
    largest = BlockHeader(
        block_id=bytes(digest_size),
        parent_id=bytes(digest_size),
        namespace=bytes(digest_size),
        tenant=widest_char * MAX_TENANT_CHARS,
        layout=bytes(LAYOUT_FINGERPRINT_BYTES),
        tokens=bytes(block_tokens * TOKEN_BYTES),
        codec=widest_char * MAX_CODEC_CHARS,
        raw_nbytes=_U64_MAX,
        payload_nbytes=_U64_MAX,
        payload_checksum=bytes(CHECKSUM_BYTES),
        seq=_U64_MAX,
    )
    return align_up(_PREFIX.size + len(_pack_body(largest)) + CHECKSUM_BYTES)


def slot_size(header_region: int, block_bytes: int) -> int:
    """Bytes of one slot: the header region, then the payload region of whole sectors."""
    _check_region(header_region)
    if block_bytes < 1:
        raise InvalidArgumentError(f"block_bytes: got {block_bytes}, expected >= 1")
    return header_region + align_up(block_bytes)


def encode_header(header: BlockHeader, region_size: int) -> bytes:
    """The header region for `header`: exactly `region_size` bytes (see the diagram above).

    Raises `InvalidArgumentError` (a `ValueError`) when `region_size` is not whole sectors or
    the encoded header does not fit in it.
    """
    _check_region(region_size)
    return _frame(_pack_body(header), region_size)


def decode_header(buf: bytes | memoryview) -> BlockHeader | None:
    """The header at the start of `buf` (a header region, or a whole slot).

    Returns None for an empty slot (first 16 bytes zero). Raises `CorruptHeader` when the magic,
    version, length, checksum, msgpack body or a field is wrong, and never anything else.
    """
    view = memoryview(buf).cast("B")
    if len(view) < _EMPTY_PROBE:
        raise CorruptHeader(f"truncated: {len(view)} bytes, fewer than {_EMPTY_PROBE}")
    if not any(view[:_EMPTY_PROBE]):
        return None
    magic, version, body_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptHeader(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptHeader(f"format version {version}, this build reads {FORMAT_VERSION}")
    end = _PREFIX.size + body_len
    if end + CHECKSUM_BYTES > len(view):
        raise CorruptHeader(
            f"truncated: body of {body_len} bytes needs {end + CHECKSUM_BYTES} bytes, "
            f"got {len(view)}"
        )
    if checksum(view[:end]) != bytes(view[end : end + CHECKSUM_BYTES]):
        raise CorruptHeader("header checksum mismatch")
    try:
        values = msgpack.unpackb(view[_PREFIX.size : end], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CorruptHeader(f"body is not msgpack: {type(e).__name__}: {e}") from e
    if type(values) is not list or len(values) != len(_FIELDS):
        raise CorruptHeader(f"body is not an array of {len(_FIELDS)} fields")
    try:
        return BlockHeader(*values)
    except InvalidArgumentError as e:
        raise CorruptHeader(str(e)) from e


def empty_header(region_size: int) -> bytes:
    """An empty header region (zeros): what retires a slot, so that it decodes to None."""
    _check_region(region_size)
    return bytes(region_size)


class BlockFields(Protocol):
    """What a copy records of its block, as the caller knows it (`copies.BlockMeta`)."""

    @property
    def block_id(self) -> bytes: ...
    @property
    def parent_id(self) -> bytes: ...
    @property
    def namespace(self) -> bytes: ...
    @property
    def tenant(self) -> str: ...
    @property
    def tokens(self) -> bytes: ...


class HeaderWriter:
    """The header regions of the copies of one tier: fixed region size, layout and raw size.

    `encode` gives byte for byte what `encode_header` gives for the `BlockHeader` of the same
    fields, checks the same rules (a failure raises `BlockHeader`'s own error), and is safe
    from several threads (each packs with a `msgpack.Packer` of its own)."""

    def __init__(self, region_size: int, layout: bytes, raw_nbytes: int) -> None:
        _check_region(region_size)
        ids, sums = bytes(min(DIGEST_SIZES)), bytes(CHECKSUM_BYTES)  # valid placeholders
        BlockHeader(ids, ids, ids, "t", layout, bytes(TOKEN_BYTES), "none", raw_nbytes, 1, sums, 0)
        self.region_size = region_size
        self.layout = layout
        self.raw_nbytes = raw_nbytes
        self._local = threading.local()

    def encode(
        self, block: BlockFields, codec: str, payload: bytes | memoryview, seq: int
    ) -> bytes:
        """The header region of a copy of `block` whose stored payload (bytes) is `payload`, in
        `codec`, numbered `seq`. `InvalidArgumentError` (a `ValueError`) for a field that
        breaks a rule of `BlockHeader`, or a header that does not fit the region."""
        block_id, parent_id, namespace = block.block_id, block.parent_id, block.namespace
        tenant, tokens, stored = block.tenant, block.tokens, len(payload)
        layout, raw, digest = self.layout, self.raw_nbytes, len(block_id)
        values = [  # the order of `BlockHeader`'s fields
            block_id, parent_id, namespace, tenant, layout, tokens, codec, raw, stored,
            checksum(payload), seq,
        ]  # fmt: skip
        if not (  # `BlockHeader`'s rules for the fields not fixed when the writer was made
            type(block_id) is bytes
            and type(parent_id) is bytes
            and type(namespace) is bytes
            and type(tenant) is str
            and type(tokens) is bytes
            and type(codec) is str
            and type(seq) is int
            and digest in DIGEST_SIZES
            and len(parent_id) == digest
            and len(namespace) == digest
            and 1 <= len(tenant) <= MAX_TENANT_CHARS
            and _is_token_bytes(tokens)
            and 1 <= len(codec) <= MAX_CODEC_CHARS
            and 1 <= stored <= raw
            and 0 <= seq <= _U64_MAX
        ):
            sums = bytes(CHECKSUM_BYTES)  # raises, naming the field:
            BlockHeader(block_id, parent_id, namespace, tenant, layout, tokens, codec, raw, stored,
                        sums, seq)  # fmt: skip
            raise AssertionError("HeaderWriter checks a rule that BlockHeader does not")
        packer = getattr(self._local, "packer", None)
        if packer is None:
            packer = self._local.packer = msgpack.Packer(use_bin_type=True)
        body: bytes = packer.pack(values)
        return _frame(body, self.region_size)


def _frame(body: bytes, region_size: int) -> bytes:
    """The header region around `body`: prefix, body, header checksum, zero padding."""
    framed = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body
    used = len(framed) + CHECKSUM_BYTES
    if used > region_size:
        raise InvalidArgumentError(
            f"header of {used} bytes does not fit a header region of {region_size} bytes"
        )
    return framed + checksum(framed) + bytes(region_size - used)


def _pack_body(header: BlockHeader) -> bytes:
    body: bytes = msgpack.packb([getattr(header, name) for name in _FIELDS], use_bin_type=True)
    return body


def _check_region(region_size: int) -> None:
    if region_size < SECTOR or region_size % SECTOR:
        raise InvalidArgumentError(
            f"header region: got {region_size} bytes, expected a positive multiple of {SECTOR}"
        )
