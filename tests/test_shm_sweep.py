"""No shared-memory leftovers: segments are named after their owner, a killed server's are swept
at the next start (a live server's never), and a start that fails leaves none (issue 11.8).

The sweep is tested on real files in a test directory (owner, pid and age under the test's
control) and end to end on /dev/shm with real `kvtier serve` processes and a real SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from refusals import unready_detail
from service_server import (
    BLOCK_BYTES,
    free_port,
    kv_of,
    running,
    serve_command,
    start,
    tokens_of,
    write_config,
)

from kvtier.client import Client
from kvtier.config import load_config
from kvtier.errors import InvalidArgumentError
from kvtier.service.server import build_app
from kvtier.tiers.shm import NAME, SHM_DIR, create_shared, segment_prefix, sweep_stale

DAY_S = 86_400.0


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def segments_of(pid: int) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(f"kvtier-{pid}-"))


def test_a_segment_is_named_after_its_owner_and_a_bad_base_is_refused() -> None:
    prefix = segment_prefix("kvtier")
    base, pid, random = prefix.split("-")
    assert (base, int(pid), len(random)) == ("kvtier", os.getpid(), 8)
    assert segment_prefix("kvtier") != prefix  # two stores of one process differ
    for bad in ("", "a/b", "..", "x" * 33, "kv-tier"):
        with pytest.raises(InvalidArgumentError, match="shared memory base"):
            segment_prefix(bad)


def test_the_sweep_removes_only_segments_of_ours_whose_owner_is_gone(tmp_path: Path) -> None:
    gone, me = dead_pid(), os.getpid()
    files = {
        f"kvtier-{gone}-0000000a-host": "dead owner",
        f"kvtier-{gone}-0000000a-gpu": "dead owner",
        f"kvtier-{me}-0000000b-host": "live owner",
        f"kvtier-{me}-0000000c-host": "live pid, but started after the segment: reused",
        f"other-{gone}-0000000d-host": "another base",
        f"kvtier-{gone}-0000000e-disk": "not a pool tier",
        f"kvtier-{gone}-abc-host": "not our name",
        f"torch_{gone}_1_2": "not our name",
    }
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    long_ago = time.time() - DAY_S  # before this test process started
    os.utime(tmp_path / f"kvtier-{me}-0000000c-host", (long_ago, long_ago))
    os.symlink(tmp_path / "elsewhere", tmp_path / f"kvtier-{gone}-0000000f-host")
    (tmp_path / "elsewhere").write_bytes(b"kept")
    if os.geteuid() == 0:  # another user's segment: never ours to remove
        (tmp_path / f"kvtier-{gone}-00000010-host").write_bytes(b"x")
        os.chown(tmp_path / f"kvtier-{gone}-00000010-host", 54321, 54321)

    swept = sweep_stale(tmp_path)

    assert swept == sorted(
        [
            f"kvtier-{gone}-0000000a-gpu",
            f"kvtier-{gone}-0000000a-host",
            f"kvtier-{me}-0000000c-host",
        ]
    )
    left = set(os.listdir(tmp_path))
    assert left.isdisjoint(swept)
    assert {f"kvtier-{me}-0000000b-host", f"other-{gone}-0000000d-host"} <= left
    assert (
        f"kvtier-{gone}-0000000f-host" in left and (tmp_path / "elsewhere").read_bytes() == b"kept"
    )
    if os.geteuid() == 0:
        assert f"kvtier-{gone}-00000010-host" in left
    assert sweep_stale(tmp_path) == []


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_killed_servers_segments_are_swept_at_the_next_start_and_a_live_ones_kept(
    tmp_path: Path,
) -> None:
    with running(write_config(tmp_path / "live")) as live:
        live_segments = segments_of(live.process.pid)
        assert [name.rsplit("-", 1)[1] for name in live_segments] == ["gpu", "host"]
        killed = start(write_config(tmp_path / "killed"))
        killed_segments = segments_of(killed.process.pid)
        assert len(killed_segments) == 2
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait()
        assert segments_of(killed.process.pid) == killed_segments  # SIGKILL leaves them

        with running(write_config(tmp_path / "next")) as following:
            assert segments_of(killed.process.pid) == []
            swept = re.search(
                r"swept \d+ shared-memory segments of dead servers: (.*)", following.output()
            )
            # the start that swept them says so (in a parallel run of other suites, another
            # server starting in that second may be the one: then this log names none of them)
            mine = [name for name in swept[1].split() if name in killed_segments] if swept else []
            assert mine in ([], killed_segments)
            assert segments_of(live.process.pid) == live_segments
            tokens = tokens_of(0, 16)
            with Client(live.url) as client:  # the live server's pools still work
                assert client.pool_buffer("host") is not None
                client.store(tokens, kv_of(16, 1))
                assert client.load(tokens).kv.equal(kv_of(16, 1))
    assert segments_of(live.process.pid) == []  # a clean exit unlinks its own


def test_the_start_logs_what_it_swept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    name = f"kvtier-{dead_pid()}-{secrets.token_hex(4)}-host"
    create_shared(name, 4096).close()
    with caplog.at_level(logging.WARNING, logger="kvtier.serve"):
        build_app(load_config(write_config(tmp_path)), "127.0.0.1")
    assert not (SHM_DIR / name).exists()
    swept = [r.getMessage() for r in caplog.records if "shared-memory segments" in r.getMessage()]
    assert len(swept) == 1 and name in swept[0].rsplit(": ", 1)[1].split()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_start_that_fails_after_the_pools_exist_leaves_no_segment(tmp_path: Path) -> None:
    config = write_config(tmp_path, disk="1MiB")
    (tmp_path / "disk").write_text("a file where the disk tier's directory should be")
    before = set(os.listdir(SHM_DIR))
    port = free_port()
    with (tmp_path / "server.log").open("wb") as log:
        process = subprocess.Popen(serve_command(config, port), stdout=log, stderr=log)
    try:
        failure = None
        deadline = time.monotonic() + 30
        while failure is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
                if ready.status_code == 503 and ready.json()["detail"] != "recovering":
                    failure = ready.json()["detail"]
            time.sleep(0.05)
        assert failure is not None and "disk" in failure, (tmp_path / "server.log").read_text()
        assert process.poll() is None  # still up, /readyz saying why
        assert segments_of(process.pid) == []
        new = set(os.listdir(SHM_DIR)) - before
        # a kvtier segment named without its owner's pid can only be this server's
        assert [
            name for name in new if name.startswith("kvtier-") and not NAME.fullmatch(name)
        ] == []
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_dev_shm_too_small_for_the_pools_is_refused_at_start_naming_the_capacity(
    tmp_path: Path,
) -> None:
    """docker's default /dev/shm is 64 MiB: a server whose pools do not fit reports, on
    /readyz, the tier's capacity and the remedies, instead of serving until its first write
    past the room kills it with SIGBUS (a real 1 MiB tmpfs over /dev/shm, in a mount
    namespace of the server's own)."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip(reason="unshare -m is not permitted here (not root)")
    config = write_config(tmp_path, gpu_blocks=8, host_blocks=4 * 2**20 // BLOCK_BYTES)
    mount = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"'
    detail = unready_detail(config, wrap=["unshare", "-m", "sh", "-c", mount, "sh"])
    assert "tiers.host.capacity" in detail and "--shm-size" in detail, detail
