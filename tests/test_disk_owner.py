"""A disk tier's directory and files must be this process's user's (auditor K's finding).

A directory another user owned (`nobody`, mode 0700) was accepted, and that user swapped a slab
for one a store of the same config wrote elsewhere, holding KV of its choosing: after a restart
`load` served it. Pinned here, with real stores, real files and a real `chown` to uid 65534
(skipped where this process cannot chown, i.e. is not root):
- a directory another user owns is refused at start (`ConfigError` naming it, its owner and
  this user's uid), also through a link to it, and nothing is created in it; a store's own
  directory given away is refused by the store and by `kvtier check --fix` (exit status 2), its
  files untouched;
- a slab another user owns (swapped in, or this store's own chowned away, or a stale one past
  the capacity) stops the start whole (`DamagedDiskError` naming it and its owner) and is
  neither read, changed nor deleted: the attacker's KV is never served, and a slab of this
  store's chowned back serves its own KV again; `kvtier check --fix` reports it damaged (exit
  status 1) and leaves it as it was;
- a superblock or lock file another user owns is refused the same way, left as it was.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import disk_config, kv_for, same

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.store import KVStore
from kvtier.tiers.disk.lock import LOCK_FILE
from kvtier.tiers.disk.slabs import SUPERBLOCK, DamagedDiskError

NOBODY = 65534
TOKENS = list(range(1000, 1016))


def give_away(path: Path) -> None:
    """Make uid/gid 65534 (`nobody`) own `path` itself (a link is not followed)."""
    try:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    except PermissionError:
        pytest.skip(reason="making a file another user's takes root")


def take_back(path: Path) -> None:
    os.chown(path, os.geteuid(), os.getegid(), follow_symlinks=False)


def written(path: Path, seed: int) -> tuple[Path, torch.Tensor]:
    """A disk directory at `path` whose store persisted TOKENS' KV of `seed`; that KV."""
    with KVStore(disk_config(path)) as store:
        kv = kv_for(store, len(TOKENS), seed=seed)
        store.store(TOKENS, kv)
        store.persist()
    return path / "slab-00000.kvt", kv


def owned_by_nobody(refused: pytest.ExceptionInfo[ConfigError], path: Path) -> bool:
    message = str(refused.value)
    return (
        f"{path} (" in message
        and "owner uid 65534" in message
        and f"uid {os.geteuid()}" in (message.split("expected", 1)[1])
    )


@pytest.mark.parametrize("through", ["the directory", "a link to it"])
def test_a_disk_directory_another_user_owns_is_refused_and_nothing_is_made_in_it(
    tmp_path: Path, through: str
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    give_away(theirs)
    path = theirs if through == "the directory" else tmp_path / "link"
    if path != theirs:
        path.symlink_to(theirs)
    with pytest.raises(ConfigError) as refused:
        KVStore(disk_config(path))
    assert refused.value.field == "tiers.disk.path" and owned_by_nobody(refused, path)
    assert os.listdir(theirs) == []  # no lock file, superblock or slab: nothing written there


def test_a_store_directory_given_to_another_user_is_refused_by_the_store_and_by_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slab, _ = written(tmp_path / "disk", seed=1)
    give_away(tmp_path / "disk")  # its files stay this user's: the directory alone is refused
    before = slab.read_bytes(), sorted(os.listdir(tmp_path / "disk"))
    with pytest.raises(ConfigError) as refused:
        KVStore(disk_config(tmp_path / "disk"))
    assert owned_by_nobody(refused, tmp_path / "disk")
    assert main(["check", "--fix", str(tmp_path / "disk")]) == 2
    assert "owner uid 65534" in capsys.readouterr().err
    assert (slab.read_bytes(), sorted(os.listdir(tmp_path / "disk"))) == before


def test_a_slab_another_user_swapped_in_is_refused_and_its_kv_never_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slab, _ = written(tmp_path / "disk", seed=1)
    their_slab, _ = written(tmp_path / "theirs", seed=666)
    shutil.copyfile(their_slab, tmp_path / "disk" / "slab.new")  # as its owner would: cp, mv
    give_away(tmp_path / "disk" / "slab.new")
    os.replace(tmp_path / "disk" / "slab.new", slab)
    before = slab.read_bytes(), slab.stat()
    with pytest.raises(DamagedDiskError) as refused:
        KVStore(disk_config(tmp_path / "disk"))
    assert owned_by_nobody(refused, slab)
    assert main(["check", "--fix", str(tmp_path / "disk")]) == 1
    out = capsys.readouterr().out
    assert "damaged" in out and str(slab) in out and "owner uid 65534" in out
    after = slab.read_bytes(), slab.stat()
    assert after[0] == before[0] and after[1].st_uid == NOBODY  # neither changed nor deleted
    assert after[1].st_mode == before[1].st_mode and after[1].st_mtime_ns == before[1].st_mtime_ns
    slab.unlink()  # what the refusal says to do with a slab this store did not write
    with KVStore(disk_config(tmp_path / "disk")) as store:
        assert store.lookup(TOKENS).num_tokens == 0


def test_a_slab_of_this_store_chowned_away_stops_the_start_and_serves_again_once_chowned_back(
    tmp_path: Path,
) -> None:
    slab, kv = written(tmp_path / "disk", seed=1)
    give_away(slab)
    with pytest.raises(DamagedDiskError) as refused:
        KVStore(disk_config(tmp_path / "disk"))
    assert owned_by_nobody(refused, slab)
    take_back(slab)
    with KVStore(disk_config(tmp_path / "disk")) as store:
        loaded = store.load(TOKENS)
        assert loaded.num_tokens == len(TOKENS) and same(loaded.kv.cpu(), kv)


def test_a_stale_slab_past_the_capacity_another_user_owns_is_refused_never_deleted(
    tmp_path: Path,
) -> None:
    slab, _ = written(tmp_path / "disk", seed=1)
    stale = tmp_path / "disk" / "slab-00001.kvt"  # past the capacity: the sweep deletes its own
    shutil.copyfile(slab, stale)
    give_away(stale)
    with pytest.raises(DamagedDiskError) as refused:
        KVStore(disk_config(tmp_path / "disk"))
    assert owned_by_nobody(refused, stale) and refused.value.field == "tiers.disk.path"
    assert stale.read_bytes() == slab.read_bytes() and stale.stat().st_uid == NOBODY


@pytest.mark.parametrize("name", [SUPERBLOCK, LOCK_FILE])
def test_a_superblock_or_lock_file_another_user_owns_is_refused_and_left_as_it_was(
    tmp_path: Path, name: str
) -> None:
    written(tmp_path / "disk", seed=1)
    other = tmp_path / "disk" / name
    other.chmod(0o644)
    give_away(other)
    before = other.read_bytes()
    with pytest.raises(ConfigError) as refused:
        KVStore(disk_config(tmp_path / "disk"))
    assert owned_by_nobody(refused, other)
    after = other.stat()
    assert other.read_bytes() == before and after.st_uid == NOBODY
    assert after.st_mode & 0o777 == 0o644  # not made 0600 either: another user's file
