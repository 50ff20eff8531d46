"""`kvtier serve`'s start and stop, as auditor L found them (findings 1, 2, 3, 5, 6, 7).

- A live owner's shared-memory segments are kept by a sweep whatever pid namespace it is in:
  the owner holds a `flock` on each segment while it maps it, and `sweep_stale` removes only a
  segment whose lock it can take (`tiers/shm.py`); before, a pid the sweeper could not see
  (another container's) counted as dead and a live server's pools were removed. End to end
  (slow, root): two real servers sharing a private /dev/shm, the second in its own pid
  namespace.
- SIGTERM lets a local-lane call in progress send its reply (`service/lane.py`); before, the
  lane shut the connection down under it.
- A store that fails to start turns `/healthz` 503 with the reason (`service/app.py`), so a
  liveness probe restarts the process; before, `/healthz` said 200 forever.
- A second SIGINT that forces the exit past the store's close exits 1 and says so
  (`service/server.py`); before, 0.
- A port in use stops `kvtier serve` before any store is built (a `ConfigError`, exit 2);
  before, the store (its disk tier made) was built first, then uvicorn exited 3.
- `kvtier_tier_leased_blocks`' help says what it counts: clients' leases, not a
  reservation's pins of its cached prefix (which the tenant's `locked_blocks` counts).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack  # type: ignore[import-untyped]
import pytest
from fastapi.testclient import TestClient
from lane_peer import GOODBYE, lane_of, opened, read_frame
from service_server import (
    ADMIN_KEY,
    BT,
    free_port,
    kv_of,
    serve_command,
    start,
    tokens_of,
    write_config,
)

from kvtier.config import load_config
from kvtier.service.app import create_app
from kvtier.store import KVStore
from kvtier.tiers.shm import SHM_DIR, create_shared, sweep_stale

KEY = "audit-l-tenant-key-0123456789"
AUTH = f"Bearer {KEY}"
TENANTS = {"a": {"api_keys": [KEY]}}
WAIT_S = 30.0  # bounds, not expectations


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped): as a pid of another pid
    namespace looks from this one."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def lock_is_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_segment_whose_lock_is_held_is_kept_though_its_pid_looks_dead(tmp_path: Path) -> None:
    held = tmp_path / f"kvtier-{dead_pid()}-0000000a-host"
    left = tmp_path / f"kvtier-{dead_pid()}-0000000b-host"
    held.write_bytes(b"x")
    left.write_bytes(b"x")
    owner = os.open(held, os.O_RDWR)  # its owner, in a pid namespace this one cannot see
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)
        assert sweep_stale(tmp_path) == [left.name]
        assert held.exists() and not left.exists()
    finally:
        os.close(owner)  # the owner dies: its lock goes with it
    assert sweep_stale(tmp_path) == [held.name]


def test_a_new_segment_holds_its_lock_for_as_long_as_it_is_mapped() -> None:
    name = f"auditl-{dead_pid()}-{secrets.token_hex(4)}-host"  # not `kvtier`: no sweep's
    mapping = create_shared(name, 4096)
    try:
        assert not lock_is_free(SHM_DIR / name)
        mapping.close()
        assert lock_is_free(SHM_DIR / name)
    finally:
        mapping.close()
        (SHM_DIR / name).unlink()


def lookup_frame(count: int) -> bytes:
    """A lane lookup of `count` tokens, as the wire has it."""
    body = msgpack.packb({"tokens": bytes(4 * count)}, use_bin_type=True)
    payload: bytes = msgpack.packb(["/v1/lookup", AUTH, None, body], use_bin_type=True)
    return struct.pack("<I", len(payload)) + payload


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_sigterm_lets_a_lane_call_in_progress_send_its_reply(tmp_path: Path) -> None:
    config = write_config(tmp_path, service={"body_timeout_s": 30.0}, tenants=TENANTS)
    server = start(config)
    try:
        conn = opened(lane_of(server, AUTH), timeout_s=WAIT_S)
        frame = lookup_frame(20_000)  # 80 KiB: its head admitted, the call under way
        conn.sendall(frame[: 70 * 1024])
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the lane is stopping (no HTTP request holds the stop back)
        conn.sendall(frame[70 * 1024 :])
        status, body = read_frame(conn)
        assert status == 200 and msgpack.unpackb(body)["num_tokens"] == 0
        assert read_frame(conn) == GOODBYE  # then the connection ends, between calls
        assert server.process.wait(WAIT_S) == 0
    finally:
        server.stop()


def test_a_store_that_fails_to_start_turns_healthz_503_with_the_reason(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, disk="1MiB"))
    (tmp_path / "disk").write_text("a file where the disk tier's directory should be")
    app = create_app(config, lambda: KVStore(config))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert app.state.service.ready.wait(WAIT_S)
        health, ready = client.get("/healthz"), client.get("/readyz")
    assert health.status_code == 503 and health.json()["error"] == "start_failed"
    assert "disk" in health.json()["detail"]
    assert ready.status_code == 503 and ready.json()["detail"] in health.json()["detail"]


def test_a_started_store_keeps_healthz_200(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path))
    app = create_app(config, lambda: KVStore(config))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert app.state.service.ready.wait(WAIT_S)
        assert client.get("/healthz").json() == {"ok": True}


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_second_sigint_that_skips_the_stores_close_exits_1_saying_so(tmp_path: Path) -> None:
    server = start(write_config(tmp_path))
    try:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as waited_for:
            waited_for.sendall(  # a request whose body never ends: the graceful stop waits
                b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
            )
            time.sleep(0.5)
            server.process.send_signal(signal.SIGINT)
            time.sleep(1.0)
            assert server.process.poll() is None  # waiting for the request
            server.process.send_signal(signal.SIGINT)
            assert server.process.wait(WAIT_S) == 1
        assert "forced to exit by a second signal: the store was not closed" in server.output()
        assert "Traceback" not in server.output()  # uvicorn's cancelled lifespan: one line said
    finally:
        server.stop()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_port_in_use_stops_the_start_before_the_store_is_built(tmp_path: Path) -> None:
    config = write_config(tmp_path, disk="1MiB")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(serve_command(config, port), capture_output=True, timeout=WAIT_S)
    output = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 2, output[-3000:]
    assert f"config field 'service.port': got {port}, expected a port free" in output
    assert not (tmp_path / "disk").exists()  # no store was built


def test_leased_blocks_help_says_a_reservations_pins_are_not_counted(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, tenants=TENANTS))
    app = create_app(config, lambda: KVStore(config))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert app.state.service.ready.wait(WAIT_S)
        store = app.state.service.store
        prefix = tokens_of(0, 3 * BT)
        store.store(prefix, kv_of(3 * BT, 1), tenant="a")
        store.reserve(prefix + tokens_of(100, BT), tenant="a", ttl_s=30)  # pins the prefix
        lines = client.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        locked = client.get("/v1/status", headers={"authorization": AUTH}).json()
    text = lines.text.splitlines()
    help_line = next(line for line in text if line.startswith("# HELP kvtier_tier_leased_blocks"))
    assert "clients' leases" in help_line and "not the pins of reservations" in help_line
    assert 'kvtier_tier_leased_blocks{tier="gpu"} 0.0' in text
    assert locked["locked_blocks"] == 3  # the pins: the tenant's figure counts them


def ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"not ready within {WAIT_S} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_server_in_another_pid_namespace_keeps_a_live_servers_segments(tmp_path: Path) -> None:
    """Two servers sharing a /dev/shm (a private tmpfs: the machine's is never swept here), the
    second in a pid namespace of its own, as one sidecar per container: its start-up sweep
    cannot see the first one's pid, and keeps its segments all the same."""
    if subprocess.run(["unshare", "-m", "-p", "-f", "true"], capture_output=True).returncode:
        pytest.skip(reason="unshare of mount and pid namespaces is not permitted here")
    ports = {"a": free_port(), "b": free_port()}
    logs = {name: tmp_path / f"{name}.log" for name in ports}
    configs = {name: write_config(tmp_path / name) for name in ports}
    mount = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    with logs["a"].open("wb") as out:
        first = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh",
             *serve_command(configs["a"], ports["a"])],
            stdout=out, stderr=out,
        )  # fmt: skip
    second = None
    try:
        ready(f"http://127.0.0.1:{ports['a']}", first, logs["a"])
        shm = Path(f"/proc/{first.pid}/root/dev/shm")  # the first one's /dev/shm
        segments = sorted(os.listdir(shm))
        assert [name.split("-")[1] for name in segments] == [str(first.pid)] * 2
        with logs["b"].open("wb") as out:  # in its mount namespace, a pid namespace of its own
            second = subprocess.Popen(
                ["nsenter", "-t", str(first.pid), "-m", "--", "unshare", "-p", "-f",
                 "--mount-proc", "--kill-child", *serve_command(configs["b"], ports["b"])],
                stdout=out, stderr=out,
            )  # fmt: skip
        ready(f"http://127.0.0.1:{ports['b']}", second, logs["b"])
        assert set(segments) <= set(os.listdir(shm)), logs["b"].read_text()[-3000:]
        assert "swept" not in logs["b"].read_text()
    finally:
        for process in (second, first):
            if process is not None:
                process.send_signal(signal.SIGTERM if process is first else signal.SIGKILL)
                process.wait(WAIT_S)
