"""A cluster stalled at start (every node SIGSTOPped: they take TCP connections and never answer)
costs a call of the remote tier at most about one `timeout_s`, however many startup nodes there
are, in every `reconnect_s` window and on every thread (`tiers/remote/cluster.py`: connecting
is a thread's of its own, which tries the startup nodes one at a time); once the nodes run
again the tier connects and shares blocks; `close` during a connect stops its thread.

Before, the call that tried to connect (one per `reconnect_s`) built the client on its own
thread, reading the slot table from each startup node in turn under a timeout each (3 s for 6
nodes at 0.5 s), and every call beside it waited `2 * timeout_s + 1` for that connect; `close`
left the connecting thread running.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import wait_until
from redis_cluster import LocalCluster, require_redis
from test_remote_audit3 import config, kv_for, node, twin
from test_remote_client import blocks

from kvtier.tiers.remote.cluster import CONNECT_WAIT, ClusterSettings, RemoteCluster

TIMEOUT_S = 0.3
CONNECTING = "kvtier-remote-connect"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A 3-primary cluster with a replica each: 6 startup nodes."""
    require_redis()
    with LocalCluster(tmp_path_factory.mktemp("redis"), primaries=3, replicas=1) as local:
        yield local


@pytest.fixture
def stalled(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """`cluster` with every node SIGSTOPped; each is SIGCONTed (`resume`) after the test."""
    for process in cluster.processes.values():
        process.send_signal(signal.SIGSTOP)
    yield cluster
    resume(cluster)


def resume(cluster: LocalCluster) -> None:
    for process in cluster.processes.values():
        process.send_signal(signal.SIGCONT)


def worst_call(calls: list[Callable[[int], object]], seconds: float) -> float:
    """Each of `calls` run over and over on a thread of its own for `seconds`; the longest
    one call took."""
    worst = [0.0] * len(calls)
    ends = time.monotonic() + seconds

    def run(i: int) -> None:
        n = 0
        while time.monotonic() < ends:
            started = time.monotonic()
            calls[i](n)
            worst[i] = max(worst[i], time.monotonic() - started)
            n += 1
            time.sleep(0.01)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return max(worst)


def test_calls_on_a_stalled_cluster_wait_one_timeout_at_most(stalled: LocalCluster) -> None:
    settings = ClusterSettings(tuple(stalled.nodes), timeout_s=TIMEOUT_S, reconnect_s=0.5)
    remote = RemoteCluster(settings)
    keys, metas, values = blocks(90_000, 4)
    worst = worst_call(
        [
            lambda n: remote.get(keys, metas),
            lambda n: remote.present(keys),
            lambda n: remote.get(keys[1:], metas[1:]),
            lambda n: remote.put(list(zip(keys, values, strict=True))),
        ],
        seconds=2.0,  # 4 reconnect windows, 2 connects (each 6 nodes' timeouts)
    )
    assert worst < (CONNECT_WAIT + 1) * TIMEOUT_S, (
        worst
    )  # before: 6 nodes * TIMEOUT_S, the one that tried
    stats = remote.stats()
    assert stats["errors"] >= 1 and not stats["connected"], stats  # a connect tried, failed
    assert "connect (6 nodes)" in stats["last_error"]
    resume(stalled)
    assert wait_until(lambda: remote.present(keys) == 0 and remote.stats()["connected"], 10)
    assert all(remote.put(list(zip(keys, values, strict=True))))
    got = remote.get(keys, metas)
    assert all(reply is not None for reply in got)
    remote.close()


def test_close_during_a_connect_stops_its_thread(stalled: LocalCluster) -> None:
    before = {t for t in threading.enumerate() if t.name == CONNECTING}
    remote = RemoteCluster(ClusterSettings(tuple(stalled.nodes), timeout_s=TIMEOUT_S))
    time.sleep(TIMEOUT_S / 2)  # within the first node's read
    started = time.monotonic()
    remote.close()
    assert time.monotonic() - started < 2 * TIMEOUT_S + 1.0
    left = [t for t in threading.enumerate() if t.name == CONNECTING and t not in before]
    assert left == []  # before: it went on through the other 5 nodes
    assert remote.present([b"kvtier:closed"]) == 0


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_store_on_a_stalled_cluster_serves_at_once_then_shares(stalled: LocalCluster) -> None:
    """Over two of the store's 5 s reconnect windows, three threads' lookups and loads and a
    storing thread each wait at most about one timeout; the cluster back, blocks are shared."""
    ca = config(stalled.nodes, timeout_s=TIMEOUT_S)
    tokens = list(range(7000, 7032))
    kv = kv_for(tokens, seed=7)
    with node(ca) as a, node(twin(ca)) as b:
        worst = worst_call(
            [
                lambda n: b.lookup(list(range(10_000 * n, 10_000 * n + 32))),
                lambda n: b.load(list(range(20_000 * n, 20_000 * n + 32))),
                lambda n: b.lookup(tokens),
                lambda n: a.store(list(range(30_000 * n, 30_000 * n + 16)), kv[:, :, :16]),
            ],
            seconds=11.0,
        )
        assert worst < (CONNECT_WAIT + 1) * TIMEOUT_S, (
            worst
        )  # before: 3.0 s for 6 stalled nodes at 0.5
        assert b.lookup(tokens).remote_tokens == 0
        resume(stalled)
        starts = iter(range(40_000, 10**9, 16))

        def probe() -> bool:
            """A write (which tries to connect, each 5 s); whether `a` is connected now."""
            start = next(starts)
            a.store(list(range(start, start + 16)), kv[:, :, :16])
            return a.drain() and bool(a.status()["remote"]["connected"])

        assert wait_until(probe, 15)
        a.store(tokens, kv)
        assert wait_until(lambda: a.drain() and b.lookup(tokens).remote_tokens == 32, 15)
        got = b.load(tokens)
        assert got.num_tokens == 32 and bool((got.kv == kv).all())
        assert b.status()["remote"]["connected"]
