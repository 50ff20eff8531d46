"""The second routing audit's findings, against real sidecars (`service_server.py`) and a real
`Subscriber` and `PrefixIndex`:

- F1: a router cut off from its pod (a TCP forwarder in between, stopped) while the pod is
  SIGKILLed and restarts empty must not splice the new life's replay onto the old life's
  numbers: the old blocks are forgotten (a store numbers each life from its start, in µs:
  `EventPublisher`, Incarnations; a replay that does not begin where it was asked is never
  spliced: `kvtier/routing/subscriber.py`);
- F2: after a snapshot resync set the topic's floor, a restarted pod's messages are not
  swallowed as "reflected by the snapshot" (a kvtier store's retell to a joined router now
  starts with AllBlocksCleared, which needs no snapshot: here the floor is set only when a
  store's message reaches the router before that retell);
- F3: one message of millions of empty arrays (under `max_message_bytes`) costs the router
  neither gigabytes nor a blocked `score()`: the decode is bounded (`reading.batch_events`);
- F4: a tenant key's `GET /v1/blocks` of a topic tenants share is refused (403): a router
  that resynced from it lost every other tenant's blocks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack  # type: ignore[import-untyped]
import pytest
import yaml
import zmq
from conftest import wait_until
from service_server import (
    ADMIN_KEY,
    BT,
    Server,
    free_port,
    kv_of,
    peak_rss_mib,
    reset_peak,
    start,
    tokens_of,
    write_config,
)

from kvtier.client import Client, ServiceError
from kvtier.routing import PrefixIndex, Subscriber

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-9876543210"
TENANTS = {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}}
TOPIC = "kv@pod-a@tiny"


def _config(tmp_path: Path, endpoint: int, replay: int | None, per_tenant: bool = False) -> Path:
    config = write_config(tmp_path, tenants=TENANTS)
    document = yaml.safe_load(config.read_text())
    document["events"] = {
        "endpoint": f"tcp://127.0.0.1:{endpoint}",
        "topic": TOPIC,
        "per_tenant_topic": per_tenant,
    }
    if replay is not None:
        document["events"]["replay_endpoint"] = f"tcp://127.0.0.1:{replay}"
    config.write_text(yaml.safe_dump(document))
    return config


def _store(server: Server, key: str, prompts: list[list[int]]) -> None:
    with Client(server.url, api_key=key, shared_memory=False) as client:
        for n, tokens in enumerate(prompts):
            client.store(tokens, kv_of(len(tokens), seed=n))
            time.sleep(0.02)  # a message each


@contextlib.contextmanager
def _stopping(*servers: Server) -> Iterator[None]:
    try:
        yield
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait()


class Forwarder:
    """127.0.0.1:port -> 127.0.0.1:target over TCP; `stop()` drops every connection and stops
    listening (a partition), `start()` listens again on the same port (it heals)."""

    def __init__(self, target: int) -> None:
        self.target, self.port = target, free_port()
        self.conns: list[socket.socket] = []
        self.listener: socket.socket | None = None

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(8)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                near, _ = listener.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                near.close()
                continue
            self.conns += [near, far]
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for sock in (a, b):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for sock in self.conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        self.conns = []


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_router_cut_off_while_its_pod_restarts_forgets_the_past_life(tmp_path: Path) -> None:
    """F1: before, the router expected number 2, heard the new life's number 7 first and filled
    2..6 from the new life's replay buffer: A and B stayed on pod-a for good."""
    events, replay, port = free_port(), free_port(), free_port()
    config = _config(tmp_path, events, replay)
    forwarder = Forwarder(events)
    forwarder.start()
    index = PrefixIndex(BT)
    sub = Subscriber(index)
    first = start(config, port=port)
    old, new = (
        [tokens_of(100, 12), tokens_of(200, 12)],
        [tokens_of(1000 * n, 8) for n in range(3, 9)],
    )
    with _stopping(first), contextlib.closing(sub):
        sub.add(f"tcp://127.0.0.1:{forwarder.port}", f"tcp://127.0.0.1:{replay}", pod="pod-a")
        time.sleep(0.5)  # the subscription reaches the PUB
        _store(first, KEY_A, old)
        assert wait_until(lambda: index.score(old[1]) == {"pod-a": 12.0}, 10)
        forwarder.stop()  # the partition
        first.process.kill()
        first.process.wait()
        second = start(config, port=port)  # the pod comes back empty
        with _stopping(second):
            _store(second, KEY_A, new)  # messages the router never sees
            forwarder.start()  # the partition heals: the store tells the joined router again
            assert wait_until(lambda: index.score(new[0]) == {"pod-a": 8.0}, 10)
            _store(second, KEY_A, [tokens_of(9000, 8)])
            assert wait_until(lambda: index.score(tokens_of(9000, 8)) == {"pod-a": 8.0}, 10)
            assert index.score(old[0]) == {} and index.score(old[1]) == {}  # the past life's
            assert sub.stats()["resets"] >= 1
            index.check()
    forwarder.stop()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_restarted_pod_is_not_swallowed_by_the_floor_of_an_earlier_snapshot(
    tmp_path: Path,
) -> None:
    """F2: before, the snapshot's floor (9) dropped the new life's numbers 0..3, its
    AllBlocksCleared among them, and the old blocks stayed scored."""
    events, port = free_port(), free_port()
    config = _config(tmp_path, events, None)  # no replay endpoint: a gap takes the snapshot
    first = start(config, port=port)
    old = [tokens_of(100 * (n + 1), 8) for n in range(10)]
    new = [tokens_of(5000 + 100 * n, 8) for n in range(3)]
    index = PrefixIndex(BT)
    sub = Subscriber(index)
    admin = Client(f"http://127.0.0.1:{port}", api_key=ADMIN_KEY, shared_memory=False)
    with _stopping(first), contextlib.closing(sub), contextlib.closing(admin):
        _store(first, KEY_A, old)
        sub.add(f"tcp://127.0.0.1:{events}", None, admin.blocks, pod="pod-a")
        # the store tells the joined router to forget, then every block (`_retell`): a gap
        # that message covers, or, when a store's message comes first, the snapshot fills
        assert wait_until(lambda: index.score(old[0]) == {"pod-a": 8.0}, 10)
        assert sub.stats()["gaps"] >= 1
        first.process.kill()
        first.process.wait()
        second = start(config, port=port)
        with _stopping(second):
            _store(second, KEY_A, new)
            assert wait_until(lambda: index.score(new[-1]) == {"pod-a": 8.0}, 10)
            assert wait_until(lambda: index.score(old[0]) == {}, 5), "the past life's blocks"
            assert all(index.score(tokens) == {} for tokens in old)
            index.check()


def test_a_message_of_millions_of_empty_arrays_costs_neither_memory_nor_a_blocked_score(
    tmp_path: Path,
) -> None:
    """F3: before, a 64 MiB message of empty arrays took the router from 376 MiB to 5 GiB and
    held `score()` for 23 s; here 6 Mi of them (6 MiB): refused from the array's header."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(BT)
    sub = Subscriber(index)
    try:
        sub.add(f"tcp://127.0.0.1:{port}", None, pod="pod-h")
        topic = "kv@pod-h@tiny"
        valid = msgpack.packb([1.0, [["BlockStored", [7], None, [1, 2, 3, 4], BT, None, "GPU"]]])
        assert wait_until(lambda: _sent(pub, topic, 0, valid, sub), 10)
        n = 6 << 20
        bomb = b"\x93" + msgpack.packb(1.0) + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n + b"\xc0"
        worst = 0.0
        done = threading.Event()

        def probe() -> None:
            nonlocal worst
            while not done.is_set():
                began = time.monotonic()
                index.score([1, 2, 3, 4])
                worst = max(worst, time.monotonic() - began)
                time.sleep(0.005)

        prober = threading.Thread(target=probe)
        reset_peak(os.getpid())
        before = peak_rss_mib(os.getpid())
        prober.start()
        pub.send_multipart([topic.encode(), (1).to_bytes(8, "big"), bomb])
        assert sub.wait(topic, 2, 60)
        done.set()
        prober.join()
        grown = peak_rss_mib(os.getpid()) - before
        assert sub.stats()["bad"] + index.stats()["bad"] >= 1  # counted and skipped
        assert grown < 200, f"the router grew by {grown:.0f} MiB for a 6 MiB message"
        assert worst < 0.5, f"a score waited {worst:.1f} s"
        chained = [["BlockStored", [8], 7, [5, 6, 7, 8], BT, None, "GPU"]]  # onto block 7
        pub.send_multipart([topic.encode(), (2).to_bytes(8, "big"), msgpack.packb([2.0, chained])])
        assert sub.wait(topic, 3, 10) and index.score([1, 2, 3, 4, 5, 6, 7, 8]) == {"pod-h": 8.0}
    finally:
        sub.close()
        pub.close(linger=0)
        ctx.term()


def _sent(pub: zmq.Socket[bytes], topic: str, seq: int, payload: bytes, sub: Subscriber) -> bool:
    """Send message `seq` until the subscriber has it (ZMQ drops what precedes a join)."""
    pub.send_multipart([topic.encode(), seq.to_bytes(8, "big"), payload])
    return sub.wait(topic, seq + 1, 0.1)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_tenant_keys_snapshot_of_a_shared_topic_is_refused_and_keeps_the_others_blocks(
    tmp_path: Path,
) -> None:
    """F4: before, a router resyncing from a tenant key's snapshot (README's own example) reset
    the shared topic to that tenant's blocks: every other tenant's vanished from it."""
    events = free_port()
    server = start(_config(tmp_path / "shared", events, None))
    index = PrefixIndex(BT)
    sub = Subscriber(index, resync_s=0.3)
    a = Client(server.url, api_key=KEY_A, shared_memory=False)
    with _stopping(server), contextlib.closing(sub), contextlib.closing(a):
        with pytest.raises(ServiceError, match=r"403 forbidden.*per_tenant_topic"):
            a.blocks()
        sub.add(f"tcp://127.0.0.1:{events}", None, a.blocks, pod="pod-a")
        time.sleep(0.5)  # the subscription joins
        prompt_a, prompt_b = tokens_of(100, 12), tokens_of(500, 12)
        _store(server, KEY_A, [prompt_a])
        _store(server, KEY_B, [prompt_b])
        assert wait_until(lambda: index.score(prompt_b) == {"pod-a": 12.0}, 10)
        assert wait_until(lambda: sub.stats()["resync_errors"] >= 2, 10)  # resyncs refused
        assert index.score(prompt_b) == {"pod-a": 12.0}  # b's blocks kept
        assert index.score(prompt_a) == {"pod-a": 12.0}

    # per-tenant topics: a tenant's snapshot is its own topic whole
    server = start(_config(tmp_path / "per-tenant", free_port(), None, per_tenant=True))
    with _stopping(server):
        _store(server, KEY_A, [tokens_of(100, 12)])
        _store(server, KEY_B, [tokens_of(500, 12)])
        with Client(server.url, api_key=KEY_A, shared_memory=False) as mine:
            snap = mine.blocks()
        assert [entry["topic"] for entry in snap["topics"]] == [f"{TOPIC}@a"]
        _ts, told, _rank = msgpack.unpackb(snap["topics"][0]["events"])
        held = {t for event in told if event[0] == "BlockStored" for t in event[3]}
        assert held == set(tokens_of(100, 12))
