"""A CUDA pool's IPC handle goes only to a peer of the server's own Unix user (`service/peer.py`):
CUDA checks no user when a handle is opened, so a tenant's client run as another user (the
README's defence for the /dev/shm pools) must not get it. The peer's user is read from the
kernel's TCP table for real connections: from this process, and from a child process run as
`nobody` (setpriv; skipped where the test cannot change user)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from service_server import running, write_config

from kvtier.service.peer import same_user, tcp_peer_uid

NOBODY = 65534


def nobody_command(code: str) -> list[str]:
    """A Python child running `code` as uid/gid 65534 (skips where that is not possible)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip(reason="changing user needs root and setpriv")
    user = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return ["setpriv", *user, sys.executable, "-c", code]


@pytest.fixture(params=["127.0.0.1", "::"], ids=["ipv4", "dual-stack"])
def listener(request: pytest.FixtureRequest) -> Iterator[socket.socket]:
    family = socket.AF_INET if request.param == "127.0.0.1" else socket.AF_INET6
    server = socket.socket(family)
    server.bind((request.param, 0))
    server.listen()
    yield server
    server.close()


def test_a_peer_of_this_process_is_of_its_user(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)):
        accepted, peer = listener.accept()
        with accepted:
            local = accepted.getsockname()[:2]
            assert tcp_peer_uid(peer[:2], local) == os.geteuid()
            assert same_user(peer[:2], local)


def test_a_peer_run_as_another_user_is_not(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    connect = f"socket.create_connection(('127.0.0.1', {port}))"
    child = subprocess.Popen(nobody_command(f"import socket, time; s = {connect}; time.sleep(2)"))
    try:
        listener.settimeout(30)
        accepted, peer = listener.accept()
        with accepted:
            local = accepted.getsockname()[:2]
            assert tcp_peer_uid(peer[:2], local) == NOBODY
            assert not same_user(peer[:2], local)
    finally:
        child.wait(30)


def test_no_such_connection_or_no_ip_is_nobody_known() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    assert tcp_peer_uid(("127.0.0.1", port), ("127.0.0.1", 1)) is None
    assert tcp_peer_uid(("localhost", 5), ("127.0.0.1", 1)) is None
    assert not same_user(None, ("127.0.0.1", 1))


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_real_server_names_its_pools_to_another_user_without_a_handle(tmp_path: Path) -> None:
    """Through a real `kvtier serve`: a client run as `nobody` learns the pools' names (it
    cannot open the 0600 files) and gets no CUDA handle; on a machine with CUDA the gpu pool is
    a CUDA pool, whose handle this process (the server's user) gets and `nobody` does not."""
    import torch

    config = write_config(tmp_path)
    cuda = torch.cuda.is_available()
    if cuda:
        data = yaml.safe_load(config.read_text())
        data["tiers"]["gpu"]["device"] = "cuda:0"
        config.write_text(yaml.safe_dump(data))
    tmp_path.chmod(0o755)  # the server's files stay 0600/0700; nobody only runs a client
    with running(config) as server:
        code = (
            "import json, urllib.request; "
            f"print(urllib.request.urlopen('{server.url}/v1/pools').read().decode())"
        )
        done = subprocess.run(nobody_command(code), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        theirs = json.loads(done.stdout)
        ours = json.loads(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
            ).stdout
        )
    assert [p["shared_memory"] for p in theirs["pools"]] == [
        p["shared_memory"] for p in ours["pools"]
    ]
    assert all(p["cuda_ipc"] is None for p in theirs["pools"])
    gpu = next(p for p in ours["pools"] if p["tier"] == "gpu")
    assert (gpu["cuda_ipc"] is not None) is cuda
