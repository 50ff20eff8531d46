"""A Redis Cluster of Debian's `redis-server` processes on loopback ports, for tests,
benchmarks and `kvtier replay --remote` (not for production: no persistence).

`LocalCluster(directory, primaries, replicas, password, tls)` starts the servers (`--save ""`,
no AOF, each server's files in `directory`), makes them one cluster with `redis-cli --cluster
create`, and waits until every node says `cluster_state:ok` and every replica has finished its
first sync (so that a primary killed at once fails over). With a `password`, every server
requires it (`requirepass`; `masterauth` for replicas), written into a 0600 config file, never
into argv. With `tls` (`make_certificates`: a throwaway CA with `openssl`), the servers listen
only on TLS, between themselves too, and require a client certificate. `nodes` are their
`127.0.0.1:PORT`; `kill(port)` SIGKILLs one server (failover tests); `stop()` ends them all.
A context manager too.
`tests/redis_cluster.py` is its command line (start / stop by pid).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from kvtier.tiers.remote.cluster import TlsSettings

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


def make_certificates(directory: Path) -> TlsSettings:
    """A throwaway CA and one certificate it signed for 127.0.0.1 / localhost (servers and
    clients alike), made with the `openssl` command line into `directory`: for tests and
    benchmarks of `tiers.remote.tls`, never for a deployment."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, request = directory / "node.pem", directory / "node.key", directory / "node.csr"
    extensions = directory / "node.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for command in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "2", "-subj", "/CN=kvtier-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", extensions],
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, command)], capture_output=True, check=True)
    return TlsSettings(str(ca), str(cert), str(key))


class LocalCluster:
    """`primaries` + `primaries * replicas` redis-server processes made one cluster."""

    def __init__(
        self,
        directory: Path,
        primaries: int = 3,
        replicas: int = 0,
        password: str | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        self.directory = directory
        self.primaries = primaries
        self.replicas = replicas
        self.password = password
        self.tls = tls  # a client certificate is then required (`make_certificates`)
        self.ports: list[int] = []
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def nodes(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def start(self, timeout: float = 30.0, attempts: int = 3) -> LocalCluster:
        """Start the cluster; a server that cannot start (a port taken between the check and
        its bind) makes the attempt start over on other ports, at most `attempts` times."""
        for attempt in range(attempts):
            try:
                return self._start(timeout)
            except RuntimeError:
                self.stop()
                if attempt + 1 == attempts:
                    raise
            except BaseException:  # anything else: no server outlives the failed start
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> LocalCluster:
        self.directory.mkdir(parents=True, exist_ok=True)
        count = self.primaries * (1 + self.replicas)
        self.ports = [_free_port() for _ in range(count)]
        for port in self.ports:
            log = open(self.directory / f"redis-{port}.log", "wb")  # noqa: SIM115 (the child owns it)
            self.processes[port] = subprocess.Popen(
                [
                    "redis-server",
                    str(self._config_file(port)),
                    *(["--port", "0", "--tls-port", str(port)] if self.tls else
                      ["--port", str(port)]),
                    "--bind", "127.0.0.1",
                    "--dir", str(self.directory),
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf",
                    # one snapshot file per server: a replica's full sync writes the RDB it
                    # receives to this name and loads it back, so servers sharing `--dir`
                    # and the default dump.rdb could load another's data (seen: a promoted
                    # replica holding a different primary's keys)
                    "--dbfilename", f"dump-{port}.rdb",
                    "--cluster-node-timeout", "2000",
                    # a replica syncs at once (default: 5 s later), so that `start` can wait
                    # for it: one that never synced cannot take over a killed primary
                    "--repl-diskless-sync-delay", "0",
                    "--save", "",
                    "--appendonly", "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while "PONG" not in self._cli(port, "ping", timeout=2):
                if self.processes[port].poll() is not None or time.monotonic() > deadline:
                    said = (self.directory / f"redis-{port}.log").read_text(errors="replace")
                    raise RuntimeError(f"redis-server on port {port} did not start: {said[-800:]}")
                time.sleep(0.05)
        created = subprocess.run(
            ["redis-cli", *self._cli_options(), "--cluster", "create", *self.nodes,
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout, check=False,
            env=self._cli_env(),
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]}")
        while not all("cluster_state:ok" in self._cli(p, "cluster", "info") for p in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        while self._synced_replicas() < self.primaries * self.replicas:
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not finish their first sync")
            time.sleep(0.1)
        return self

    def _synced_replicas(self) -> int:
        """How many servers are replicas whose link to their primary is up (first sync done:
        before it, a replica cannot be promoted when its primary fails)."""
        return sum(
            "master_link_status:up" in self._cli(port, "info", "replication") for port in self.ports
        )

    def _config_file(self, port: int) -> Path:
        """The server's config file: the password and TLS files, if any (owner-only: 0600)."""
        path = self.directory / f"redis-{port}.conf"
        path.touch(mode=0o600)
        path.chmod(0o600)
        lines = []
        if self.password:
            lines += [f"requirepass {self.password}", f"masterauth {self.password}"]
        if self.tls:
            lines += [
                "tls-cluster yes",
                "tls-replication yes",
                "tls-auth-clients yes",
                f"tls-ca-cert-file {self.tls.ca_file}",
                f"tls-cert-file {self.tls.cert_file}",
                f"tls-key-file {self.tls.key_file}",
            ]
        path.write_text("".join(line + "\n" for line in lines))
        return path

    def _cli_options(self) -> list[str]:
        if self.tls is None:
            return []
        tls = self.tls
        return ["--tls", "--cacert", tls.ca_file, "--cert", str(tls.cert_file), "--key",
                str(tls.key_file)]  # fmt: skip

    def _cli_env(self) -> dict[str, str] | None:
        """The password goes to redis-cli through the environment, never argv."""
        return {**os.environ, "REDISCLI_AUTH": self.password} if self.password else None

    def _cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        """What `redis-cli` answers on `port`; "" when it does not answer in time (a port
        taken by something that is not redis)."""
        try:
            done = subprocess.run(
                ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *self._cli_options(), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env=self._cli_env(),
            )
        except subprocess.TimeoutExpired:
            return ""
        return done.stdout + done.stderr

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
