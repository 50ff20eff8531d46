"""A router's resync from a real `kvtier serve` (`GET /v1/blocks`): the snapshot holds every
block as KV events with each topic's sequence number, a tenant's key is refused a topic
tenants share, a subscriber that cannot replay what it missed rebuilds the pod from the snapshot and
follows the live events from there, and a store without events refuses the route."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import yaml
from conftest import kv_for
from service_server import ADMIN_KEY, BT, Server, free_port, kv_of, running, write_config

from kvtier.client import Client, ServiceError
from kvtier.routing import PrefixIndex, Subscriber

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-9876543210"
TOPIC = "kv@pod-1@tiny"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    config = write_config(
        tmp_path, tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
    )
    document = yaml.safe_load(config.read_text())
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    document["events"] = {"endpoint": endpoint, "topic": TOPIC}  # no replay endpoint
    config.write_text(yaml.safe_dump(document))
    with running(config) as live:
        yield live, endpoint


def tokens_held(events: bytes) -> set[int]:
    """Every token of every BlockStored in an event batch, read by field position."""
    _ts, batch, _rank = msgpack.unpackb(events)
    return {t for event in batch if event[0] == "BlockStored" for t in event[3]}


def wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(predicate())


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_router_rebuilds_a_pod_from_its_snapshot_and_follows_it_from_there(
    server: tuple[Server, str],
) -> None:
    live, endpoint = server
    prompt_a, prompt_b = list(range(100, 116)), list(range(500, 512))  # 4 and 3 blocks
    with Client(live.url, api_key=KEY_A, shared_memory=False) as a:
        a.store(prompt_a, kv_of(16, seed=1))
    with Client(live.url, api_key=KEY_B, shared_memory=False) as b:
        b.store(prompt_b, kv_of(12, seed=2))
    admin = Client(live.url, api_key=ADMIN_KEY, shared_memory=False)
    snap = admin.blocks()
    assert snap["block_size"] == BT and [t["topic"] for t in snap["topics"]] == [TOPIC]
    assert snap["topics"][0]["seq"] >= 1  # the stores' events were sent before it
    assert tokens_held(snap["topics"][0]["events"]) == {*prompt_a, *prompt_b}
    # the topic is shared: a's part of it is no snapshot of it (`test_routing_audit2.py`)
    refused = pytest.raises(ServiceError, match=r"403 forbidden.*per_tenant_topic")
    with Client(live.url, api_key=KEY_A, shared_memory=False) as a, refused:
        a.blocks()

    # a router joining now has missed everything, and there is no replay endpoint to ask
    index = PrefixIndex(BT)
    sub = Subscriber(index)
    sub.add(endpoint, None, admin.blocks)
    time.sleep(0.3)  # the subscription reaches the PUB
    longer = [*prompt_a, 7, 8, 9, 10]
    with Client(live.url, api_key=KEY_A, shared_memory=False) as a:
        a.store(longer, kv_of(20, seed=3))  # the message that shows the gap
    assert wait_until(lambda: index.score(longer) == {"pod-1": 20.0})
    # from the join's retell, which starts with AllBlocksCleared (`EventPublisher._retell`),
    # or from the snapshot when the store's own message came first and showed the gap
    assert index.score(prompt_b) == {"pod-1": 12.0}
    stats = sub.stats()
    assert stats["gaps"] >= 1 and stats["resets"] == 0
    # from there on, the live events: a clear forgets a's blocks
    live.admin("/v1/admin/clear", params={"tenant": "a"})
    assert wait_until(lambda: index.score(longer) == {})
    assert index.score(prompt_b) == {"pod-1": 12.0}
    index.check()
    sub.close()
    events = admin.status()["events"]
    assert events["topic"] == TOPIC and events["messages"] >= 3  # three stores, a clear
    assert (events["dropped_events"], events["unsynced_topics"], events["resyncs"]) == (0, 0, 0)
    admin.close()
    done = subprocess.run(  # what an SRE reads
        [sys.executable, "-m", "kvtier.cli", "status", "--url", live.url, "--key", ADMIN_KEY],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[-1]
    assert line.startswith("events: ") and f"on {TOPIC}, 0 dropped (full queue)" in line, line


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_the_route_needs_msgpack_and_a_store_that_publishes_events(tmp_path: Path) -> None:
    with running(write_config(tmp_path)) as live:
        headers = {"authorization": f"Bearer {ADMIN_KEY}", "content-type": "application/msgpack"}
        refused = live.get("/v1/blocks", headers=headers)
        assert refused.status_code == 400
        assert "publishes no events" in msgpack.unpackb(refused.content)["detail"]


def test_a_periodic_resync_repairs_what_drifted_unseen(tmp_path: Path) -> None:
    """In process: a real store with events, its snapshot function called by the subscriber
    every 0.2 s; the router's view of the pod, wiped behind its back, comes back."""
    from test_events_store import make

    from kvtier.events.observer import snapshot

    store = make(tmp_path)
    publisher = store.parts.events
    assert publisher is not None
    prompt = list(range(40, 52))
    store.store(prompt, kv_for(store, 12, seed=1), tenant="alice")
    index = PrefixIndex(store.block_tokens)
    sub = Subscriber(index, resync_s=0.2)
    sub.add(publisher.endpoint, publisher.replay_endpoint, lambda: snapshot(store, None))
    assert wait_until(lambda: index.score(prompt) == {"pod": 12.0}, 15.0)
    before = sub.stats()["resyncs"]
    index.clear("kv@pod@tiny")  # drift: the router lost the pod's blocks unseen
    # the subscriber's thread resyncs every 0.2 s: one may land between the clear and this look
    assert index.score(prompt) == {} or sub.stats()["resyncs"] > before
    assert wait_until(
        lambda: index.score(prompt) == {"pod": 12.0} and sub.stats()["resyncs"] > before, 15.0
    )
    index.check()
    sub.close()
    store.close()


def test_a_snapshot_numbers_every_event_of_the_calls_before_it_below_its_seq(
    tmp_path: Path,
) -> None:
    """The publisher's thread sends every 5 ms; a snapshot taken right after a store must not
    leave that store's events at or above its `seq` (the router would replay them again, and
    a test reading `seq` would race the thread)."""
    from test_events_store import make

    from kvtier.events.observer import snapshot

    store = make(tmp_path)
    publisher = store.parts.events
    assert publisher is not None
    for i in range(20):
        before = publisher.sent()
        prompt = list(range(100 + 16 * i, 116 + 16 * i))
        store.store(prompt, kv_for(store, 16, seed=i), tenant="alice")
        snap = snapshot(store, None)
        assert snap["topics"][0]["seq"] > before
        assert len(publisher.pending) == 0
    store.check()
    store.close()
