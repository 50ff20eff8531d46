"""`connected` says whether the node can reach its cluster now (`tiers/remote/cluster.py`): a
node connects on a thread of its own when it is made, so an idle sidecar reports connected
(before: `not connected` with no reason, and `kvtier_remote_connected 0`, until its first call:
the shipped alert `KvtierRemoteDisconnected` fired on an idle node); and a cluster lost after
the first connect reads as not connected once a call reaches no node (before: `connected`
until `close()`, so the alert never fired on a real outage), connected again once one does.

Skipped without `redis-server`, unless KVTIER_REQUIRE_REDIS=1 (CI sets it)."""

from __future__ import annotations

from pathlib import Path

from conftest import wait_until
from redis_cluster import LocalCluster, require_redis

from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster


def test_connected_follows_the_cluster_without_and_with_calls(tmp_path: Path) -> None:
    require_redis()
    with LocalCluster(tmp_path / "a", primaries=3) as cluster:
        settings = ClusterSettings(tuple(cluster.nodes), timeout_s=0.3, reconnect_s=0.2)
        remote = RemoteCluster(settings)
        assert wait_until(lambda: remote.stats()["connected"], 10)  # no call made
        assert remote.stats()["round_trips"] == 0
        assert remote.present([b"kvtier:connected-test"]) == 0  # a call that reaches it
        assert remote.stats()["connected"]
    assert remote.present([b"kvtier:connected-test"]) == 0  # every node gone
    stats = remote.stats()
    assert not stats["connected"] and stats["errors"] >= 1
    remote.close()
