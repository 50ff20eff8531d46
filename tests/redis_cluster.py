"""A real Redis Cluster on loopback ports, for the remote tier's tests and for local runs.

    python tests/redis_cluster.py start --dir /tmp/kvtier-redis [--primaries 3] [--replicas 0]
        starts the servers (Debian's `redis-server`), makes them one cluster, waits until every
        node says `cluster_state:ok`, prints the nodes (`127.0.0.1:PORT,...`) and writes them
        and the servers' pids into DIR;
    python tests/redis_cluster.py stop --dir /tmp/kvtier-redis
        stops them by pid (SIGTERM, then SIGKILL after 5 s) and removes DIR's files.

In tests, `LocalCluster` (`kvtier/tiers/remote/local.py`) is the same as a context manager.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from kvtier.tiers.remote.local import LocalCluster, have_redis

__all__ = ["LocalCluster", "have_redis", "require_openssl", "require_redis", "start_cluster"]

MISSING = "redis-server is not installed (Debian: apt-get install redis-server)"


def require_redis() -> None:
    """Skip the test without Debian's `redis-server`, saying so; under KVTIER_REQUIRE_REDIS=1
    (CI) fail instead, so that the remote tier's tests never skip there unseen."""
    if have_redis():
        return
    if os.environ.get("KVTIER_REQUIRE_REDIS") == "1":
        pytest.fail(f"KVTIER_REQUIRE_REDIS=1 but {MISSING}")
    pytest.skip(reason=MISSING)


def require_openssl() -> None:
    """As `require_redis`, for the `openssl` command line that makes TLS test certificates."""
    if shutil.which("openssl") is not None:
        return
    if os.environ.get("KVTIER_REQUIRE_REDIS") == "1":
        pytest.fail("KVTIER_REQUIRE_REDIS=1 but openssl is not installed")
    pytest.skip(reason="openssl is not installed (Debian: apt-get install openssl)")


def start_cluster(directory: Path) -> LocalCluster:
    """A started 3-primary cluster in `directory` (`require_redis` first)."""
    require_redis()
    return LocalCluster(directory, primaries=3).start()


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
