"""A real `kvtier serve` process for the service tests (`test_service*.py`).

    with running(write_config(tmp_path, ...)) as server:    # /readyz is 200 here
        Client(server.url) ...
    # SIGTERM sent, exit status 0 asserted (killed, and the test failed, past the bound)

`write_config` writes a YAML config of a tiny fp16 layout (2 layers, 2 kv heads, head_dim 64,
4 tokens a block: 4096 bytes a block) with tiers sized in blocks and `service.state_dir` (and
the disk tier, if any) under the test's directory. Each server gets a free ephemeral port and
logs to `server-<port>.log` beside its config; a failed start or stop quotes the log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml

LAYERS, HEADS, DIM, BT = 2, 2, 64, 4
MODEL = {
    "name": "tiny",
    "num_layers": LAYERS,
    "num_kv_heads": HEADS,
    "head_dim": DIM,
    "dtype": "float16",
}
BLOCK_BYTES = LAYERS * 2 * BT * HEADS * DIM * 2  # 4096
ADMIN_KEY = "admin-key-0123456789abcdef"
START_S = 30.0  # bounds, not expectations: a start takes about a second
STOP_S = 30.0


def free_port() -> int:
    """A port the kernel just handed out as free (another process may take it, rarely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def write_config(
    directory: Path,
    *,
    gpu_blocks: int = 64,
    host_blocks: int = 128,
    disk: str | None = None,
    write: str = "write_through",
    service: Mapping[str, Any] | None = None,
    tenants: Mapping[str, Any] | None = None,
    name: str = "kvtier.yaml",
) -> Path:
    """A config file in `directory`: the tiny layout, `gpu_blocks`/`host_blocks` slots on the
    CPU, a disk tier of size `disk` under `directory/disk` if given; `service` entries over
    `state_dir: directory/state` and the admin key `ADMIN_KEY`."""
    directory.mkdir(parents=True, exist_ok=True)
    tiers: dict[str, Any] = {
        "gpu": {"capacity": gpu_blocks * BLOCK_BYTES, "device": "cpu"},
        "host": {"capacity": host_blocks * BLOCK_BYTES, "pinned": False},
    }
    if disk is not None:
        tiers["disk"] = {"capacity": disk, "path": str(directory / "disk")}
    config = {
        "model": MODEL,
        "block_tokens": BT,
        "tiers": tiers,
        "policy": {"write": write, "disk_admission_hits": 0},
        "service": {
            "state_dir": str(directory / "state"),
            "admin_key": ADMIN_KEY,
            **(service or {}),
        },
        "tenants": dict(tenants or {"default": {}}),
    }
    path = directory / name
    path.write_text(yaml.safe_dump(config))
    return path


MLA_MODEL = {"name": "tiny-mla", "num_layers": 2, "num_kv_heads": 1, "head_dim": 288,
             "dtype": "float16"}  # fmt: skip
"""An MLA model's latent (576 values per token and layer) held as one head of K and V halves."""


def write_mla_config(directory: Path, tenants: Mapping[str, Any], **model: Any) -> Path:
    """A config of the tiny MLA model (`model`: fields changed), tiers of 64 and 128 blocks."""
    path = write_config(directory, tenants=tenants)
    config = yaml.safe_load(path.read_text())
    config["model"] = {**MLA_MODEL, **model}
    block = 2 * 2 * 288 * 2 * config["block_tokens"]  # layers x K/V x 288 x fp16, per token
    config["tiers"]["gpu"]["capacity"] = 64 * block
    config["tiers"]["host"]["capacity"] = 128 * block
    path.write_text(yaml.safe_dump(config))
    return path


def serve_command(config: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config), "--port",
            str(port), *extra]  # fmt: skip


@dataclass
class Server:
    """A started `kvtier serve`; `stop()` sends SIGTERM and returns the exit status."""

    url: str
    config: Path
    log: Path
    process: subprocess.Popen[bytes]

    def stop(self, timeout_s: float = STOP_S) -> int:
        """SIGTERM, then wait up to `timeout_s`; past it, SIGKILL and `AssertionError`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(
                f"the server did not exit within {timeout_s} s of SIGTERM:\n{self.output()}"
            ) from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=30, **kwargs)

    def admin(self, path: str, **kwargs: Any) -> httpx.Response:
        """POST an admin endpoint with the admin key; asserts 200."""
        response = self.post(path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, **kwargs)
        assert response.status_code == 200, response.text
        return response


def start(config: Path, env: Mapping[str, str] | None = None, port: int | None = None) -> Server:
    """Start `kvtier serve --config config` on `port` (a free one by default: a given one
    starts a server again at a URL); return once /readyz is 200."""
    port = free_port() if port is None else port
    log = config.with_name(f"server-{port}-{time.monotonic_ns()}.log")
    with log.open("wb") as out:
        process = subprocess.Popen(
            serve_command(config, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    server = Server(f"http://127.0.0.1:{port}", config, log, process)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{server.output()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(server.url + "/readyz", timeout=1).status_code == 200:
                return server
        time.sleep(0.02)
    server.process.kill()
    server.process.wait()
    raise AssertionError(f"the server was not ready within {START_S} s:\n{server.output()}")


@contextlib.contextmanager
def running(
    config: Path, env: Mapping[str, str] | None = None, port: int | None = None
) -> Iterator[Server]:
    """A server for the block; on leaving it, SIGTERM and a clean exit (status 0) asserted."""
    server = start(config, env, port)
    try:
        yield server
    finally:
        status = server.stop()
    assert status == 0, f"exit status {status} after SIGTERM:\n{server.output()}"


def kv_of(num_tokens: int, seed: int) -> torch.Tensor:
    """Random KV of the tiny layout, `[2, 2, num_tokens, 2, 64]` fp16, a function of `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((LAYERS, 2, num_tokens, HEADS, DIM), generator=gen).to(torch.float16)


def tokens_of(base: int, num_tokens: int) -> list[int]:
    """`num_tokens` distinct ids from `base` on: tests keep their sequences apart by base."""
    return list(range(base, base + num_tokens))


@contextlib.contextmanager
def restartable(
    directory: Path, tenants: Mapping[str, Any] | None = None
) -> Iterator[tuple[Path, int, list[Server]]]:
    """A config and one port for servers a test starts and restarts at one URL
    (`start(config, port=port)`, appended to the list); every one stopped on leaving."""
    config, port = write_config(directory, tenants=tenants), free_port()
    started: list[Server] = []
    try:
        yield config, port, started
    finally:
        for server in started:
            server.stop()


def peak_rss_mib(pid: int) -> float:
    """The peak resident memory of process `pid` (`VmHWM`), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def reset_peak(pid: int) -> None:
    """Have the peak resident memory of process `pid` start again from now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
