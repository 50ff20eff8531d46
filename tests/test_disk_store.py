"""KVStore with a real disk tier: demotion gpu -> host -> disk, disk hits, loads and prefetches
from disk, restarts that recover the disk tier, tenants, admission, compression, geometry.

Tiny fp16 layout (conftest "disk-tier stores"): a block is 4 tokens and 4096 bytes, a disk slot
8192 bytes; gpu and host hold 4 blocks each, so storing sequences of 2 blocks A0..A5 in order
leaves A4, A5 on gpu, A2, A3 on host and A0, A1 on disk. Every step is followed by `check()`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    DISK_BLOCK_BYTES,
    DISK_SLOT_BYTES,
    disk_config,
    fill,
    hit,
    kv_for,
    leased_kv,
    same,
    slab_headers,
    tier,
)

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, LeaseError
from kvtier.results import StoreResult
from kvtier.store import KVStore

OpenStore = Callable[[KVTierConfig], KVStore]
MIB = 1 << 20
SEQS = [list(range(100 * i, 100 * i + 8)) for i in range(6)]  # A0..A5: 2 blocks, no sharing


def ramp(store: KVStore, n_tokens: int, start: float = 0.0) -> torch.Tensor:
    """Smooth KV: float16 values rising slowly, which shuffle + lz4 compresses."""
    layout = store.layout
    shape = (layout.num_layers, 2, n_tokens, layout.num_kv_heads, layout.head_dim)
    numel = layout.num_layers * 2 * n_tokens * layout.num_kv_heads * layout.head_dim
    return (start + torch.arange(numel, dtype=torch.float32) / numel).to(torch.float16).view(shape)


def allocated_bytes(directory: Path) -> int:
    """What `du` counts for `directory`: its own blocks and those of the files in it."""
    total = os.stat(directory).st_blocks * 512
    for entry in os.scandir(directory):
        total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


# ---- demotion and status -----------------------------------------------------------------


def test_six_sequences_demote_lru_first_down_to_disk(tmp_path: Path, open_store: OpenStore) -> None:
    store = open_store(disk_config(tmp_path / "disk"))
    fill(store, SEQS)
    expected = [hit(disk=8), hit(disk=8), hit(host=8), hit(host=8), hit(gpu=8), hit(gpu=8)]
    assert [store.lookup(tokens) for tokens in SEQS] == expected
    store.check()
    disk, host, gpu = tier(store, "disk"), tier(store, "host"), tier(store, "gpu")
    assert (disk["slots"], disk["capacity_bytes"]) == (128, 128 * DISK_SLOT_BYTES)
    assert (disk["blocks"], disk["free_slots"]) == (4, 124)
    assert disk["bytes_in"] == 4 * DISK_BLOCK_BYTES
    assert disk["used_bytes"] == 4 * DISK_SLOT_BYTES  # in capacity_bytes' unit: slots in use
    assert (disk["hits"], disk["bytes_out"], disk["evictions"]) == (4, 0, 0)
    assert disk["codec"] == "none"
    assert set(disk["faults"].values()) == {0}
    assert (host["blocks"], host["demotions"], host["evictions"]) == (4, 4, 0)
    assert host["bytes_in"] == 8 * DISK_BLOCK_BYTES and host["bytes_out"] == 4 * DISK_BLOCK_BYTES
    assert (gpu["blocks"], gpu["demotions"], gpu["evictions"]) == (4, 8, 0)
    assert store.status()["index"]["blocks"] == 12


def test_disk_space_is_preallocated_and_stays_within_capacity(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(disk_config(tmp_path / "disk", capacity="1MiB"))
    fill(store, SEQS)
    names = sorted(os.listdir(tmp_path / "disk"))
    assert names == ["kvtier-disk.json", "kvtier.lock", "slab-00000.kvt"]
    assert os.path.getsize(tmp_path / "disk" / "slab-00000.kvt") == MIB
    assert allocated_bytes(tmp_path / "disk") <= MIB + 64 * 1024  # superblock + directory


def test_a_full_disk_drops_its_least_recent_leaves(tmp_path: Path, open_store: OpenStore) -> None:
    store = open_store(disk_config(tmp_path / "disk", capacity=8 * DISK_SLOT_BYTES))
    seqs = [list(range(100 * i, 100 * i + 8)) for i in range(10)]
    fill(store, seqs)
    lookups = [store.lookup(tokens) for tokens in seqs]
    assert lookups == [hit()] * 2 + [hit(disk=8)] * 4 + [hit(host=8)] * 2 + [hit(gpu=8)] * 2
    disk = tier(store, "disk")
    assert (disk["slots"], disk["blocks"], disk["free_slots"]) == (8, 8, 0)
    assert (disk["evictions"], disk["used_bytes"]) == (4, 8 * DISK_SLOT_BYTES)  # full
    assert disk["bytes_in"] == 12 * DISK_BLOCK_BYTES
    store.check()


# ---- load and prefetch -------------------------------------------------------------------


def test_load_and_prefetch_bring_disk_blocks_back_bit_exact(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(disk_config(tmp_path / "disk"))
    kvs = fill(store, SEQS)
    result = store.load([*SEQS[0], 999])
    store.check()
    assert result.num_tokens == 8 and same(result.kv, kvs[0])
    assert store.lookup(SEQS[0]) == hit(disk=8)  # load copies out, it does not promote
    assert tier(store, "disk")["bytes_out"] == 2 * DISK_BLOCK_BYTES
    lease = store.prefetch(SEQS[1])
    store.check()
    assert lease.num_tokens == 8 and len(lease.block_table) == 2
    assert same(leased_kv(store, lease), kvs[1])
    assert store.lookup(SEQS[1]) == hit(gpu=8)
    gpu, disk = tier(store, "gpu"), tier(store, "disk")
    assert (gpu["promotions"], gpu["leased_blocks"]) == (2, 2)
    # A1's disk copy stays; making room on gpu pushed A2 from host to disk
    assert (disk["bytes_out"], disk["blocks"]) == (4 * DISK_BLOCK_BYTES, 6)
    assert store.lookup(SEQS[2]) == hit(disk=8)
    store.release(lease)
    store.check()
    for tokens, kv in zip(SEQS, kvs, strict=True):
        assert same(store.load(tokens).kv, kv)
    store.check()
    assert store.ops["corrupt_dropped"] == 0


def test_a_prefix_split_over_three_tiers_loads_and_prefetches_bit_exact(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(disk_config(tmp_path / "disk"))
    long = list(range(16))
    kv = kv_for(store, 16, seed=42)
    store.store(long, kv)
    fill(store, SEQS[1:4])  # the long sequence's leaves go down first
    assert store.lookup(long) == hit(host=8, disk=8)
    fill(store, SEQS[4:5], seed=10)
    store.lookup(SEQS[4])
    assert store.prefetch(list(range(4))).block_table  # its first block back on gpu
    store.check()
    leases = store.leases()
    assert store.lookup(long) == hit(gpu=4, host=4, disk=8)
    assert same(store.load(long).kv, kv)
    lease = store.prefetch(long)
    store.check()
    assert same(leased_kv(store, lease), kv)
    for held in [*leases, lease]:
        store.release(held)
    store.check()


# ---- restart ---------------------------------------------------------------------------------


def test_a_restart_recovers_exactly_the_disk_blocks(tmp_path: Path, open_store: OpenStore) -> None:
    config = disk_config(tmp_path / "disk")
    store = open_store(config)
    kvs = fill(store, SEQS)
    before = [store.lookup(tokens) for tokens in SEQS]
    store.close()
    store = open_store(config)
    store.check()
    recovery = store.recovery
    assert (recovery["recovered"], recovery["empty"], recovery["slots_scanned"]) == (4, 124, 128)
    for kind in ("corrupt", "foreign", "duplicates", "unknown_namespace", "orphans", "bad_ids"):
        assert recovery[kind] == 0, kind
    assert store.status()["recovery"] == recovery
    assert before[:2] == [hit(disk=8)] * 2
    assert [store.lookup(tokens) for tokens in SEQS] == before[:2] + [hit()] * 4  # volatile
    disk = tier(store, "disk")
    assert (disk["blocks"], disk["used_bytes"], disk["free_slots"]) == (4, 4 * DISK_SLOT_BYTES, 124)
    assert tier(store, "gpu")["blocks"] == tier(store, "host")["blocks"] == 0
    for tokens, kv in zip(SEQS[:2], kvs[:2], strict=True):
        assert same(store.load(tokens).kv, kv)
    store.check()


def test_recovered_slots_are_not_reused_and_a_second_restart_keeps_both(
    tmp_path: Path, open_store: OpenStore
) -> None:
    config = disk_config(tmp_path / "disk")
    store = open_store(config)
    old = fill(store, SEQS)
    store.close()
    store = open_store(config)
    more = [list(range(1000 + 100 * i, 1000 + 100 * i + 8)) for i in range(6)]
    new = fill(store, more, seed=100)
    assert tier(store, "disk")["blocks"] == 8
    store.close()
    store = open_store(config)
    assert store.recovery["recovered"] == 8
    for tokens, kv in zip(SEQS[:2] + more[:2], old[:2] + new[:2], strict=True):
        assert store.lookup(tokens) == hit(disk=8)
        assert same(store.load(tokens).kv, kv)
    store.check()


def test_a_continuation_of_a_disk_only_prefix_is_written_to_disk_and_survives_a_restart(
    tmp_path: Path, open_store: OpenStore
) -> None:
    config = disk_config(tmp_path / "disk")
    store = open_store(config)
    kvs = fill(store, SEQS)
    longer = [*SEQS[0], *range(50, 58)]
    kv = torch.cat([kvs[0], kv_for(store, 8, seed=77)], dim=2)
    assert store.store(longer, kv) == StoreResult(16, 8, 0)
    store.check()
    assert store.lookup(longer) == hit(disk=16)
    assert tier(store, "disk")["blocks"] == 6
    assert same(store.load(longer).kv, kv)
    store.close()
    store = open_store(config)
    assert store.recovery["recovered"] == 6
    assert store.lookup(longer) == hit(disk=16)
    assert same(store.load(longer).kv, kv)
    store.check()


# ---- tenants ---------------------------------------------------------------------------------


def test_a_tenants_disk_copies_are_recovered_for_it_alone(
    tmp_path: Path, open_store: OpenStore
) -> None:
    config = disk_config(tmp_path / "disk", tenants=("a", "b"))
    store = open_store(config)
    kvs = [kv_for(store, 8, seed=i) for i in range(6)]
    for tokens, kv in zip(SEQS, kvs, strict=True):
        store.store(tokens, kv, tenant="a")
        store.check()
    assert store.lookup(SEQS[0], tenant="a") == hit(disk=8)
    assert store.lookup(SEQS[0], tenant="b") == hit()
    store.close()

    store = open_store(config)
    assert (store.recovery["recovered"], store.recovery["unknown_namespace"]) == (4, 0)
    assert store.lookup(SEQS[0], tenant="a") == hit(disk=8)
    assert store.lookup(SEQS[0], tenant="b") == hit()
    assert store.load(SEQS[0], tenant="b").num_tokens == 0
    assert store.prefetch(SEQS[0], tenant="b").num_tokens == 0
    assert same(store.load(SEQS[0], tenant="a").kv, kvs[0])
    store.close()

    store = open_store(disk_config(tmp_path / "disk", tenants=("b",)))
    assert (store.recovery["recovered"], store.recovery["unknown_namespace"]) == (0, 4)
    assert store.lookup(SEQS[0], tenant="b") == hit()
    assert tier(store, "disk")["free_slots"] == 128  # unknown copies are not kept
    store.check()


# ---- admission ---------------------------------------------------------------------------------


def test_disk_admission_drops_blocks_never_looked_up(tmp_path: Path, open_store: OpenStore) -> None:
    store = open_store(disk_config(tmp_path / "disk", admission_hits=2))
    hot, cold = SEQS[0], SEQS[1]
    kvs = fill(store, [hot, cold])
    assert store.lookup(hot) == store.lookup(hot) == hit(gpu=8)
    fill(store, SEQS[2:6], seed=10)  # hot and cold leave gpu, then host
    assert store.lookup(hot) == hit(disk=8)
    assert store.lookup(cold) == hit()
    host, disk = tier(store, "host"), tier(store, "disk")
    assert (host["demotions"], host["evictions"]) == (2, 2)
    assert (disk["blocks"], disk["bytes_in"]) == (2, 2 * DISK_BLOCK_BYTES)
    assert same(store.load(hot).kv, kvs[0])
    store.check()


# ---- compression ------------------------------------------------------------------------------


def test_lz4_round_trips_and_falls_back_to_none_for_random_data(
    tmp_path: Path, open_store: OpenStore
) -> None:
    config = disk_config(tmp_path / "disk", codec="lz4")
    store = open_store(config)
    smooth = ramp(store, 8)
    noisy = kv_for(store, 8, seed=5)
    store.store(SEQS[0], smooth)
    store.store(SEQS[1], noisy)
    fill(store, SEQS[2:6], seed=10)
    assert tier(store, "disk")["codec"] == "lz4"
    assert store.lookup(SEQS[0]) == store.lookup(SEQS[1]) == hit(disk=8)
    assert same(store.load(SEQS[0]).kv, smooth)
    assert same(store.load(SEQS[1]).kv, noisy)
    store.close()

    headers = slab_headers(tmp_path / "disk")
    assert len(headers) == 4
    for block in range(2):
        _, packed = headers[tuple(SEQS[0][4 * block : 4 * block + 4])]
        _, plain = headers[tuple(SEQS[1][4 * block : 4 * block + 4])]
        assert packed.codec == "lz4" and packed.payload_nbytes < DISK_BLOCK_BYTES
        assert plain.codec == "none" and plain.payload_nbytes == DISK_BLOCK_BYTES
        assert packed.raw_nbytes == plain.raw_nbytes == DISK_BLOCK_BYTES

    store = open_store(config)
    assert store.recovery["recovered"] == 4
    assert same(store.load(SEQS[0]).kv, smooth)
    assert same(store.load(SEQS[1]).kv, noisy)
    store.check()


def test_a_tier_written_with_lz4_is_read_by_a_store_without_compression(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(disk_config(tmp_path / "disk", codec="lz4"))
    kvs = [ramp(store, 8, start=float(i)) for i in range(6)]
    for tokens, kv in zip(SEQS, kvs, strict=True):
        store.store(tokens, kv)
    store.close()
    store = open_store(disk_config(tmp_path / "disk", codec="none"))
    assert store.recovery["recovered"] == 4
    assert tier(store, "disk")["codec"] == "none"
    assert same(store.load(SEQS[0]).kv, kvs[0]) and same(store.load(SEQS[1]).kv, kvs[1])
    store.check()


# ---- geometry ---------------------------------------------------------------------------------


def test_a_directory_of_another_geometry_refuses_to_start(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = open_store(disk_config(tmp_path / "disk"))
    fill(store, SEQS)
    store.close()
    with pytest.raises(ConfigError) as caught:
        open_store(disk_config(tmp_path / "disk", block_tokens=8))
    assert caught.value.field == "tiers.disk.path"
    assert str(tmp_path / "disk") in str(caught.value)
    store = open_store(disk_config(tmp_path / "disk"))  # the refused start changed nothing
    assert store.recovery["recovered"] == 4
    store.check()


def test_status_counts_bytes_per_path(open_store: OpenStore, tmp_path: Path) -> None:
    store = open_store(disk_config(tmp_path / "disk"))  # gpu 4, host 4 blocks of 4 KiB
    fill(store, [list(range(100 * i, 100 * i + 8)) for i in range(8)])  # 16 blocks
    store.load(list(range(8)))  # sequence 0 (2 blocks) now lives on disk only
    paths = store.status()["paths"]
    kib4 = DISK_BLOCK_BYTES
    # write_back: 12 blocks left gpu for host, 8 of them left host for disk, 2 came back to load
    assert {path: figures["bytes"] for path, figures in paths.items()} == {
        "gpu->host": 12 * kib4,
        "host->disk": 8 * kib4,
        "disk->host": 2 * kib4,
    }
    assert all(figures["recent_bytes_per_s"] > 0 for figures in paths.values())
    # the disk's reads and writes together: their bytes over the time either ran, which lies
    # between the slower path's rate and the two paths' bytes over the longer one's time
    both = [paths[p] for p in ("host->disk", "disk->host")]
    seconds = [p["bytes"] / p["recent_bytes_per_s"] for p in both]
    disk = store.status()["tiers"]["disk"]["recent_bytes_per_s"]
    slower = min(p["recent_bytes_per_s"] for p in both)
    assert slower * 0.99 <= disk <= sum(p["bytes"] for p in both) / max(seconds) * 1.01
    store.check()


def test_a_lease_id_from_before_a_restart_names_no_lease_after_it(
    open_store: OpenStore, tmp_path: Path
) -> None:
    config = disk_config(tmp_path / "disk")
    store = open_store(config)
    fill(store, SEQS[:2])
    old = store.prefetch(SEQS[0])
    store.persist()
    store.close()
    store = open_store(config)
    new = store.prefetch(SEQS[0])
    assert new.num_tokens == 8 and new.lease_id != old.lease_id
    with pytest.raises(LeaseError):
        store.release(old.lease_id)
    assert store.leases() == [new]
    store.release(new)
    store.check()
