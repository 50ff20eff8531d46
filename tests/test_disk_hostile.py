"""The disk tier under hostile conditions (issue 11, point 9): a second server on one directory,
a damaged superblock or slab path, a disk that refuses writes under an idle server, and a clear
while it does. Real `kvtier serve` processes (`service_server.py`), real files, a real tmpfs
filled up, a real SIGKILL, and a real refusal of writes by the kernel (RLIMIT_FSIZE set on the
server's process: every write to a file fails with EFBIG; a tmpfs cannot be remounted read-only
under open files, and a full one still takes writes into preallocated pages).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import disk_config, kv_for, mounted_tmpfs, same
from refusals import unready_detail
from service_server import ADMIN_KEY, Server, kv_of, running, start, tokens_of, write_config

from kvtier.cli import main
from kvtier.client import Client
from kvtier.errors import ConfigError
from kvtier.results import LookupResult
from kvtier.store import KVStore
from kvtier.tiers.disk.slab_set import MAX_S, WriteBackoff
from kvtier.tiers.disk.slabs import SUPERBLOCK

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def status(server: Server) -> dict[str, Any]:
    response = server.get("/v1/status", headers=ADMIN)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as stat_file:
        fields = stat_file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- one server per directory ---------------------------------------------------------------


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_second_server_on_one_disk_directory_is_refused_until_the_first_is_killed(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, disk="256KiB")
    second = write_config(tmp_path, disk="256KiB", name="second.yaml")  # the same directory
    tokens, kv = tokens_of(0, 32), kv_of(32, seed=1)
    first = start(config)
    try:
        with Client(first.url, shared_memory=False) as client:
            client.store(tokens, kv)
        first.admin("/v1/admin/persist")
        detail = unready_detail(second)
        assert f"pid {first.process.pid}" in detail and str(tmp_path / "disk") in detail
        assert first.get("/readyz").status_code == 200  # the first one is undisturbed
    finally:
        first.process.kill()  # SIGKILL: the kernel drops its lock
        first.process.wait()
    with running(second) as server, Client(server.url, shared_memory=False) as client:
        assert client.lookup(tokens) == LookupResult(32, 0, 0, 32)
        assert same(client.load(tokens).kv, kv)


# ---- a damaged superblock or slab path ----------------------------------------------------------


def _edit(key: str, value: object) -> Callable[[Path], None]:
    def damage(superblock: Path) -> None:
        geometry = json.loads(superblock.read_text())
        geometry[key] = value
        superblock.write_text(json.dumps(geometry))

    return damage


def _replace(data: bytes) -> Callable[[Path], None]:
    def damage(superblock: Path) -> None:
        superblock.write_bytes(data)

    return damage


def _truncate(superblock: Path) -> None:
    superblock.write_bytes(superblock.read_bytes()[:20])


def _drop_layout(superblock: Path) -> None:
    geometry = json.loads(superblock.read_text())
    del geometry["layout"]
    superblock.write_text(json.dumps(geometry))


def _directory(superblock: Path) -> None:
    superblock.unlink()
    superblock.mkdir()


def _link(superblock: Path) -> None:
    kept = superblock.with_name("kept.json")
    superblock.rename(kept)
    superblock.symlink_to(kept)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "not json": (_replace(b"{not json"), "not JSON"),
    "empty": (_replace(b""), "not JSON"),
    "binary": (_replace(bytes(range(256)) * 4), "not JSON"),
    "truncated": (_truncate, "not JSON"),
    "nested deep": (_replace(b"[" * 4000), "not JSON"),
    "not an object": (_replace(b"[1, 2]"), "found no object"),
    "a key missing": (_drop_layout, "found keys"),
    "a string for a number": (_edit("slot_bytes", "8192"), "slot_bytes is '8192'"),
    "a float": (_edit("itemsize", 2.0), "itemsize is 2.0"),
    "a bool": (_edit("format", True), "format is True"),
    "a huge number": (_edit("slots_per_slab", 10**30), "slots_per_slab is 1000000"),
    "a negative number": (_edit("header_region", -4096), "header_region is -4096"),
    "a region past the slot": (_edit("header_region", 1 << 20), "not less than slot_bytes"),
    "a bad layout": (_edit("layout", "zz" * 16), "layout is 'zzzz"),
    "too long": (_replace(b"1" + b"0" * 5000), "at most 4096 bytes"),
    "a directory": (_directory, "found a directory"),
    "a link": (_link, "found a symbolic link"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_superblock_is_named_by_check_and_refused_by_the_store(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "disk"
    config = disk_config(path)
    with KVStore(config) as store:
        store.store(list(range(8)), kv_for(store, 8))
        store.persist()
    damage, said = DAMAGE[kind]
    superblock = path / SUPERBLOCK
    damage(superblock)
    slab = (path / "slab-00000.kvt").read_bytes()
    capsys.readouterr()
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert str(superblock) in out and said in out, out
    with pytest.raises(ConfigError) as refused:
        KVStore(config)
    assert str(superblock) in str(refused.value) and said in str(refused.value)
    assert refused.value.field == "tiers.disk.path"
    assert (path / "slab-00000.kvt").read_bytes() == slab  # nothing was changed
    with pytest.raises(ConfigError, match="superblock"):  # not "locked": the refusal let go
        KVStore(config)


@pytest.mark.parametrize("kind", ["a directory", "a link"])
def test_a_slab_path_that_is_not_a_regular_file_is_refused_never_followed(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "disk"
    config = disk_config(path)
    KVStore(config).close()
    slab = path / "slab-00000.kvt"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    slab.unlink()
    if kind == "a directory":
        slab.mkdir()
    else:
        slab.symlink_to(victim)
    with pytest.raises(ConfigError) as refused:
        KVStore(config)
    assert str(slab) in str(refused.value) and kind.split()[1] in str(refused.value)
    capsys.readouterr()
    assert main(["check", str(path)]) == 1
    assert str(slab) in capsys.readouterr().out
    assert victim.read_bytes() == b"precious"


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_readyz_names_a_damaged_superblock(tmp_path: Path) -> None:
    config = write_config(tmp_path, disk="256KiB")
    with running(config):
        pass
    superblock = tmp_path / "disk" / SUPERBLOCK
    superblock.write_text('{"format": 1, "slot_bytes": ')
    detail = unready_detail(config)
    assert str(superblock) in detail and "not JSON" in detail and "tiers.disk.path" in detail


# ---- a disk that refuses writes -----------------------------------------------------------------


def _fill_up(directory: Path) -> Path:
    """Punch the slab's pages out and fill the tmpfs: every write into the slab is ENOSPC."""
    slab = directory / "slab-00000.kvt"
    size = str(slab.stat().st_size)
    punch = ["fallocate", "--punch-hole", "--offset", "0", "--length", size, str(slab)]
    subprocess.run(punch, check=True, timeout=30)
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_an_idle_server_backs_off_from_a_full_disk_and_says_so(tmp_path: Path) -> None:
    if shutil.which("fallocate") is None:
        pytest.skip(reason="no fallocate(1) to punch the slab's pages out")
    with mounted_tmpfs(tmp_path / "disk", "1m") as mount_point:
        mount_point.chmod(0o700)  # a fresh tmpfs is 1777, which the disk tier refuses
        config = write_config(tmp_path, gpu_blocks=4, host_blocks=8, disk="256KiB")
        with running(config) as server, Client(server.url, shared_memory=False) as client:
            filler = _fill_up(tmp_path / "disk")
            for i in range(6):  # 24 blocks: host stays over its watermark, demotion must write
                client.store(tokens_of(1000 * i, 16), kv_of(16, seed=i))
            time.sleep(0.5)
            pid = server.process.pid
            before, errors_before = cpu_seconds(pid), status(server)["tiers"]["disk"]
            start = time.monotonic()
            time.sleep(2.0)  # then until the next try, which may be a whole backoff away
            while (disk := status(server)["tiers"]["disk"])["refused_writes"] == errors_before[
                "refused_writes"
            ]:
                assert time.monotonic() - start < MAX_S + 3, disk  # the mover gave up
                time.sleep(0.1)
            idle_s, used = time.monotonic() - start, cpu_seconds(pid) - before
            assert used < idle_s / 4, f"{used:.2f} s of CPU in {idle_s:.1f} s of idling"
            assert 0 < disk["refused_writes"] - errors_before["refused_writes"] < 100
            assert disk["backoff_s"] > 0 and "No space left" in disk["last_write_error"]
            assert disk["faults"]["write_errors"] > 0
            filler.unlink()  # room again: the next try after the backoff writes
            deadline = time.monotonic() + 15
            while status(server)["tiers"]["disk"]["blocks"] == 0:
                assert time.monotonic() < deadline, status(server)["tiers"]["disk"]
                time.sleep(0.1)
            assert status(server)["tiers"]["disk"]["backoff_s"] == 0


def _refuse_writes(pid: int, refuse: bool) -> None:
    """Make the kernel refuse (EFBIG) every file write of process `pid`, or stop doing so."""
    hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (0 if refuse else hard, hard))


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_clear_the_disk_cannot_make_durable_says_so_and_a_restart_shows_what_it_said(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, disk="256KiB", tenants={"a": {}, "b": {}})
    a, kv_a = tokens_of(0, 32), kv_of(32, seed=1)
    b, kv_b = tokens_of(100, 32), kv_of(32, seed=2)
    with running(config) as server, Client(server.url, shared_memory=False) as client:
        client.store(a, kv_a, tenant="a")
        client.store(b, kv_b, tenant="b")
        assert server.admin("/v1/admin/persist").json() == {
            "persisted_blocks": 16,
            "left_blocks": 0,
        }
        assert server.admin("/v1/admin/clear", params={"tenant": "a"}).json() == {
            "dropped_blocks": 8
        }
        _refuse_writes(server.process.pid, True)
        try:
            response = server.post("/v1/admin/clear", params={"tenant": "b"}, headers=ADMIN)
        finally:
            _refuse_writes(server.process.pid, False)
        assert response.status_code == 503, response.text
        body = response.json()
        assert body["error"] == "storage"
        assert "8 blocks were dropped" in body["detail"], body
        assert "8 of their 8 disk copies" in body["detail"] and "restart" in body["detail"]
        assert client.lookup(b, tenant="b") == LookupResult(0, 0, 0, 0)  # nothing serves them
    with running(config) as server, Client(server.url, shared_memory=False) as client:
        assert client.lookup(a, tenant="a") == LookupResult(0, 0, 0, 0)  # the durable clear
        assert client.lookup(b, tenant="b") == LookupResult(32, 0, 0, 32)  # as the 503 said
        assert same(client.load(b, tenant="b").kv, kv_b)


def test_the_backoff_doubles_up_to_its_cap_and_ends_with_a_whole_batch() -> None:
    now = [0.0]
    backoff = WriteBackoff(clock=lambda: now[0])
    assert not backoff.waiting() and backoff.delay_s == 0
    delays = []
    for _ in range(9):
        now[0] += backoff.delay_s  # each refusal after the wait before it has ended
        backoff.refused(OSError(28, "No space left on device"))
        delays.append(backoff.delay_s)
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert backoff.waiting() and backoff.last_error == "OSError: [Errno 28] No space left on device"
    now[0] += 4.99
    assert backoff.waiting()
    now[0] += 0.01
    assert not backoff.waiting()
    backoff.written()
    assert (backoff.delay_s, backoff.waiting()) == (0.0, False)


def test_refusals_during_a_wait_count_once() -> None:
    """The flights of one burst fail together (a copy and the retire of its slots too): they
    start the same wait again rather than doubling it to `MAX_S` at once (a full disk, mended,
    was left alone for 5 s after one burst of 6 flights; the idle-server test missed a retry)."""
    now = [0.0]
    backoff = WriteBackoff(clock=lambda: now[0])
    for _ in range(12):
        backoff.refused(OSError(28, "No space left on device"))
    assert backoff.delay_s == 0.05
    now[0] = 0.04
    backoff.refused(OSError(28, "No space left on device"))  # still waiting: the same wait
    assert backoff.delay_s == 0.05 and backoff.waiting()
    now[0] = 0.09
    assert not backoff.waiting()
    backoff.refused(OSError(28, "No space left on device"))  # after the wait: doubled
    assert backoff.delay_s == 0.1 and backoff.waiting()
