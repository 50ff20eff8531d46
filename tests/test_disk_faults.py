"""Faults of the disk tier, through KVStore: damaged and truncated slab files, forged headers,
a full filesystem, a vanished directory, failing system calls.

The setup (conftest "disk-tier stores"): sequences S0..S9 of 2 blocks each are stored in order;
S8, S9 stay on gpu, S6, S7 on host and S0..S5 (12 blocks) go to disk, one 8192-byte slot each
in `slab-00000.kvt` (a 4096-byte header region, then the payload). DESIGN invariant 7: a copy
that fails its checksum is dropped, counted and never served; everything else still is.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    DISK_BLOCK_BYTES,
    DISK_HEADER_BYTES,
    DISK_SLOT_BYTES,
    disk_config,
    fill,
    hit,
    kv_for,
    leased_kv,
    mounted_tmpfs,
    same,
    slab_headers,
    tier,
)

from kvtier.blocks import BlockHasher
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, InvariantError
from kvtier.results import StoreResult
from kvtier.store import KVStore
from kvtier.tiers.disk import slabs as disk_slabs
from kvtier.tiers.disk.format import BlockHeader, checksum, encode_header
from kvtier.tiers.disk.io import SlabFile

OpenStore = Callable[[KVTierConfig], KVStore]
KIB = 1024
SEQS = [list(range(100 * i, 100 * i + 8)) for i in range(10)]


def demoted(path: Path, open_store: OpenStore) -> tuple[KVTierConfig, list[torch.Tensor]]:
    """Store S0..S9 (S0..S5 end on disk), close the store; its config and the KVs."""
    config = disk_config(path)
    store = open_store(config)
    kvs = fill(store, SEQS)
    assert [store.lookup(tokens) for tokens in SEQS[:6]] == [hit(disk=8)] * 6
    store.close()
    return config, kvs


def slot_of(path: Path, seq: int, block: int) -> int:
    """The slot that holds block `block` of sequence S`seq`."""
    slot, _ = slab_headers(path)[tuple(SEQS[seq][4 * block : 4 * block + 4])]
    return slot


def flip(path: Path, offset: int, length: int, rng: random.Random, count: int = 3) -> None:
    """XOR `count` random bytes in `[offset, offset + length)` of the first slab with nonzero
    values, so that each one changes."""
    with open(path / "slab-00000.kvt", "r+b") as slab:
        for at in rng.sample(range(offset, offset + length), count):
            slab.seek(at)
            byte = slab.read(1)[0]
            slab.seek(at)
            slab.write(bytes([byte ^ rng.randrange(1, 256)]))


def header_length(path: Path, slot: int) -> int:
    """Bytes of the encoded header of `slot` (prefix, msgpack body, checksum); the rest of the
    header region is padding that nothing reads."""
    with open(path / "slab-00000.kvt", "rb") as slab:
        slab.seek(slot * DISK_SLOT_BYTES)
        body_len = int.from_bytes(slab.read(10)[6:10], "little")
    return 10 + body_len + 16


# ---- corruption and truncation -------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_damaged_headers_are_refused_at_recovery_and_damaged_payloads_when_read(
    tmp_path: Path, open_store: OpenStore, seed: int
) -> None:
    path = tmp_path / "disk"
    config, kvs = demoted(path, open_store)
    rng = random.Random(seed)
    for seq, block in ((3, 0), (4, 1)):  # headers
        slot = slot_of(path, seq, block)
        flip(path, slot * DISK_SLOT_BYTES, header_length(path, slot), rng)
    payloads = {seq: slot_of(path, seq, block) for seq, block in ((1, 1), (2, 0), (5, 0))}
    for slot in payloads.values():
        flip(path, slot * DISK_SLOT_BYTES + DISK_HEADER_BYTES, DISK_BLOCK_BYTES, rng)

    store = open_store(config)
    store.check()
    recovery = store.recovery
    assert (recovery["corrupt"], recovery["orphans"], recovery["bad_ids"]) == (2, 1, 0)
    assert (recovery["recovered"], recovery["empty"]) == (9, 116)  # S3's second block: orphan
    assert [store.lookup(tokens) for tokens in SEQS] == [
        *[hit(disk=8)] * 3,
        hit(),
        hit(disk=4),
        hit(disk=8),
        *[hit()] * 4,
    ]

    # S1: the second block fails its checksum; the load returns the verified first block
    result = store.load(SEQS[1])
    store.check()
    assert result.num_tokens == 4 and same(result.kv, kvs[1][:, :, :4])
    faults = tier(store, "disk")["faults"]
    assert (store.ops["corrupt_dropped"], faults["corrupt_reads"]) == (1, 1)
    assert store.lookup(SEQS[1]) == hit(disk=4)
    assert same(store.load(SEQS[1]).kv, kvs[1][:, :, :4])  # no second drop

    # S2: the first block is bad, so its intact second block goes too (it would be an orphan)
    assert store.load(SEQS[2]).num_tokens == 0
    store.check()
    assert store.lookup(SEQS[2]) == hit()
    disk = tier(store, "disk")
    assert (disk["blocks"], disk["free_slots"], store.ops["corrupt_dropped"]) == (6, 122, 2)

    # S5: found by a prefetch, which leases nothing rather than a bad copy
    lease = store.prefetch(SEQS[5])
    store.check()
    assert (lease.num_tokens, lease.block_table) == (0, ())
    store.release(lease)
    assert store.lookup(SEQS[5]) == hit()
    assert (store.ops["corrupt_dropped"], tier(store, "disk")["faults"]["corrupt_reads"]) == (3, 3)
    assert tier(store, "disk")["blocks"] == 4

    # everything untouched is still served, bit-exact
    assert same(store.load(SEQS[0]).kv, kvs[0])
    assert same(store.load(SEQS[4]).kv, kvs[4][:, :, :4])
    lease = store.prefetch(SEQS[0])
    assert same(leased_kv(store, lease), kvs[0])
    store.release(lease)
    store.check()


def test_a_truncated_slab_serves_what_is_whole_and_keeps_working(
    tmp_path: Path, open_store: OpenStore
) -> None:
    path = tmp_path / "disk"
    config, kvs = demoted(path, open_store)
    cut = slot_of(path, 3, 1)  # S3's second block: header whole, payload cut short
    os.truncate(path / "slab-00000.kvt", cut * DISK_SLOT_BYTES + DISK_HEADER_BYTES + 1000)

    store = open_store(config)
    store.check()
    assert (store.recovery["recovered"], store.recovery["empty"]) == (8, 120)
    assert store.recovery["corrupt"] == 0
    assert os.path.getsize(path / "slab-00000.kvt") == 128 * DISK_SLOT_BYTES  # whole again
    assert [store.lookup(tokens) for tokens in SEQS[:6]] == [hit(disk=8)] * 4 + [hit()] * 2
    result = store.load(SEQS[3])
    store.check()
    assert result.num_tokens == 4 and same(result.kv, kvs[3][:, :, :4])
    assert store.ops["corrupt_dropped"] == tier(store, "disk")["faults"]["corrupt_reads"] == 1
    for tokens, kv in zip(SEQS[:3], kvs[:3], strict=True):
        assert same(store.load(tokens).kv, kv)

    # new demotions land in the slots past the cut, and are served and recovered
    more = [list(range(5000 + 100 * i, 5000 + 100 * i + 8)) for i in range(8)]
    new = fill(store, more, seed=50)
    assert tier(store, "disk")["blocks"] == 7 + 8
    assert set(tier(store, "disk")["faults"].values()) == {0, 1}  # the one corrupt read
    for tokens, kv in zip(more[:4], new[:4], strict=True):
        assert store.lookup(tokens) == hit(disk=8)
        assert same(store.load(tokens).kv, kv)
    store.close()
    store = open_store(config)
    assert store.recovery["recovered"] == 15
    for tokens, kv in zip(SEQS[:3] + more[:4], kvs[:3] + new[:4], strict=True):
        assert same(store.load(tokens).kv, kv)
    store.check()


def test_a_header_whose_id_is_not_the_hash_of_its_chain_is_refused(
    tmp_path: Path, open_store: OpenStore
) -> None:
    path = tmp_path / "disk"
    config, kvs = demoted(path, open_store)
    _, genuine = slab_headers(path)[tuple(SEQS[0][:4])]
    namespace = genuine.namespace
    hasher = BlockHasher("blake2b-128")
    tokens = struct.pack("<4I", 7000, 7001, 7002, 7003)
    child_tokens = struct.pack("<4I", 7004, 7005, 7006, 7007)
    forged_id = hasher.chain(namespace, struct.pack("<4I", 1, 2, 3, 4), 16)  # other tokens
    child_id = hasher.chain(forged_id, child_tokens, 16)  # right for its (forged) parent
    payload = bytes(range(256)) * (DISK_BLOCK_BYTES // 256)

    def image(block_id: bytes, parent_id: bytes, block_tokens: bytes, seq: int) -> bytes:
        header = BlockHeader(
            block_id=block_id,
            parent_id=parent_id,
            namespace=namespace,
            tenant="default",
            layout=genuine.layout,
            tokens=block_tokens,
            codec="none",
            raw_nbytes=DISK_BLOCK_BYTES,
            payload_nbytes=DISK_BLOCK_BYTES,
            payload_checksum=checksum(payload),
            seq=seq,
        )
        return encode_header(header, DISK_HEADER_BYTES) + payload

    with open(path / "slab-00000.kvt", "r+b") as slab:
        slab.seek(100 * DISK_SLOT_BYTES)
        slab.write(image(forged_id, namespace, tokens, 1000))
        slab.write(image(child_id, forged_id, child_tokens, 1001))

    store = open_store(config)
    store.check()
    recovery = store.recovery
    assert (recovery["bad_ids"], recovery["orphans"], recovery["recovered"]) == (1, 1, 12)
    assert store.lookup([7000, 7001, 7002, 7003, 7004, 7005, 7006, 7007]) == hit()
    assert tier(store, "disk")["free_slots"] == 128 - 12
    for seq, kv in zip(SEQS[:6], kvs[:6], strict=True):
        assert same(store.load(seq).kv, kv)
    store.check()


# ---- a full filesystem -------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs mounted on a fresh directory; skips where mounting is not permitted."""
    with mounted_tmpfs(tmp_path / "small", "512k") as mount_point:
        yield mount_point


def test_a_capacity_the_filesystem_cannot_hold_is_refused_before_anything_is_written(
    small_fs: Path, open_store: OpenStore
) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.disk\.capacity") as refused:
        open_store(disk_config(small_fs / "disk", capacity="4MiB"))
    free, size = disk_slabs.free_bytes(small_fs / "disk")
    reserve = disk_slabs.reserve_bytes(size)  # 5 % of 512 KiB
    assert reserve == 512 * KIB // 20
    message = str(refused.value)
    assert "4194304" in message and f"{free} bytes free" in message and f"{reserve} stay" in message
    assert sorted(p.name for p in (small_fs / "disk").iterdir()) == ["kvtier.lock"]  # no slab
    # what fits beside the reserve starts, and starts again once the filesystem is full: its
    # slabs are its own already
    fits = (free - reserve) // DISK_SLOT_BYTES * DISK_SLOT_BYTES
    config = disk_config(small_fs / "disk", capacity=fits)
    open_store(config).close()
    with open(small_fs / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:
            filler.write(bytes(4 * KIB))
    store = open_store(config)
    assert tier(store, "disk")["faults"]["enospc"] == 0 and tier(store, "disk")["slots"] > 0
    store.check()


def test_room_that_goes_during_the_start_gives_fewer_slots_and_keeps_serving(
    small_fs: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # another process takes the room between the check and the preallocation: here the check
    # is told of a large filesystem. 128 KiB slabs (16 slots): the 512 KiB filesystem holds 3
    # beside the superblock and a shorter fourth (the slab that did not fit is halved until it
    # does), not 32
    monkeypatch.setattr(disk_slabs, "SLAB_TARGET_BYTES", 128 * KIB)
    monkeypatch.setattr(disk_slabs, "free_bytes", lambda path: (1 << 40, 1 << 41))
    config = disk_config(small_fs / "disk", capacity="4MiB")
    store = open_store(config)
    store.check()
    disk = tier(store, "disk")
    assert disk["faults"]["enospc"] >= 1
    assert 48 <= disk["slots"] < 64
    assert disk["capacity_bytes"] == disk["slots"] * DISK_SLOT_BYTES <= 512 * KIB
    slots = disk["slots"]
    slabs = sorted(p.name for p in (small_fs / "disk").glob("slab-*.kvt"))
    assert slabs == [f"slab-{i:05d}.kvt" for i in range(-(-slots // 16))]  # none beyond

    # the space is taken at start: filling the filesystem now costs no later write
    with open(small_fs / "filler", "wb", buffering=0) as filler, pytest.raises(OSError) as full:
        while True:
            filler.write(bytes(4 * KIB))
    assert full.value.errno == errno.ENOSPC

    seqs = [list(range(100 * i, 100 * i + 8)) for i in range((8 + slots + 8) // 2)]
    kvs = fill(store, seqs)  # 8 blocks more than gpu, host and disk hold together
    disk = tier(store, "disk")
    assert (disk["blocks"], disk["free_slots"], disk["evictions"]) == (slots, 0, 8)
    assert disk["faults"]["write_errors"] == disk["faults"]["sync_errors"] == 0
    lookups = [store.lookup(tokens) for tokens in seqs]
    assert (
        lookups == [hit()] * 4 + [hit(disk=8)] * (slots // 2) + [hit(host=8)] * 2 + [hit(gpu=8)] * 2
    )
    assert same(store.load(seqs[4]).kv, kvs[4]) and same(store.load(seqs[-3]).kv, kvs[-3])
    store.check()
    store.close()

    store = open_store(config)
    assert store.recovery["recovered"] == slots
    assert tier(store, "disk")["slots"] == slots
    assert same(store.load(seqs[4]).kv, kvs[4])
    store.check()
    store.close()


# ---- a vanished directory and failing system calls ---------------------------------------


def test_a_vanished_directory_does_not_stop_the_store(
    tmp_path: Path, open_store: OpenStore
) -> None:
    path = tmp_path / "disk"
    config = disk_config(path)
    store = open_store(config)
    kvs = fill(store, SEQS[:6])
    shutil.rmtree(path)
    assert store.lookup(SEQS[0]) == hit(disk=8)
    assert same(store.load(SEQS[0]).kv, kvs[0])  # the open slab outlives its name
    lease = store.prefetch(SEQS[1])
    with pytest.raises(InvariantError, match="no longer the file the tier writes"):
        store.check()  # it serves on, but says that what it writes now is lost at a restart
    assert same(leased_kv(store, lease), kvs[1])
    store.release(lease)
    more = []  # demotes S2..S5 to disk (not `fill`: its checks name the vanished slab)
    for i, tokens in enumerate(SEQS[6:]):
        more.append(kv_for(store, len(tokens), seed=6 + i))
        assert store.store(tokens, more[-1]) == StoreResult(len(tokens), len(tokens), 0)
    assert [store.lookup(tokens) for tokens in SEQS[2:6]] == [hit(disk=8)] * 4
    for tokens, kv in zip(SEQS[2:6], kvs[2:6], strict=True):
        assert same(store.load(tokens).kv, kv)
    assert same(store.load(SEQS[9]).kv, more[-1])
    assert set(tier(store, "disk")["faults"].values()) == {0}
    with pytest.raises(InvariantError, match="no longer the file the tier writes"):
        store.check()
    store.close()

    path.mkdir()
    store = open_store(config)
    assert (store.recovery["recovered"], store.recovery["empty"]) == (0, 128)
    assert store.lookup(SEQS[0]) == hit()
    fill(store, SEQS[:6])
    assert tier(store, "disk")["blocks"] == 4
    store.check()


def _failing(errno_: int) -> Callable[..., Any]:
    def fail(*args: object, **kwargs: object) -> Any:
        raise OSError(errno_, os.strerror(errno_))

    return fail


def test_a_failed_write_or_sync_makes_nothing_visible(
    tmp_path: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(disk_config(tmp_path / "disk"))
    kvs = fill(store, SEQS[:4])
    monkeypatch.setattr(SlabFile, "write", _failing(errno.EIO))
    fill(store, SEQS[4:6], seed=4)  # S0, S1 cannot reach disk: host drops them
    assert store.lookup(SEQS[0]) == store.lookup(SEQS[1]) == hit()
    disk, host = tier(store, "disk"), tier(store, "host")
    assert (disk["blocks"], disk["used_bytes"], disk["free_slots"]) == (0, 0, 128)
    # per sequence: its two host blocks go down as one batch (2 failed writes); a block whose
    # write just failed is dropped, not written again
    assert disk["faults"]["write_errors"] == 4
    assert host["evictions"] == 4
    store.check()

    monkeypatch.undo()
    fill(store, SEQS[6:8], seed=6)  # S2, S3 reach disk
    assert store.lookup(SEQS[2]) == hit(disk=8)
    monkeypatch.setattr(SlabFile, "sync", _failing(errno.EIO))
    longer = [*SEQS[2], *range(50, 58)]
    kv = torch.cat([kvs[2], kv_for(store, 8, seed=77)], dim=2)
    assert store.store(longer, kv) == StoreResult(8, 0, 8)  # written, never durable
    store.check()
    assert store.lookup(longer) == hit(disk=8)
    disk = tier(store, "disk")
    assert (disk["blocks"], disk["faults"]["sync_errors"]) == (4, 1)
    monkeypatch.undo()
    assert same(store.load(longer).kv, kvs[2])
    store.check()


def test_a_read_error_is_a_miss_and_is_counted(
    tmp_path: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(disk_config(tmp_path / "disk"))
    kvs = fill(store, SEQS[:6])
    with monkeypatch.context() as patch:
        patch.setattr(SlabFile, "readv", _failing(errno.EIO))
        assert store.load(SEQS[0]).num_tokens == 0
        store.check()
    assert tier(store, "disk")["faults"]["read_errors"] == 2
    assert store.lookup(SEQS[0]) == hit()
    assert same(store.load(SEQS[1]).kv, kvs[1])
    store.check()
