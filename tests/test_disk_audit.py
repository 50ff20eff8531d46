"""What the disk tier reads back from a directory that was tampered with, restored from another
copy, or left by a crash: every case here once crashed, hung or served what it should not.

Each test writes real files into a real tier directory (the tiny fp16 layout of conftest's
"disk-tier stores": 4096-byte blocks, 8192-byte slots, 128 of them in `slab-00000.kvt`), then
opens a `KVStore` on it or runs `kvtier check` in this process. Headers are planted with valid
checksums (`encode_header`): xxh3 is no secret, so a copy that passes its checksums is still
only as good as the fields it claims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from conftest import (
    DISK_BLOCK_BYTES,
    DISK_HEADER_BYTES,
    DISK_SLOT_BYTES,
    disk_config,
    hit,
    kv_for,
    same,
    slab_headers,
)

from kvtier.cli import main
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.store import KVStore
from kvtier.tiers.disk.codec import CorruptPayload, Lz4Codec
from kvtier.tiers.disk.format import BlockHeader, checksum, encode_header
from kvtier.tiers.disk.io import SlabFile
from kvtier.tiers.disk.slabs import SUPERBLOCK, DamagedDiskError

TOKENS = list(range(8))  # two blocks: A = tokens 0..3, B = tokens 4..7


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail with `TimeoutError` if the block runs longer than `seconds` (SIGALRM, main thread):
    a walk that loops without end is stopped before it eats the machine's memory."""

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def persisted(path: Path, tenants: tuple[str, ...] = ("default",)) -> KVTierConfig:
    """A directory holding the two blocks of `TOKENS` (tenant "default", KV of seed 0)."""
    config = disk_config(path, tenants=tenants)
    with KVStore(config) as store:
        store.store(TOKENS, kv_for(store, len(TOKENS)))
        assert store.persist() == 2
    return config


def genuine(path: Path, block: int) -> tuple[int, BlockHeader]:
    """The slot and header of block `block` (0: A, 1: B) of `TOKENS`."""
    return slab_headers(path)[tuple(TOKENS[4 * block : 4 * block + 4])]


def slot_image(path: Path, slot: int) -> bytes:
    with open(path / "slab-00000.kvt", "rb") as slab:
        slab.seek(slot * DISK_SLOT_BYTES)
        return slab.read(DISK_SLOT_BYTES)


def put_slot(path: Path, slot: int, image: bytes) -> None:
    with open(path / "slab-00000.kvt", "r+b") as slab:
        slab.seek(slot * DISK_SLOT_BYTES)
        slab.write(image)


def plant(path: Path, slot: int, header: BlockHeader, payload: bytes) -> None:
    """Write a copy whose header and payload checksums both pass into `slot`."""
    padded = payload + bytes(DISK_SLOT_BYTES - DISK_HEADER_BYTES - len(payload))
    put_slot(path, slot, encode_header(header, DISK_HEADER_BYTES) + padded)


def check(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, int]]:
    """`kvtier check PATH [args]` in this process: its status and its counts by name."""
    capsys.readouterr()
    status = main(["check", str(path), *args])
    lines = capsys.readouterr().out.splitlines()
    counts = {}
    for line in lines[1:]:
        *words, number = line.split()
        if number.isdigit():
            counts[" ".join(words)] = int(number)
    head = lines[0].split(": ", 1)[1]  # "<n> slots: <v> valid, <e> empty"
    counts["valid"] = int(head.split(": ")[1].split()[0])
    return status, counts


# ---- sizes read off a disk -------------------------------------------------------------------


def test_an_lz4_copy_claiming_a_huge_raw_size_is_corrupt_and_never_decoded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier check` decoded a copy at the raw size its header claims: 2**40 bytes crashed it
    with OverflowError (a claim of 1 GiB would have allocated 1 GiB)."""
    path = tmp_path / "disk"
    persisted(path)
    _, a = genuine(path, 0)
    payload = bytes(100)
    for slot, raw in ((40, 2**40), (41, 2**31), (42, 2 * DISK_BLOCK_BYTES)):
        header = dataclasses.replace(
            a,
            block_id=struct.pack("<QQ", slot, 0),
            codec="lz4",
            raw_nbytes=raw,
            payload_nbytes=len(payload),
            payload_checksum=checksum(payload),
        )
        plant(path, slot, header, payload)
    status, counts = check(path, capsys)
    assert status == 1
    assert (counts["corrupt payloads"], counts["valid"], counts["corrupt headers"]) == (3, 2, 0)
    with pytest.raises(CorruptPayload, match="lz4 payload does not decode"):
        Lz4Codec().decode(payload, 2**40, 2)  # the codec itself never lets OverflowError out


def test_a_copy_numbered_past_int63_is_corrupt_and_the_tier_keeps_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """New copies are numbered above the newest found: one planted at 2**64-1 left no number
    for any other, and every later write to the disk tier failed, silently."""
    path = tmp_path / "disk"
    config = persisted(path)
    slot, a = genuine(path, 0)
    last = encode_header(dataclasses.replace(a, seq=2**64 - 1), DISK_HEADER_BYTES)
    put_slot(path, 60, last + slot_image(path, slot)[DISK_HEADER_BYTES:])  # A, numbered last
    more = list(range(500, 508))
    with KVStore(config) as store:
        assert (store.recovery["recovered"], store.recovery["corrupt"]) == (2, 1)
        kv = kv_for(store, 8, seed=5)
        store.store(more, kv)
        assert store.persist() == 2  # 0 before: every header write refused the next number
        store.check()
    with KVStore(config) as store:
        assert store.recovery["recovered"] == 4
        assert store.lookup(more) == hit(disk=8)
        assert same(store.load(more).kv, kv)
        assert same(store.load(TOKENS).kv, kv_for(store, 8))
        store.check()
    status, counts = check(path, capsys)  # the store's scan and the check agree
    assert status == 1 and (counts["corrupt headers"], counts["duplicates"]) == (1, 0)
    assert counts["valid"] == 4


# ---- parent chains ---------------------------------------------------------------------------


def two_namespaces(path: Path) -> tuple[KVTierConfig, bytes, BlockHeader]:
    """A persisted tier at `path` for tenants default and b: its config, b's seed, and the
    header of slot 0's genuine copy (default's)."""
    config = persisted(path, tenants=("default", "b"))
    with KVStore(config) as store:
        seed_b = store.namespaces.seeds["b"]
    _, header = genuine(path, 0)
    return config, seed_b, header


def test_recovery_refuses_a_copy_whose_id_is_its_namespace_seed(tmp_path: Path) -> None:
    """A copy whose id and parent are both the seed of an otherwise empty namespace made the
    restore walk follow it as its own child forever (a list growing without end)."""
    path = tmp_path / "disk"
    config, seed_b, a = two_namespaces(path)
    payload = bytes(DISK_BLOCK_BYTES)
    looped = dataclasses.replace(
        a, block_id=seed_b, parent_id=seed_b, namespace=seed_b, tenant="b", seq=99,
        payload_checksum=checksum(payload),
    )  # fmt: skip
    plant(path, 70, looped, payload)
    with deadline(5), KVStore(config) as store:
        assert (store.recovery["recovered"], store.recovery["bad_ids"]) == (2, 1)
        assert store.lookup(TOKENS) == hit(disk=8)
        store.check()
    with KVStore(config) as store:  # retired at the first start: gone for good
        assert (store.recovery["bad_ids"], store.recovery["empty"]) == (0, 126)


@pytest.mark.parametrize("shape", ["its own seed", "another namespace's seed"])
def test_check_ends_on_a_parent_chain_that_runs_in_a_cycle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    """`kvtier check` walked children by parent id alone, without a visited set: a copy whose
    id is a namespace seed led the walk back to the seed's children, forever. A child hangs
    only from a parent of its own namespace, as recovery has it."""
    path = tmp_path / "disk"
    config, seed_b, a = two_namespaces(path)
    payload = bytes(DISK_BLOCK_BYTES)
    planted = dataclasses.replace(
        a, block_id=a.namespace, parent_id=a.namespace, seq=99, payload_checksum=checksum(payload)
    )  # a child of the seed whose id is the seed
    if shape == "another namespace's seed":  # in b, a child of A whose id is default's seed
        planted = dataclasses.replace(planted, parent_id=a.block_id, namespace=seed_b, tenant="b")
    plant(path, 70, planted, payload)
    with deadline(5):
        status, counts = check(path, capsys)
    assert status == 1 and (counts["valid"], counts["orphans"]) == (2, 1)
    with deadline(5), KVStore(config) as store:
        assert store.recovery["recovered"] == 2
        assert store.recovery["bad_ids"] + store.recovery["orphans"] == 1
        store.check()


# ---- copies the store dropped must stay dropped ----------------------------------------------


def test_a_duplicate_copy_does_not_outlive_a_durable_clear(tmp_path: Path) -> None:
    """Two copies of each block (a restore copied the slots, or a crash lost a retire): the
    older one was left on disk as a free slot, so after a durable `clear` the blocks came back
    at the next start."""
    path = tmp_path / "disk"
    config = persisted(path)
    for block in (0, 1):
        slot, _ = genuine(path, block)
        put_slot(path, 90 + block, slot_image(path, slot))
    with KVStore(config) as store:
        assert (store.recovery["recovered"], store.recovery["duplicates"]) == (2, 2)
        store.check()
        assert store.clear() == 2
        assert store.lookup(TOKENS) == hit()
    with KVStore(config) as store:
        assert (store.recovery["recovered"], store.recovery["empty"]) == (0, 128)
        assert store.lookup(TOKENS) == hit()


def test_an_orphan_does_not_come_back_when_its_parent_is_stored_again(tmp_path: Path) -> None:
    """Block A's copy was retired but B's was not (a crash lost B's retire): B is an orphan.
    Left on disk, it came back at a later start as soon as A was stored again, although the
    store had dropped it and a clear had come and gone."""
    path = tmp_path / "disk"
    config = persisted(path)
    slot_a, _ = genuine(path, 0)
    put_slot(path, slot_a, bytes(DISK_HEADER_BYTES))  # retired, as `free` does
    with KVStore(config) as store:
        assert (store.recovery["recovered"], store.recovery["orphans"]) == (0, 1)
        assert store.clear() == 0
        store.store(TOKENS[:4], kv_for(store, 8)[:, :, :4])
        assert store.persist() == 1
        store.check()
    with KVStore(config) as store:
        assert (store.recovery["recovered"], store.recovery["orphans"]) == (1, 0)
        assert store.lookup(TOKENS) == hit(disk=4)
        store.check()


# ---- what the directory holds besides its slabs -----------------------------------------------


def test_a_stray_copy_of_a_slab_is_never_read_retired_or_mistaken_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A copy an operator left beside the slab sorted before it ("slab-00000 (copy).kvt" <
    "slab-00000.kvt"): the store's sweep of stale slabs then deleted the real slab (everything
    was lost at the next start), and `kvtier check --fix` read the copy as slab 0 and retired
    the real copies as its duplicates."""
    path = tmp_path / "disk"
    config = persisted(path)
    stray = path / "slab-00000 (copy).kvt"
    shutil.copy(path / "slab-00000.kvt", stray)
    (path / "slab-1.kvt").write_bytes(b"not a slab")
    kept = stray.read_bytes()
    status, counts = check(path, capsys, "--fix")
    assert status == 0 and (counts["valid"], counts["duplicates"], counts["retired"]) == (2, 0, 0)
    for _ in range(2):
        with KVStore(config) as store:
            assert store.recovery["recovered"] == 2
            assert same(store.load(TOKENS).kv, kv_for(store, 8))
            store.check()
        assert (path / "slab-00000.kvt").exists()
    assert stray.read_bytes() == kept and (path / "slab-1.kvt").read_bytes() == b"not a slab"


@pytest.mark.parametrize("dtype", [[], {}, ["float16"]])
def test_a_superblock_quant_entry_of_the_wrong_type_is_named_not_a_type_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: object
) -> None:
    """`quant.dtype` was looked up in a dict as it came: a JSON list or object raised
    TypeError (unhashable) out of the store's start and out of `kvtier check`."""
    path = tmp_path / "disk"
    config = persisted(path)
    superblock = path / SUPERBLOCK
    geometry = json.loads(superblock.read_text())
    geometry["quant"] = {"codec": "fp8", "block_shape": [2, 2, 4, 2, 64], "dtype": dtype}
    superblock.write_text(json.dumps(geometry))
    capsys.readouterr()
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert str(superblock) in out and "quant is" in out
    with pytest.raises(DamagedDiskError) as refused:
        KVStore(config)
    assert str(superblock) in str(refused.value) and "quant is" in str(refused.value)


@contextlib.contextmanager
def unwritable(slab: Path) -> Iterator[None]:
    """`slab` made a file this process cannot open read-write (mode 0400; as root, the
    immutable attribute); skips where neither is possible."""
    if os.geteuid() != 0:
        slab.chmod(0o400)
        try:
            yield
        finally:
            slab.chmod(0o600)
        return
    try:
        done = subprocess.run(["chattr", "+i", str(slab)], capture_output=True, timeout=30)
    except OSError as exc:
        pytest.skip(reason=f"cannot run chattr: {exc}")
    if done.returncode != 0:
        pytest.skip(reason=f"chattr +i refused here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(slab)], check=True, timeout=30)


@pytest.mark.parametrize("cut", [False, True])
def test_a_slab_the_store_cannot_open_read_write_is_a_damaged_disk_error(
    tmp_path: Path, cut: bool
) -> None:
    """A slab restored read-only (from a backup, by an operator) made the start raise a bare
    PermissionError; cut short too, its failed regrowth was counted as a full disk first."""
    path = tmp_path / "disk"
    config = persisted(path)
    slab = path / "slab-00000.kvt"
    if cut:
        os.truncate(slab, 10 * DISK_SLOT_BYTES)
    with unwritable(slab), pytest.raises(DamagedDiskError) as refused:
        KVStore(config)
    assert str(slab) in str(refused.value) and "read-write" in str(refused.value)
    assert refused.value.field == "tiers.disk.path"
    with KVStore(config) as store:  # the refusal let the lock go; writable again, it serves
        assert store.lookup(TOKENS) == hit(disk=8)


def test_a_slab_file_is_refused_when_what_opens_is_not_a_regular_file(tmp_path: Path) -> None:
    """A FIFO put where a slab was checked to be a file was opened and used as a slab of 0
    bytes; `SlabFile` now checks the descriptor it opened."""
    fifo = tmp_path / "slab-00000.kvt"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(OSError, match="not a regular file"):
        SlabFile(fifo, 0, direct=False, create=False)


def test_a_geometry_other_than_the_configs_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A valid superblock of another geometry (a directory restored from another config):
    a `ConfigError` naming both, and nothing in the directory changes."""
    path = tmp_path / "disk"
    persisted(path)
    before = {name: (path / name).read_bytes() for name in (SUPERBLOCK, "slab-00000.kvt")}
    other = disk_config(path, block_tokens=8)
    with pytest.raises(ConfigError, match="a directory of this layout and geometry") as refused:
        KVStore(other)
    assert refused.value.field == "tiers.disk.path"
    assert {name: (path / name).read_bytes() for name in before} == before


def test_a_slab_hard_linked_elsewhere_is_refused_and_its_other_name_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A backup made (or restored) with hard links shares the slab's bytes: the store opened it
    as its own and every write and retire changed the backup too."""
    path = tmp_path / "disk"
    config = persisted(path)
    slab = path / "slab-00000.kvt"
    backup = tmp_path / "backup.kvt"
    os.link(slab, backup)
    kept = backup.read_bytes()
    # before: opened, and the writes below reached `backup`
    with pytest.raises(DamagedDiskError) as refused, KVStore(config) as store:
        store.clear()
        store.store(list(range(600, 608)), kv_for(store, 8, seed=6))
        store.persist()
    assert str(slab) in str(refused.value) and "one link, found 2" in str(refused.value)
    capsys.readouterr()
    assert main(["check", str(path), "--fix"]) == 1
    assert str(slab) in capsys.readouterr().out
    assert backup.read_bytes() == kept
