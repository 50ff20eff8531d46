"""The disk tier after a second crash / hostile-disk audit: every case here once served stale KV,
ended a call with an `AssertionError`, leaked slots, wrote through a link or left tenants' KV
readable by other users.

Real stores on real directories (the tiny fp16 layout of conftest's "disk-tier stores": 8192-byte
slots, all in `slab-00000.kvt` at these capacities), `kvtier check` run in this process.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import DISK_SLOT_BYTES, disk_config, kv_for, same

from kvtier import parse_config
from kvtier.blocks import KVLayout
from kvtier.cli import main
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, StorageError
from kvtier.store import KVStore
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.tiers.disk import slabs as disk_slabs
from kvtier.tiers.disk.io import ALIGN, SlabFile, aligned_buffer, probe_direct
from kvtier.tiers.disk.lock import LOCK_FILE
from kvtier.tiers.disk.slabs import SUPERBLOCK
from kvtier.tiers.disk.views import byte_views

SLAB = "slab-00000.kvt"
SEQS = 20  # sequences of 2 blocks: 40 copies, slots 0..39 of a fresh tier


def seq(s: int) -> list[int]:
    return [1000 * s + j for j in range(8)]


def filled(path: Path, capacity: str = "1MiB") -> KVTierConfig:
    """A directory holding the 40 blocks of `SEQS` sequences (KV of seed s), persisted."""
    config = disk_config(path, capacity=capacity)
    with KVStore(config) as store:
        for s in range(SEQS):
            store.store(seq(s), kv_for(store, 8, seed=s))
        store.persist()
        assert store.status()["index"]["blocks"] == 2 * SEQS  # persist drops nothing
        assert store.lookup(seq(SEQS - 1)).num_tokens == 8
    return config


def disk_hits(store: KVStore) -> int:
    return sum(store.lookup(seq(s)).num_tokens for s in range(SEQS))


# ---- 1. a capacity that shrank cuts the copies past it --------------------------------------


@pytest.mark.parametrize("forget", ["clear", "reset"])
@pytest.mark.parametrize("per_slab", [None, 16])  # None: one slab; 16: slab 1 cut, 2.. deleted
def test_a_clear_after_a_capacity_shrink_stays_cleared_when_the_capacity_grows_back(
    tmp_path: Path,
    open_store: Callable[[KVTierConfig], KVStore],
    monkeypatch: pytest.MonkeyPatch,
    forget: str,
    per_slab: int | None,
) -> None:
    if per_slab is not None:
        monkeypatch.setattr(disk_slabs, "SLAB_TARGET_BYTES", per_slab * DISK_SLOT_BYTES)
    path = tmp_path / "disk"
    big = filled(path)
    keep = 8 if per_slab is None else per_slab + 4
    store = open_store(disk_config(path, capacity=keep * DISK_SLOT_BYTES))
    # cut at start, before the store serves: du and the files within the new capacity
    sizes = [p.stat().st_size for p in sorted(path.glob("slab-*.kvt"))]
    held = sum(p.stat().st_blocks * 512 for p in path.glob("slab-*.kvt"))
    if forget == "clear":
        store.clear()
    else:
        store.reset("default")
    assert disk_hits(store) == 0
    store.close()
    grown = open_store(big)
    recovered = grown.status()["recovery"]["recovered"]
    assert (recovered, disk_hits(grown)) == (0, 0)  # the old code served the cleared KV here
    grown.check()
    per = per_slab or keep
    assert sizes == [per * DISK_SLOT_BYTES] * (keep // per) + [keep % per * DISK_SLOT_BYTES] * (
        keep % per > 0
    )
    assert held <= keep * DISK_SLOT_BYTES


def test_a_slab_longer_than_the_capacity_is_cut_at_start(
    tmp_path: Path, open_store: Callable[[KVTierConfig], KVStore]
) -> None:
    path = tmp_path / "disk"
    config = filled(path, capacity="256KiB")
    slab = path / SLAB
    with open(slab, "ab") as tail:
        tail.write(os.urandom(3 * DISK_SLOT_BYTES))  # appended slots of random bytes
    store = open_store(config)
    assert slab.stat().st_size == 256 * 1024
    assert store.status()["recovery"]["corrupt"] == 0
    store.close()
    assert main(["check", str(path)]) == 0  # nothing past the capacity left to disagree on


# ---- 2. unaligned blocks of a quantized host tier over a plain disk tier --------------------


def test_byte_views_of_rows_off_the_sector_grid_are_not_aligned() -> None:
    memory = aligned_buffer(4 * ALIGN)
    rows = torch.frombuffer(memory, dtype=torch.uint8)[: 4 * 2048].view(4, 2048)
    assert rows.data_ptr() % ALIGN == 0  # row 0 at an aligned address, 2048 bytes long
    assert byte_views(rows).aligned == [False] * 4
    whole = torch.frombuffer(memory, dtype=torch.uint8).view(4, ALIGN)
    assert byte_views(whole).aligned == [True] * 4


def test_a_batch_of_2_kib_rows_at_an_aligned_address_is_written_and_read_back(
    tmp_path: Path,
) -> None:
    # what a quantized host pool's decode hands the disk tier, placed where the allocator
    # sometimes puts it: the old code wrote row 0 in place and O_DIRECT's check raised
    # AssertionError out of write_blocks (a 500 from the sidecar's persist)
    layout = KVLayout("tiny", 2, 2, 64, "float16", 2)  # 2048-byte blocks
    disk = DiskTier(layout, tmp_path / "disk", 16 * DISK_SLOT_BYTES)
    try:
        memory = aligned_buffer(4 * 2048)
        rows = torch.frombuffer(memory, dtype=torch.float16).view(4, *layout.block_shape)
        rows.copy_(torch.randn(rows.shape, generator=torch.Generator().manual_seed(3)))
        slots = disk.allocate(4)
        metas = [meta(i) for i in range(4)]
        assert disk.write_blocks(slots, rows, metas) == [True] * 4
        back, good = disk.read_blocks(slots, [m.block_id for m in metas])
        assert good == [True] * 4
        assert all(same(back[i], rows[i]) for i in range(4))
        assert disk.faults["write_errors"] == 0
    finally:
        disk.close()


def meta(i: int) -> BlockMeta:
    return BlockMeta(i.to_bytes(16, "little"), b"\0" * 16, b"\1" * 16, "t", b"\0" * 16)


def test_an_unaligned_o_direct_write_is_a_storage_error_not_an_assertion(tmp_path: Path) -> None:
    if not probe_direct(tmp_path):
        pytest.skip(reason=f"{tmp_path} refuses O_DIRECT")
    with SlabFile(tmp_path / "slab", 2 * ALIGN, direct=True, create=True) as slab:
        with pytest.raises(StorageError) as refused:
            slab.write(0, [aligned_buffer(ALIGN), aligned_buffer(2048)[:2048]])
        assert "[4096, 2048]" in str(refused.value) and "multiples of 4096" in str(refused.value)
        with pytest.raises(StorageError):
            slab.read_into(2048, aligned_buffer(ALIGN))


def quantized_host_config(path: Path, host_blocks: int) -> KVTierConfig:
    """int8 host over a plain disk tier, 2048-byte blocks (the audit's layout)."""
    return parse_config(
        {
            "model": {
                "name": "c",
                "num_layers": 2,
                "num_kv_heads": 1,
                "head_dim": 16,
                "dtype": "float16",
            },
            "block_tokens": 16,
            "tiers": {
                "gpu": {"capacity": "32KiB", "device": "cpu"},
                "host": {"capacity": host_blocks * 2048, "codec": "int8", "pinned": False},
                "disk": {"capacity": "4MiB", "path": os.fspath(path)},
            },
            "policy": {"write": "write_back", "disk_admission_hits": 0},
            "mover": {"background": False},
        }
    )


@pytest.mark.parametrize("host_blocks", [24, 32, 40, 48])
def test_a_quantized_host_over_a_plain_disk_stores_and_persists_without_a_leak(
    tmp_path: Path, open_store: Callable[[KVTierConfig], KVStore], host_blocks: int
) -> None:
    # the decoded batches land wherever the allocator puts them: on the old code one of these
    # cases or more raised AssertionError from the disk writer in 5 runs of 6, and a failed
    # write's disk slots stayed allocated (check(): disk slots in use > resident)
    store = open_store(quantized_host_config(tmp_path / "disk", host_blocks))
    stored = []
    for i in range(120):
        tokens = [i * 1000 + j for j in range(16 * (1 + i * 7 % 9))]
        stored.append(tokens)
        store.store(tokens, torch.randn(2, 2, len(tokens), 1, 16).half())
        if i % 13 == 12:
            store.persist()
            store.check()
    store.persist()
    store.check()
    disk = store.status()["tiers"]["disk"]
    assert disk["faults"]["write_errors"] == 0, disk
    assert sum(store.lookup(tokens).disk_tokens for tokens in stored) > 0


# ---- 3. a hard-linked lock file -------------------------------------------------------------


def test_a_hard_linked_lock_file_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    config = filled(path)
    victim = tmp_path / "precious.txt"
    victim.write_text("important user data\n")
    victim.chmod(0o644)
    (path / LOCK_FILE).unlink()
    os.link(victim, path / LOCK_FILE)
    with pytest.raises(ConfigError) as refused:
        KVStore(config)
    assert "one link, found 2" in str(refused.value) and LOCK_FILE in str(refused.value)
    assert main(["check", str(path)]) == 2  # refused, as a config error is
    assert victim.read_text() == "important user data\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644


# ---- 4. loose modes of an existing directory and its files ----------------------------------


def test_an_existing_directory_and_its_files_are_made_private(
    tmp_path: Path, open_store: Callable[[KVTierConfig], KVStore]
) -> None:
    path = tmp_path / "disk"
    config = filled(path)
    path.chmod(0o755)  # restored by another tool
    for name in (SLAB, SUPERBLOCK, LOCK_FILE):
        (path / name).chmod(0o644)
    store = open_store(config)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in (SLAB, SUPERBLOCK, LOCK_FILE):
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o600, name
    loaded = store.load(seq(SEQS - 1))
    assert loaded.num_tokens == 8 and same(loaded.kv, kv_for(store, 8, seed=SEQS - 1))


def test_kvtier_check_makes_the_directory_and_slabs_private(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    filled(path)
    path.chmod(0o750)
    (path / SLAB).chmod(0o640)
    assert main(["check", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((path / SLAB).stat().st_mode) == 0o600


# ---- 5. `kvtier check` and recovery agree on a slab cut mid-slot ----------------------------


def test_check_and_recovery_agree_on_a_slab_truncated_mid_slot(
    tmp_path: Path,
    open_store: Callable[[KVTierConfig], KVStore],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "disk"
    config = filled(path)
    os.truncate(path / SLAB, 7 * DISK_SLOT_BYTES + 100)  # slot 7's header torn
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "8 slots" in out and "corrupt headers          1" in out, out
    store = open_store(config)
    assert store.status()["recovery"]["corrupt"] == 1


def test_a_hard_linked_superblock_is_refused_and_its_other_name_untouched(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    config = filled(path)
    other = tmp_path / "geometry-backup.json"
    os.link(path / SUPERBLOCK, other)
    other.chmod(0o644)
    with pytest.raises(ConfigError) as refused:
        KVStore(config)
    assert "one link, found 2" in str(refused.value) and SUPERBLOCK in str(refused.value)
    assert stat.S_IMODE(other.stat().st_mode) == 0o644
