"""A real Redis Cluster on loopback ports, for the remote tier's tests and for local runs.

    python tests/redis_cluster.py start --dir /tmp/kvtier-redis [--primaries 3] [--replicas 0]
        starts the servers (Debian's `redis-server`), makes them one cluster, waits until every
        node says `cluster_state:ok`, prints the nodes (`127.0.0.1:PORT,...`) and writes them
        and the servers' pids into DIR;
    python tests/redis_cluster.py stop --dir /tmp/kvtier-redis
        stops them by pid (SIGTERM, then SIGKILL after 5 s) and removes DIR's files.

In tests, `LocalCluster` is the same as a context manager; `kill(node)` SIGKILLs one server,
for failover tests. Nothing persists: no RDB, no AOF, each server's files in DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (its cluster bus)


def have_redis() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def _free_port() -> int:
    """A loopback port that is free, and whose cluster-bus port is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + BUS_OFFSET >= 65536:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair for a cluster node")


def _cli(port: int, *args: str, timeout: float = 10.0) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout + done.stderr


class LocalCluster:
    """`primaries` + `primaries * replicas` redis-server processes made one cluster."""

    def __init__(self, directory: Path, primaries: int = 3, replicas: int = 0) -> None:
        self.directory = directory
        self.primaries = primaries
        self.replicas = replicas
        self.ports: list[int] = []
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def start(self, timeout: float = 30.0) -> LocalCluster:
        self.directory.mkdir(parents=True, exist_ok=True)
        count = self.primaries * (1 + self.replicas)
        self.ports = [_free_port() for _ in range(count)]
        for port in self.ports:
            log = open(self.directory / f"redis-{port}.log", "wb")  # noqa: SIM115 (the child owns it)
            self.processes[port] = subprocess.Popen(
                [
                    "redis-server",
                    "--port", str(port),
                    "--bind", "127.0.0.1",
                    "--dir", str(self.directory),
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", "2000",
                    "--save", "",
                    "--appendonly", "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while "PONG" not in _cli(port, "ping", timeout=2):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {port} did not start")
                time.sleep(0.05)
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *self.nodes, "--cluster-replicas",
             str(self.replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]}")
        while not all("cluster_state:ok" in _cli(p, "cluster", "info") for p in self.ports):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def kill(self, port: int) -> None:
        """SIGKILL the server on `port` (a crash, for failover tests)."""
        process = self.processes.pop(port)
        process.kill()
        process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.processes.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _stop_by_pid(directory: Path) -> None:
    pids_file = directory / "pids"
    pids = [int(line) for line in pids_file.read_text().split()] if pids_file.exists() else []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for name in ("pids", "nodes"):
        (directory / name).unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--primaries", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=0)
    args = parser.parse_args()
    if args.action == "stop":
        _stop_by_pid(args.dir)
        return 0
    cluster = LocalCluster(args.dir, args.primaries, args.replicas).start()
    (args.dir / "pids").write_text("\n".join(str(p.pid) for p in cluster.processes.values()))
    (args.dir / "nodes").write_text(",".join(cluster.nodes))
    print(",".join(cluster.nodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
