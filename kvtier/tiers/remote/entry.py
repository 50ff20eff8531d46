"""One block in the remote tier (issue 14): its key, and its value, one per block.

Keys. `<prefix>:v1:{<group tag>}:<block id, hex>`, as bytes (v1: `KEY_VERSION`; `v3`,
`KEYED_KEY_VERSION`, for authenticated values, module end). The prefix
names one deployment (an operator's `tiers.remote.key_prefix`: several fleets may share a
cluster). The block id is kvtier's chained id (`blocks.py`), so the model layout, the tenant's
namespace and the whole token prefix are inside it, and no token or tenant name is in a key. The
part in braces is a Redis Cluster hash tag: only it picks the key's slot. Blocks are grouped by
position along their path, `group_blocks` to a group, and a group's tag is the first 8 bytes
(hex) of the id of its first block, so the blocks of one group share a slot and one pipelined
round trip reads or probes them all, while different prefixes, and later groups of one prefix,
spread over the cluster:

    positions   0 1 2 3 | 4 5 6 7 | 8 ...          group_blocks = 4
    tag         id0     | id4     | id8            (first 8 bytes of that block's id, hex)
    key of 6    kvtier:v1:{<id4[:8] hex>}:<id6 hex>

`block_key` builds one key; `path_keys(prefix, ids, start, stop, group_blocks)` the keys of
positions start..stop-1 of a path whose ids (from position 0) are `ids` (`keyed=True`: the
keys of authenticated values).

Values. A remote value is written by one kvtier node and read by any other that shares the
cluster, or by none: the cluster may drop it, truncate it (a failover mid-write), or hold what
another program wrote under the key. So a value says what it is, and a reader believes nothing
it has not checked against what it expected to find.

    value (little-endian):

    0      4         6        7          8         16         24        40      56
    +------+---------+--------+----------+---------+----------+---------+-------+----
    | KVTR | version | id_len | codec_len| raw     | payload  | payload | layout| ...
    |      | u16 =1  | u8     | u8       | nbytes  | nbytes   | xxh3-128| fp 16 |
    +------+---------+--------+----------+---------+----------+---------+-------+----
         ... | block_id (id_len) | parent_id (id_len) | codec (codec_len, ASCII) |
             | header xxh3-128 of every byte before it (16) | payload (payload_nbytes) |

Contract:
- `encode_value(meta, codec, payload)` returns the value's bytes (`encode_value_parts` the
  same as a header and a view of the payload, for a put that copies nothing), or raises
  `InvalidArgumentError` naming the field when `meta` is not well-formed (ids of a digest size
  of `blocks.ALGORITHMS`, a 16-byte layout fingerprint, a 1-8 character ASCII codec name,
  1 <= payload length <= raw_nbytes).
- `decode_value(value, expect)` returns `(codec, payload)` when the value is exactly what
  `expect` describes (block id, parent id, layout fingerprint, raw size), with both checksums
  right and no byte left over; otherwise it raises `RemoteValueError`, whose `reason` says what
  failed. It raises nothing else, whatever the bytes, and never allocates more than the value's
  own length. The payload is a view into `value` (no copy). No value of the block is longer
  than `max_value_nbytes(expect)`, so a reader asks for no more bytes than that.
- No token, tenant name or secret is in a value: the ids are chained from a namespace seed
  (`blocks.py`), which is all a reader needs to ask for the value, and all it learns.

Invariants:
- The header checksum covers every header field, and the header holds the payload checksum, so
  a value is served only if both match: a torn or truncated write is a miss, never wrong bytes.
- A reader checks the ids it expected, not the ids the value claims: a value stored under the
  wrong key (a bug, a collision, a hostile writer) is a miss.
- Changing the layout of the bytes needs a new `VALUE_VERSION`; changing the key scheme, a new
  `KEY_VERSION` (it is part of every key, so old keys are simply never asked for); and a new
  `KEYED_VERSION` a new `KEYED_KEY_VERSION`, so that nodes of two releases never read (and
  delete as forged) each other's authenticated values.

Authenticated values (`tiers.remote.authenticate`). xxh3 catches damage, not forgery: whoever
can write to the cluster can read a value, change its payload and recompute both checksums.
With a MAC key (`ValueMeta.mac_key`, derived from the cluster secret that kvtier nodes share,
`mac_key_of`), a value is version `KEYED_VERSION`, its two checksums are HMAC-SHA256 truncated
to 16 bytes (the payload's, and the header's over every byte before it, the payload's
included), and a reader that holds the key accepts only such values: a value written without
the key (or with another) is a miss, so a writer without the secret cannot make a node serve
its bytes. The key is the secret's as seen by one key prefix (`prefix_mac_key`, which
`tier.RemoteTier` applies): the MACs bind the block, its layout and codec, and the deployment,
so a value copied from one prefix's key to another's (old weights' KV under a new prefix) is a
miss there, not a block. Authenticated values live under keys of their own, `:v3:` where plain
ones have `:v1:` (`KEYED_KEY_VERSION`, the value version it holds): the nodes of a release that
wrote version 2 values under `:v1:` keys, and plain nodes, never ask for them, so in a rolling
upgrade neither side reads the other's values as forged and deletes them (or skips its own
write, SET NX, where the other's value sits): each keeps its cache. It costs a SHA-256 pass over
each payload on both sides (about 1.6 GB/s a core on this machine, against xxh3's 57).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.blocks import ALGORITHMS
from kvtier.errors import InvalidArgumentError, KVTierError

KEY_VERSION = 1
KEYED_KEY_VERSION = 3  # authenticated values' keys (module doc): apart from v1 and version 2's
TAG_BYTES = 8
PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
MAGIC = b"KVTR"
VALUE_VERSION = 1
KEYED_VERSION = 3  # the checksums are MACs by a prefix's key (2: by the secret's; module doc)
CHECKSUM_BYTES = 16
LAYOUT_BYTES = 16
MAX_CODEC_CHARS = 8
DIGEST_SIZES = frozenset(size for size, _ in ALGORITHMS.values())

_FIXED = struct.Struct("<4sHBBQQ16s16s")  # magic .. layout fingerprint
_U64_MAX = 2**64 - 1


class RemoteValueError(KVTierError):
    """A value that is not the block it was read for; `reason` says which check failed."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class ValueMeta:
    """What a value must say about its block: written by the writer, expected by a reader."""

    block_id: bytes
    parent_id: bytes  # the previous block's id, or the namespace seed for a first block
    layout: bytes  # KVLayout.fingerprint
    raw_nbytes: int  # the block's bytes before the codec (KVLayout.block_bytes)
    mac_key: bytes | None = None  # checksums keyed by it (module doc), else plain xxh3


def mac_key_of(secret: bytes) -> bytes:
    """The MAC key of values from the cluster `secret` (which also keys tenant salts: the two
    uses get keys of their own)."""
    return hmac.digest(secret, b"kvtier remote value MAC v2", hashlib.sha256)


def prefix_mac_key(mac_key: bytes, prefix: str) -> bytes:
    """The MAC key of the values under the key prefix `prefix`, from `mac_key` (`mac_key_of`):
    a value copied from one prefix's key to another's fails its MACs there (module doc)."""
    return hmac.digest(mac_key, b"key prefix " + check_prefix(prefix).encode(), hashlib.sha256)


def _digest(data: bytes | bytearray | memoryview, key: bytes | None) -> bytes:
    """A value's checksum of `data`: xxh3-128, or HMAC-SHA256 truncated to 16 bytes."""
    if key is None:
        return xxhash.xxh3_128_digest(data)
    return hmac.digest(key, data, hashlib.sha256)[:CHECKSUM_BYTES]


def check_prefix(prefix: str) -> str:
    """`prefix` if it can start a key: 1-64 of `[A-Za-z0-9_.-]` (no brace, which would move the
    hash tag, and no colon, which separates the parts); `InvalidArgumentError` otherwise."""
    if not (1 <= len(prefix) <= 64 and set(prefix) <= PREFIX_CHARS):
        raise InvalidArgumentError(
            f"key_prefix: got {prefix!r}, expected 1 to 64 of A-Z a-z 0-9 _ . -"
        )
    return prefix


def block_key(prefix: str, group_first_id: bytes, block_id: bytes, keyed: bool = False) -> bytes:
    """The key of `block_id`, whose group starts with the block `group_first_id` (`keyed`:
    of its authenticated value, under `KEYED_KEY_VERSION`)."""
    tag = group_first_id[:TAG_BYTES].hex()
    version = KEYED_KEY_VERSION if keyed else KEY_VERSION
    return f"{prefix}:v{version}:{{{tag}}}:{block_id.hex()}".encode("ascii")


def path_keys(
    prefix: str,
    ids: Sequence[bytes],
    start: int,
    stop: int,
    group_blocks: int,
    keyed: bool = False,
) -> list[bytes]:
    """The keys of positions start..stop-1 of a path whose block ids, from position 0, are
    `ids` (at least `stop` of them; only each position's and its group's first are read);
    `keyed`: of authenticated values (`block_key`)."""
    assert 0 <= start <= stop <= len(ids) and group_blocks >= 1
    return [block_key(prefix, ids[p - p % group_blocks], ids[p], keyed) for p in range(start, stop)]


def header_nbytes(id_len: int, codec: str) -> int:
    """Bytes of a value before its payload."""
    return _FIXED.size + 2 * id_len + len(codec) + CHECKSUM_BYTES


def max_value_nbytes(meta: ValueMeta) -> int:
    """The longest value the block `meta` describes can have (the longest codec name, a plain
    payload): what a reader asks the cluster for at most."""
    return header_nbytes(len(meta.block_id), "x" * MAX_CODEC_CHARS) + meta.raw_nbytes


def encode_value(meta: ValueMeta, codec: str, payload: bytes | memoryview) -> bytes:
    """The value of one block whose stored payload (after `codec`) is `payload`."""
    return b"".join(encode_value_parts(meta, codec, payload).parts)


@dataclass(frozen=True)
class SplitValue:
    """A value as its two parts, never joined: the header (with its checksum) and a view of
    the payload. `cluster.RemoteCluster.put` sends the parts one after the other as one Redis
    value, so a writer copies no payload into a staging buffer (a 2 MiB copy is a tenth of a
    SET's time). `payload` must stay unchanged until the put returns."""

    head: bytes
    payload: memoryview  # format "B"

    @property
    def parts(self) -> tuple[bytes, memoryview]:
        return self.head, self.payload

    @property
    def nbytes(self) -> int:
        return len(self.head) + self.payload.nbytes


def encode_value_parts(
    meta: ValueMeta, codec: str, payload: bytes | bytearray | memoryview
) -> SplitValue:
    """`encode_value` as its parts: the header is built, the payload only viewed."""
    header = _header(meta, codec, payload)
    return SplitValue(header + _digest(header, meta.mac_key), memoryview(payload).cast("B"))


def _header(meta: ValueMeta, codec: str, payload: bytes | bytearray | memoryview) -> bytes:
    """A value's bytes before its header checksum, after checking `meta` (module doc)."""
    id_len = len(meta.block_id)
    payload_nbytes = memoryview(payload).nbytes
    if id_len not in DIGEST_SIZES:
        raise InvalidArgumentError(
            f"block_id: got {id_len} bytes, expected one of {sorted(DIGEST_SIZES)}"
        )
    if len(meta.parent_id) != id_len:
        raise InvalidArgumentError(
            f"parent_id: got {len(meta.parent_id)} bytes, expected {id_len}, as block_id"
        )
    if len(meta.layout) != LAYOUT_BYTES:
        raise InvalidArgumentError(f"layout: got {len(meta.layout)} bytes, expected 16")
    if not (1 <= len(codec) <= MAX_CODEC_CHARS and codec.isascii() and codec.isprintable()):
        raise InvalidArgumentError(f"codec: got {codec!r}, expected 1 to 8 ASCII characters")
    if not 1 <= payload_nbytes <= meta.raw_nbytes <= _U64_MAX:
        raise InvalidArgumentError(
            f"payload: got {payload_nbytes} bytes for a {meta.raw_nbytes}-byte block, "
            "expected 1 to raw_nbytes"
        )
    return (
        _FIXED.pack(
            MAGIC,
            VALUE_VERSION if meta.mac_key is None else KEYED_VERSION,
            id_len,
            len(codec),
            meta.raw_nbytes,
            payload_nbytes,
            _digest(payload, meta.mac_key),
            meta.layout,
        )
        + meta.block_id
        + meta.parent_id
        + codec.encode("ascii")
    )


def decode_value(value: bytes | memoryview, expect: ValueMeta) -> tuple[str, memoryview]:
    """The codec and stored payload of `value`, if it is the block `expect` describes."""
    view = memoryview(value).cast("B")
    if len(view) < _FIXED.size:
        raise RemoteValueError(f"truncated: {len(view)} bytes, shorter than a header")
    magic, version, id_len, codec_len, raw_nbytes, payload_nbytes, payload_sum, layout = (
        _FIXED.unpack_from(view)
    )
    if magic != MAGIC:
        raise RemoteValueError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    key = expect.mac_key
    wanted = VALUE_VERSION if key is None else KEYED_VERSION
    if version != wanted:
        how = "plain checksums: authenticate off" if key is None else "MACs: authenticate on"
        raise RemoteValueError(f"value version {version}, expected {wanted} ({how})")
    if id_len != len(expect.block_id) or not 1 <= codec_len <= MAX_CODEC_CHARS:
        raise RemoteValueError(f"id length {id_len} or codec length {codec_len} out of range")
    head = header_nbytes(id_len, "x" * codec_len)
    if len(view) != head + payload_nbytes:
        raise RemoteValueError(
            f"length {len(view)} bytes, expected {head} of header + {payload_nbytes} of payload"
        )
    if not hmac.compare_digest(
        _digest(view[: head - CHECKSUM_BYTES], key), view[head - CHECKSUM_BYTES : head]
    ):
        raise RemoteValueError("header checksum mismatch")
    at = _FIXED.size
    block_id, parent_id = view[at : at + id_len], view[at + id_len : at + 2 * id_len]
    codec_bytes = bytes(view[at + 2 * id_len : head - CHECKSUM_BYTES])
    if block_id != expect.block_id or parent_id != expect.parent_id:
        raise RemoteValueError("the value holds another block (its ids differ from the key's)")
    if layout != expect.layout:
        raise RemoteValueError("the value was written for another model layout")
    if raw_nbytes != expect.raw_nbytes or not 1 <= payload_nbytes <= raw_nbytes:
        raise RemoteValueError(
            f"sizes raw {raw_nbytes} / stored {payload_nbytes}, expected raw {expect.raw_nbytes}"
        )
    if not codec_bytes.isascii() or not codec_bytes.decode("ascii").isprintable():
        raise RemoteValueError("codec name is not printable ASCII")
    payload = view[head:]
    if not hmac.compare_digest(_digest(payload, key), payload_sum):
        raise RemoteValueError("payload checksum mismatch")
    return codec_bytes.decode("ascii"), payload
