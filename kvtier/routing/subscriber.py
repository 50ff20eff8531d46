"""A thread that keeps a `PrefixIndex` fed from any number of KV-event publishers (kvtier's or
vLLM's), and recovers what it missed.

`Subscriber(index)`, then `add(endpoint, replay_endpoint=None)` per publisher: one SUB socket
each (so that a message's publisher is known), subscribed to every topic. Per topic the last
sequence number applied is kept:
- the next number: applied;
- a number past it (a gap: messages lost, or a topic first heard of after its start): the
  publisher's replay endpoint is asked for everything from the first one missed, and what it
  returns in the gap is applied before the message that showed the gap. When it cannot fill
  the gap (no replay endpoint, no answer within `replay_timeout`, or the buffer has moved past
  it), the topic's blocks are forgotten (`PrefixIndex.clear`) before going on, since a removal
  may be among the lost: a router that under-counts a pod is safe, one that believes a pod
  holds what it dropped is not; counted as `resets`;
- a number at or below it (a publisher restarted: numbers start again from 0): the topic's
  blocks are forgotten, then the message applied.

The first message of a topic is a gap from 0 unless it is number 0.

`wait(topic, count, timeout)` returns once `count` messages of `topic` are applied (a replay
routing on events waits for the store it just used). `close()` stops the thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import zmq

from kvtier.routing.index import BadEvent, PrefixIndex

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class _Publisher:
    socket: zmq.Socket[bytes]
    replay_endpoint: str | None


class Subscriber:
    def __init__(self, index: PrefixIndex, replay_timeout: float = 2.0) -> None:
        self.index, self.replay_timeout = index, replay_timeout
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._publishers: list[_Publisher] = []
        self._added: list[tuple[str, str | None]] = []
        self._applied: dict[str, int] = {}  # topic -> messages applied (its next number)
        self._cond = threading.Condition()
        self._stats = {"messages": 0, "gaps": 0, "replayed": 0, "resets": 0, "bad": 0}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvtier-route-sub", daemon=True)
        self._thread.start()

    def add(self, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Subscribe to the publisher at `endpoint` (its replay ROUTER at `replay_endpoint`)."""
        with self._cond:
            self._added.append((endpoint, replay_endpoint))

    def applied(self, topic: str) -> int:
        with self._cond:
            return self._applied.get(topic, 0)

    def wait(self, topic: str, count: int, timeout: float = 5.0) -> bool:
        """Wait until `count` messages of `topic` are applied; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._applied.get(topic, 0) >= count, timeout)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return dict(self._stats)

    def close(self) -> None:
        self._stopping = True
        self._thread.join(timeout=10)
        self._context.destroy(linger=0)

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket[bytes], _Publisher] = {}
        while not self._stopping:
            with self._cond:
                added, self._added = self._added, []
            for endpoint, replay_endpoint in added:
                sub = self._context.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoint)
                by_socket[sub] = _Publisher(sub, replay_endpoint)
                poller.register(sub, zmq.POLLIN)
            for sock, _ in poller.poll(20):
                publisher = by_socket[sock]
                while publisher.socket.poll(0):
                    self._receive(publisher, publisher.socket.recv_multipart())

    def _receive(self, publisher: _Publisher, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count("bad")
            return
        try:
            topic = frames[0].decode()
        except UnicodeDecodeError:
            self._count("bad")
            return
        seq = int.from_bytes(frames[1], "big")
        expected = self.applied(topic)
        if seq < expected:  # numbers started again: the publisher restarted
            self._count("resets")
            self.index.clear(topic)
            self._set(topic, 0)
            expected = 0
        if seq > expected:
            self._count("gaps")
            if not self._fill(publisher, topic, expected, seq):
                self._count("resets")
                self.index.clear(topic)
        self._apply(topic, seq, frames[2])

    def _fill(self, publisher: _Publisher, topic: str, start: int, stop: int) -> bool:
        """Apply messages start..stop-1 of `topic` from the replay endpoint; all of them?"""
        if publisher.replay_endpoint is None:
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big"), topic.encode()])
            got: dict[int, bytes] = {}
            while dealer.poll(int(self.replay_timeout * 1000)):
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8 or frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big")
                if frames[1] == topic.encode() and start <= seq < stop:
                    got[seq] = frames[3]
        finally:
            dealer.close()
        complete = len(got) == stop - start
        if complete:
            for seq in range(start, stop):
                self._apply(topic, seq, got[seq])
            self._count("replayed", stop - start)
        return complete

    def _apply(self, topic: str, seq: int, payload: bytes) -> None:
        try:
            self.index.apply(topic, payload)
        except BadEvent:
            self._count("bad")
        self._count("messages")
        self._set(topic, seq + 1)

    def _set(self, topic: str, applied: int) -> None:
        with self._cond:
            self._applied[topic] = applied
            self._cond.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._stats[name] += n
