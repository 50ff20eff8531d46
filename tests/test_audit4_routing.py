"""The router's subscriber and scorer against real publishers (a real `KVStore` with events on,
real ZMQ on loopback), pinning the fourth audit's routing findings:

- 1: a periodic resync clears a topic the pod's whole snapshot no longer lists (it holds no
  block), where before a removal the router missed stayed scored for ever; a tenant's view
  (`add(..., tenant=...)`) leaves the other tenants' topics alone;
- 2: a pod restarted with its clock stepped back (its numbers below an earlier snapshot's
  floor) is followed from its AllBlocksCleared, not skipped as already reflected;
- 3: `remove(pod)` forgets a pod's blocks and lets it be added again at another address;
- 4: an address that accepts connections and closes them is reopened with a backoff, not in a
  tight loop, and the thread sleeps while it has no socket open;
- 5: a flooding publisher's unread messages are bounded by `max_queue_bytes`;
- 6: `score(tokens, tenant=...)` / `Router.choose(..., tenant=...)` count that tenant's topics
  only where topics are per tenant.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
from conftest import TINY_BLOCK_TOKENS, TINY_MODEL, kv_for, tiny_block_bytes

import kvtier.assembly as assembly
from kvtier import KVStore, parse_config
from kvtier.events.observer import snapshot
from kvtier.routing import PrefixIndex, Router, Subscriber

BT = TINY_BLOCK_TOKENS
A, B = list(range(100, 112)), list(range(500, 512))  # 3 blocks each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make(path: Path, pod: str = "pod", per_tenant: bool = False, port: int = 0) -> KVStore:
    block = tiny_block_bytes()
    return KVStore(
        parse_config(
            {
                "model": {**TINY_MODEL, "dtype": "float32"},
                "block_tokens": BT,
                "tiers": {
                    "gpu": {"capacity": 4 * block, "device": "cpu"},
                    "host": {"capacity": 8 * block, "pinned": False},
                    "disk": {"capacity": 64 * block, "path": str(path / "disk")},
                },
                "mover": {"background": False},
                "tenants": {"alice": {}, "bob": {}},
                "events": {
                    "endpoint": f"tcp://127.0.0.1:{port}",
                    "replay_endpoint": "tcp://127.0.0.1:0",
                    "topic": f"kv@{pod}@tiny",
                    "per_tenant_topic": per_tenant,
                },
            }
        )
    )


def wait_until(predicate: Callable[[], Any], timeout: float = 4.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def stale(tokens: list[int]) -> bytes:
    """A BlockStored of `tokens` under hashes no store uses: what a lost removal leaves."""
    stored = ["BlockStored", [7, 8, 9], None, tokens, BT, None, "GPU", None]
    return bytes(msgpack.packb([time.time(), [stored], None]))


def publisher_of(store: KVStore) -> Any:
    publisher = store.parts.events
    assert publisher is not None
    return publisher


@pytest.mark.parametrize("per_tenant", [False, True], ids=["shared", "per-tenant"])
def test_a_topic_left_without_blocks_is_cleared_by_the_resync(
    tmp_path: Path, closing: Any, per_tenant: bool
) -> None:
    """Finding 1: before, the admin snapshot lists only topics holding blocks and the resync
    reset only those: a lost removal on an emptied topic stayed scored ({'pod': 12.0})."""
    store = closing(make(tmp_path, per_tenant=per_tenant))
    pub = publisher_of(store)
    index = PrefixIndex(BT)
    sub = closing(Subscriber(index, resync_s=0.2))
    sub.add(pub.endpoint, pub.replay_endpoint, lambda: snapshot(store, None), pod="pod")
    store.store(A, kv_for(store, 12, seed=1), tenant="alice")
    assert wait_until(lambda: index.score(A) == {"pod": 12.0})
    store.clear(tenant="alice")
    assert wait_until(lambda: index.score(A) == {})
    topic = pub.topic_of("alice")
    index.apply(topic, stale(A))  # the removal the router missed
    assert index.score(A) == {"pod": 12.0}
    assert [t["topic"] for t in snapshot(store, None)["topics"]] == []
    assert wait_until(lambda: index.score(A) == {}, 3.0)
    index.check()


def test_a_tenants_snapshot_leaves_the_other_tenants_topics(tmp_path: Path, closing: Any) -> None:
    """Finding 1, the tenant's view: its snapshot tells of its own topic only, so bob's topic,
    absent from alice's snapshot, keeps its blocks; alice's drift is repaired."""
    store = closing(make(tmp_path, per_tenant=True))
    pub = publisher_of(store)
    index = PrefixIndex(BT)
    sub = closing(Subscriber(index, resync_s=0.2))
    view = lambda: snapshot(store, "alice")  # noqa: E731
    sub.add(pub.endpoint, pub.replay_endpoint, view, pod="pod", tenant="alice")
    store.store(B, kv_for(store, 12, seed=2), tenant="bob")
    assert wait_until(lambda: index.score(B) == {"pod": 12.0})
    index.apply(pub.topic_of("alice"), stale(A))  # drift on alice's (empty) topic
    resyncs = sub.stats()["resyncs"]
    assert wait_until(lambda: index.score(A) == {} and sub.stats()["resyncs"] > resyncs + 1)
    assert index.score(B) == {"pod": 12.0}
    index.check()


def test_a_restart_whose_clock_stepped_back_is_followed_from_its_clear(
    tmp_path: Path, closing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 2: before, the new life's numbers (an hour below the old life's) were all below
    the old snapshot's floor and skipped, its AllBlocksCleared included: the old life's
    blocks stayed scored and the new life's were never learnt."""
    port = free_port()
    holder: dict[str, KVStore | None] = {"store": make(tmp_path / "1", port=port)}

    def view() -> dict[str, Any]:  # the pod's HTTP: down while it restarts
        store = holder["store"]
        if store is None:
            raise ConnectionError("the pod is restarting")
        return snapshot(store, None)

    first = holder["store"]
    assert first is not None
    first.store(A, kv_for(first, 12, seed=1), tenant="bob")
    index = PrefixIndex(BT)
    sub = closing(Subscriber(index, replay_timeout=0.3, resync_s=0.2))
    pub = publisher_of(first)
    sub.add(pub.endpoint, pub.replay_endpoint, view, pod="pod")
    assert wait_until(lambda: index.score(A) == {"pod": 12.0} and sub.stats()["messages"] > 0)
    resyncs = sub.stats()["resyncs"]
    assert wait_until(lambda: sub.stats()["resyncs"] > resyncs)  # a floor above what was taken
    floor = pub.next_seq("kv@pod@tiny")
    holder["store"] = None
    first.close()
    real = time.time_ns
    monkeypatch.setattr(
        assembly, "time", types.SimpleNamespace(time_ns=lambda: real() - 3600 * 10**9)
    )
    second = closing(make(tmp_path / "2", port=port))  # the clock stepped back an hour
    monkeypatch.undo()
    assert publisher_of(second).first_seq < floor
    second.store(B, kv_for(second, 12, seed=2), tenant="bob")
    assert wait_until(lambda: index.score(B) == {"pod": 12.0} and index.score(A) == {})
    index.check()


def test_a_removed_pod_is_forgotten_and_can_be_added_again_elsewhere(
    tmp_path: Path, closing: Any
) -> None:
    """Finding 3: before, there was no `remove`, the same pod at a new address was refused as
    already claimed, and its old life's blocks kept scoring."""
    first = make(tmp_path / "1")
    index = PrefixIndex(BT)
    sub = closing(Subscriber(index))
    pub = publisher_of(first)
    sub.add(pub.endpoint, pub.replay_endpoint, pod="pod")
    first.store(A, kv_for(first, 12, seed=1), tenant="bob")
    assert wait_until(lambda: index.score(A) == {"pod": 12.0})
    first.close()
    sub.remove("pod")
    assert wait_until(lambda: index.score(A) == {})
    with pytest.raises(ValueError, match="'pod'"):
        sub.remove("pod")
    second = closing(make(tmp_path / "2"))  # empty, at another address
    pub = publisher_of(second)
    sub.add(pub.endpoint, pub.replay_endpoint, pod="pod")
    second.store(B, kv_for(second, 12, seed=2), tenant="bob")
    assert wait_until(lambda: index.score(B) == {"pod": 12.0})
    assert index.score(A) == {}
    index.check()


def test_an_address_that_closes_each_connection_is_reopened_with_a_backoff(
    closing: Any,
) -> None:
    """Finding 4: before, the SUB was reopened at once each time: 8,000 reopens in 3 s and more
    than a core of CPU."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    stop = threading.Event()

    def refuse() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.close()

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    try:
        sub = closing(Subscriber(PrefixIndex(BT)))
        before = resource.getrusage(resource.RUSAGE_SELF)
        sub.add(f"tcp://127.0.0.1:{listener.getsockname()[1]}", pod="gone")
        time.sleep(2.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        # 0.05 s doubling: 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s, so about 5 reopens in 2 s
        assert 1 <= sub.stats()["disconnects"] <= 10
        # and no spin while the SUB is closed (ZMQ's poll of no socket returns at once)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        assert cpu < 0.5, cpu
    finally:
        stop.set()
        thread.join()
        listener.close()


class SilentReplay:
    """A replay ROUTER that never answers: the subscriber's thread waits `replay_timeout`."""

    def __init__(self, ctx: Any) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def close(self) -> None:
        self.socket.close(linger=0)


def test_a_flood_while_the_thread_waits_is_bounded_by_the_queue(closing: Any) -> None:
    """Finding 5: before, the SUB kept ZMQ's default 1000 messages unread (at 64 MiB each,
    64 GiB): all 200 messages a flooder sent while the thread waited on a replay were held
    and taken. Now `max_queue_bytes` (1 MiB: 4 messages of 256 KiB) bounds them; what the
    flooder's own queue (20) and the kernel's socket buffers hold comes on top."""
    ctx = zmq.Context()
    closing(types.SimpleNamespace(close=lambda: ctx.destroy(linger=0)))
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 20)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay = closing(SilentReplay(ctx))
    size = 256 << 10
    sub = closing(
        Subscriber(
            PrefixIndex(BT), replay_timeout=1.5, max_message_bytes=2 * size,
            max_queue_bytes=1 << 20,
        )
    )  # fmt: skip
    sub.add(f"tcp://127.0.0.1:{port}", replay.endpoint, pod="evil")
    topic, empty = b"kv@evil@m", msgpack.packb([0.0, [], None])
    cleared = msgpack.packb([0.0, [["AllBlocksCleared"]], None])
    assert wait_until(  # joined: the first message is taken
        lambda: (
            pub.send_multipart([topic, (0).to_bytes(8, "big"), cleared]) or sub.applied("kv@evil@m")
        )
    )
    pub.send_multipart([topic, (5).to_bytes(8, "big"), empty])  # a gap: the replay waited on
    time.sleep(0.2)
    junk = empty + b"\x00" * (size - len(empty))
    for seq in range(6, 206):  # paced: the flooder's own queue never fills before the router's
        pub.send_multipart([topic, seq.to_bytes(8, "big"), junk])
        time.sleep(0.004)
    time.sleep(1.0)  # the replay's timeout, then what was queued is taken
    taken = sub.stats()["messages"] - 2
    assert taken < 100, taken


def test_a_tenants_score_counts_its_own_topics_only(tmp_path: Path, closing: Any) -> None:
    """Finding 6: before, `score` took no tenant: alice's request went to pod1, where only
    bob's copy of the prompt is (her namespace there holds none of it)."""
    index = PrefixIndex(BT)
    sub = closing(Subscriber(index))
    stores = {}
    for pod in ("pod1", "pod2"):
        stores[pod] = store = closing(make(tmp_path / pod, pod=pod, per_tenant=True))
        sub.add(publisher_of(store).endpoint, publisher_of(store).replay_endpoint, pod=pod)
    stores["pod1"].store(A, kv_for(stores["pod1"], 12, seed=1), tenant="bob")
    stores["pod2"].store(A[:4], kv_for(stores["pod2"], 4, seed=1), tenant="alice")
    assert wait_until(lambda: index.score(A) == {"pod1": 12.0, "pod2": 4.0})
    assert index.score(A, tenant="alice") == {"pod2": 4.0}
    assert index.score(A, tenant="bob") == {"pod1": 12.0}
    assert Router(["pod1", "pod2"], "prefix", index).choose(A, tenant="alice") == "pod2"
    assert Router(["pod1", "pod2"], "prefix", index).choose(A, tenant="bob") == "pod1"


def test_on_a_shared_topic_a_tenants_score_counts_every_tenants_copy(
    tmp_path: Path, closing: Any
) -> None:
    """Finding 6, the limit documented: a topic tenants share names no tenant, so the scorer
    cannot tell bob's copy from alice's."""
    store = closing(make(tmp_path))
    index = PrefixIndex(BT)
    sub = closing(Subscriber(index))
    sub.add(publisher_of(store).endpoint, publisher_of(store).replay_endpoint, pod="pod")
    store.store(A, kv_for(store, 12, seed=1), tenant="bob")
    assert wait_until(lambda: index.score(A) == {"pod": 12.0})
    assert index.score(A, tenant="alice") == {"pod": 12.0}
