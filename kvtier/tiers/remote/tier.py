"""The remote tier's face for one model layout: blocks addressed by their place on a path.

A path is what the index walks: the namespace seed, then the chained ids of its blocks from
position 0 (`blocks.py`). `RemoteTier` turns "blocks start..stop-1 of this path" into the keys,
values and round trips of `entry.py` and `cluster.py`, and KV tensors into payloads and back:

- `probe(seed, ids, start)`: how many blocks from `start` on the cluster holds, in a row (one
  pipelined EXISTS round trip; a group of `group_blocks` is one slot);
- `write(seed, ids, start, blocks)`: store blocks start.. of the path from KV tensors (one
  round trip; a block some node stored already is left as it is);
- `read(seed, ids, start, out)`: fetch blocks start.. into `out` (block tensors, e.g. host
  pool slots), each verified against the block the path says it is; per block, whether it was
  served. A block not served leaves its `out` tensor as garbage: the caller publishes only
  blocks that were (DESIGN invariant 1), and only a leading run of them (prefix closure).

Contract:
- Nothing raises because of the cluster or of what it holds (`cluster.py`): a miss is False,
  counted. A caller's mistake (a tensor of the wrong shape or dtype, positions off the path)
  is an `InvalidArgumentError` / `InvalidKVError` before anything is sent.
- No token, tenant name or secret leaves the process: keys and values carry only ids
  (`entry.py`), which are keyed by the namespace seed.
- Values carry their codec; a payload that does not decode (`CorruptPayload`) is a miss,
  counted in `verify_failures` and `misses` (not in `hits`, which the cluster counted when its
  checks passed), and deleted. A value that names a codec this build lacks is a miss too (in
  `misses`, named in `last_error`) but stays: its checks passed, so a node of a newer release
  wrote it, and in a rolling upgrade the older nodes would delete every such value as it came
  (and the newer ones write it again); the older ones miss those blocks until upgraded. A
  block a quantized codec cannot keep (not finite) is stored plain.
- With `mac_key` (`entry.mac_key_of` the cluster secret), values carry MACs keyed by
  `entry.prefix_mac_key(mac_key, prefix)`: a value another prefix's nodes wrote (copied under
  this prefix's key) fails them, a verify failure, deleted.
- Thread-safe (the mover's threads share one tier). A write copies no payload: each value goes
  out as its header and a view of the block (`entry.SplitValue`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.blocks import KVLayout
from kvtier.errors import InvalidArgumentError, InvalidKVError
from kvtier.tiers.disk.codec import Codec, CorruptPayload, NoneCodec, codec_for, known_codec
from kvtier.tiers.remote.cluster import RemoteCluster
from kvtier.tiers.remote.entry import (
    ValueMeta,
    check_prefix,
    encode_value_parts,
    path_keys,
    prefix_mac_key,
)


class RemoteTier:
    def __init__(
        self,
        cluster: RemoteCluster,
        layout: KVLayout,
        prefix: str = "kvtier",
        group_blocks: int = 16,
        codec: Codec | None = None,
        mac_key: bytes | None = None,
    ) -> None:
        if not 1 <= group_blocks <= 4096:
            raise InvalidArgumentError(f"group_blocks: got {group_blocks}, expected 1 to 4096")
        self.cluster = cluster
        self.layout = layout
        self.prefix = check_prefix(prefix)
        self.group_blocks = group_blocks
        self.codec = codec if codec is not None else NoneCodec()
        # values authenticated with the prefix's key of it (`entry`), else checksummed
        self.mac_key = None if mac_key is None else prefix_mac_key(mac_key, self.prefix)
        self._decode_failures = 0  # under `_lock`: the mover's threads read at once
        self._unknown_codecs = 0  # values of a codec this build lacks (under `_lock`)
        self._hits_shown = 0  # the `hits` stats() last answered (under `_lock`): never less
        self._lock = threading.Lock()

    def probe(self, seed: bytes, ids: Sequence[bytes], start: int) -> int:
        """How many blocks of the path from `start` on the cluster holds, in a row."""
        self._check_span(ids, start, len(ids))
        return self.cluster.present(self._keys(ids, start, len(ids)))

    def write(
        self, seed: bytes, ids: Sequence[bytes], start: int, blocks: Sequence[torch.Tensor]
    ) -> list[bool]:
        """Store blocks start, start + 1, ... of the path, block i's KV in `blocks[i]`
        (`layout.block_shape`, `layout.dtype`); per block, whether the cluster holds it now."""
        self._check_span(ids, start, start + len(blocks))
        for block in blocks:
            self._check_block(block)
        keys = self._keys(ids, start, start + len(blocks))
        metas = self._metas(seed, ids, start, len(blocks))
        values = []
        for meta, block in zip(metas, blocks, strict=True):
            raw = block.contiguous().view(torch.uint8).reshape(-1).numpy().data
            try:
                stored = self.codec.encode(raw, self.layout.itemsize)
                name = self.codec.name
            except InvalidArgumentError:  # quantized, and KV it cannot keep: store it plain
                stored, name = raw, "none"
            if not self.codec.lossy and memoryview(stored).nbytes >= raw.nbytes:
                stored, name = raw, "none"  # incompressible: store it plain
            # the payload is sent from `stored` itself (no staging copy): `raw` views the
            # block, which the caller keeps unchanged until this returns
            values.append(encode_value_parts(meta, name, stored))
        return self.cluster.put(list(zip(keys, values, strict=True)))

    def read(
        self, seed: bytes, ids: Sequence[bytes], start: int, out: Sequence[torch.Tensor]
    ) -> list[bool]:
        """Fetch blocks start, start + 1, ... of the path into `out` (one block tensor each);
        per block, whether it was served (verified, decoded, copied)."""
        self._check_span(ids, start, start + len(out))
        for block in out:
            self._check_block(block)
        keys = self._keys(ids, start, start + len(out))
        got = self.cluster.get(keys, self._metas(seed, ids, start, len(out)))
        served = []
        bad = []
        for key, entry, block in zip(keys, got, out, strict=True):
            if entry is None:
                served.append(False)
                continue
            name, payload = entry
            if not known_codec(name):  # a newer node's: a miss here, kept (module doc)
                with self._lock:
                    self._unknown_codecs += 1
                self.cluster.last_error = f"a value of codec {name!r}, which this build lacks"
                served.append(False)
                continue
            try:
                codec = codec_for(name, self.layout)
                raw = codec.decode(payload, self.layout.block_bytes, self.layout.itemsize)
            except CorruptPayload:
                with self._lock:
                    self._decode_failures += 1
                bad.append(key)
                served.append(False)
                continue
            flat = block.view(torch.uint8).reshape(-1).numpy()
            flat[:] = np.frombuffer(raw, dtype=np.uint8)  # read-only source, one copy
            served.append(True)
        if bad:
            self.cluster.delete(bad)
        return served

    def stats(self) -> dict[str, Any]:
        """The cluster's counters, with payloads that did not decode in `verify_failures`, and
        they and values of codecs this build lacks as misses, not hits."""
        with self._lock:  # first: each one counted here was a hit of the cluster's already
            corrupt, failed = self._decode_failures, self._decode_failures + self._unknown_codecs
        figures = self.cluster.stats()
        figures["verify_failures"] += corrupt
        figures["misses"] += failed
        # a get counts its hit before its payload fails to decode: a read between the two
        # counted it a hit, the next a miss, and `hits` went down (a counter reset to
        # Prometheus); it stays at the highest value shown until the cluster's catch up
        with self._lock:
            self._hits_shown = figures["hits"] = max(self._hits_shown, figures["hits"] - failed)
        return figures

    def check(self) -> None:
        self.cluster.check()
        assert self._decode_failures >= 0 and self._unknown_codecs >= 0

    # ---- inside -------------------------------------------------------------------------

    def _keys(self, ids: Sequence[bytes], start: int, stop: int) -> list[bytes]:
        keyed = self.mac_key is not None  # authenticated values' keys of their own (`entry`)
        return path_keys(self.prefix, ids, start, stop, self.group_blocks, keyed)

    def _metas(self, seed: bytes, ids: Sequence[bytes], start: int, count: int) -> list[ValueMeta]:
        fingerprint, nbytes = self.layout.fingerprint, self.layout.block_bytes
        return [
            ValueMeta(ids[p], ids[p - 1] if p else seed, fingerprint, nbytes, self.mac_key)
            for p in range(start, start + count)
        ]

    def _check_span(self, ids: Sequence[bytes], start: int, stop: int) -> None:
        if not 0 <= start <= stop <= len(ids):
            raise InvalidArgumentError(
                f"blocks {start}..{stop - 1}: expected positions on a path of {len(ids)} blocks"
            )

    def _check_block(self, block: torch.Tensor) -> None:
        shape = tuple(self.layout.block_shape)
        if tuple(block.shape) != shape or block.dtype != self.layout.dtype:
            raise InvalidKVError(
                f"remote tier block: got {tuple(block.shape)} {block.dtype}, expected {shape} "
                f"{self.layout.dtype}"
            )
        if block.device.type != "cpu":
            raise InvalidKVError(f"remote tier block on {block.device}, expected host memory")
