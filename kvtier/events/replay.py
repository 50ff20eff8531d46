"""The replay endpoint of an `EventPublisher` (vLLM's protocol): `Backlog`, the last messages of
each topic, and `ReplayServer`, the ROUTER that serves them, a little at a time, from the
publisher's thread.

A client (DEALER) sends `[b"", start_seq]` (8 bytes, big-endian), or `[b"", start_seq, topic]`,
and gets `[b"", topic, seq, payload]` for each message of that topic (default: the publisher's)
buffered when it asked, from `start_seq` on, then the end marker `[b"", b"", -1 (8 bytes,
signed), b""]`. Anyone who can connect may send, and may never read; so:

- a request is one frame of `MAX_REQUEST` bytes at most, or ZMQ drops the peer (`MAXMSGSIZE`;
  ZMQ bounds frames, not their number: a peer can still make ZMQ buffer a message of endless
  small frames, which only keeping the endpoint from untrusted peers prevents);
- a request costs O(1), whatever its numbers: it opens a replay, a cursor on the backlog. A
  connection's replays go one after another, in the order asked; at most `MAX_REPLAYS` are open
  (a new one ends the oldest, whoever asked it), and one that sends nothing for `STALL_S` ends;
- a turn takes every request that came, for `TAKE_S` at most, and opens a replay for each;
  past a connection's first `REPEATS_ANSWERED` requests in the turn (a flood), a request it
  repeated in that turn (the same start and topic) is answered once: a flood is read as fast
  as ZMQ hands it over, not a few hundred a turn (50 flooding connections kept a router's
  replay unanswered 10 s after they stopped: 0.1 s now, 4 s when each request differs), and
  a client that asks the same twice, a few times, is answered each time;
- ZMQ queues at most `REQUEST_HWM` requests of a connection unread (`RCVHWM`; ZMQ's default,
  1,000 a connection, let 200 connections that never read take a sidecar from 260 to 1,388 MiB
  in 10 s), and at most `REPLY_HWM` messages for a connection (`SNDHWM`, `ROUTER_MANDATORY`): a
  reply that does not fit stays in its replay and goes at a later turn, so a peer that never
  reads costs that many messages however often it asks, and a peer that reads late still gets
  every message and the end marker (a ROUTER otherwise drops what passes its high-water mark,
  end marker included). A payload goes out without a copy, the backlog's own bytes, and ZMQ
  holds it until it is on the wire: one that left the backlog meanwhile lives on. So replies ZMQ
  holds are bounded across all connections too: at most `QUEUED_BYTES` of payload (a message
  queued for several counted once; one message at least); past it no replay sends until ZMQ lets
  some go (a peer reads, or is gone). Peers that connect and never read can hold that budget,
  and then a router's replay times out (it falls back to a snapshot, `kvtier.routing`): memory
  stays bounded, replay does not stay available to untrusted peers;
- the messages a replay sends follow each other without a gap: one that left the backlog
  before its turn ends the replay there, with the end marker, and the client asks again.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvtier.events.peers import allow_ipv6

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REQUEST = 4096  # bytes of one frame of a replay request (a topic name at most)
REPLY_HWM = 32  # messages queued for one connection at most
REQUEST_HWM = 16  # requests of one connection ZMQ keeps unread at most
QUEUED_BYTES = 64 << 20  # payload bytes ZMQ holds for all connections at most (module doc)
MAX_REPLAYS = 16  # replays open at once
TAKE_S = 0.005  # the longest one turn takes requests for
REPEATS_ANSWERED = 16  # a connection's requests in a turn each answered, repeats included
STALL_S = 10.0  # a replay that could send nothing for this long ends
BUSY_S = 0.001  # how soon the next turn comes while replays are moving


class Backlog:
    """The last messages of each topic: at most `messages` of them and `max_bytes` of payload
    per topic (the last one whatever its size). Safe to use from any thread."""

    def __init__(self, messages: int, max_bytes: int) -> None:
        self.messages, self.max_bytes = messages, max_bytes
        self._kept: dict[str, collections.deque[bytes]] = {}
        self._first: dict[str, int] = {}  # sequence number of each topic's oldest kept message
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, topic: str, seq: int, payload: bytes) -> None:
        """Keep message `seq` of `topic`, the one after the last kept (numbers follow each
        other), and forget the oldest past the bounds."""
        with self._lock:
            kept = self._kept.setdefault(topic, collections.deque())
            first = self._first.setdefault(topic, seq)
            assert seq == first + len(kept), (topic, seq, first, len(kept))
            kept.append(payload)
            size = self._bytes.get(topic, 0) + len(payload)
            while len(kept) > self.messages or (size > self.max_bytes and len(kept) > 1):
                size -= len(kept.popleft())
                first += 1
            self._first[topic], self._bytes[topic] = first, size

    def span(self, topic: str) -> range:
        """The sequence numbers of `topic`'s kept messages (none for a topic never sent)."""
        with self._lock:
            first = self._first.get(topic, 0)
            return range(first, first + len(self._kept.get(topic, ())))

    def get(self, topic: str, seq: int) -> bytes | None:
        """The payload of message `seq` of `topic`, or None when it is not kept."""
        with self._lock:
            kept = self._kept.get(topic)
            at = seq - self._first.get(topic, 0)
            return kept[at] if kept is not None and 0 <= at < len(kept) else None


@dataclass(frozen=True)
class Turn:
    requests: int  # replay requests taken (each well formed)
    served: int  # replays answered in full: their end marker sent


@dataclass
class _Replay:
    client: bytes  # the connection's routing id
    topic: str
    seq: int  # the next message to send
    stop: int  # one past the last to send: the last kept when asked
    since: float  # when it last sent
    ended: bool = False


class ReplayServer:
    """A ROUTER bound at `endpoint` serving `backlog` (module doc); `topic` is the one a request
    without a topic asks for. Used from one thread: the publisher's, through `turn`."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        backlog: Backlog,
        topic: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backlog, self.topic, self.clock = backlog, topic, clock
        self.socket = context.socket(zmq.ROUTER)
        allow_ipv6(self.socket, endpoint)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST)
        self.socket.setsockopt(zmq.SNDHWM, REPLY_HWM)
        self.socket.setsockopt(zmq.RCVHWM, REQUEST_HWM)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue says so (never blocks)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replays: list[_Replay] = []  # oldest first
        self._moving = False  # the last turn sent something
        self.served = 0  # replays whose end marker was sent
        self._held: list[tuple[zmq.MessageTracker, bytes]] = []  # payloads ZMQ holds (kept
        self._sizes: dict[int, int] = {}  # alive here, so ids stay theirs): id -> size, each once
        self.held_bytes = 0  # their sum

    def turn(self, wait_s: float) -> Turn:
        """Wait up to `wait_s` for requests (`BUSY_S` while replays are moving), take those that
        came (for `TAKE_S` at most), open a replay for each (once for a request a flooding
        connection repeated in the turn: module doc), and send each open replay what its
        connection takes; what the turn took and served."""
        wait = min(wait_s, BUSY_S) if self._moving else wait_s
        taken, served = 0, self.served
        if self.socket.poll(max(1, int(wait * 1000))):
            asked: list[tuple[bytes, ...]] = []  # in the order asked
            seen: set[tuple[bytes, ...]] = set()
            per: dict[bytes, int] = {}  # requests taken in this turn, by connection
            end = time.monotonic() + TAKE_S
            while time.monotonic() < end:
                try:
                    frames = self.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) in (3, 4) and len(frames[2]) == 8:  # else no request: no answer
                    request, taken = tuple(frames), taken + 1
                    per[frames[0]] = count = per.get(frames[0], 0) + 1
                    if count <= REPEATS_ANSWERED or request not in seen:  # a flood's repeats:
                        seen.add(request)  # answered once
                        asked.append(request)
            for request in asked:
                self._open(request)
        self._moving = self._pump()
        return Turn(taken, self.served - served)

    def close(self) -> None:
        self.socket.close()

    def _open(self, frames: tuple[bytes, ...]) -> None:
        """Open the replay `frames` ask for (a request: `turn` checked its shape)."""
        client, start = frames[0], int.from_bytes(frames[2], "big")
        topic = frames[3].decode(errors="replace") if len(frames) == 4 else self.topic
        span = self.backlog.span(topic)
        if len(self._replays) >= MAX_REPLAYS:
            del self._replays[0]
        self._replays.append(
            _Replay(client, topic, max(start, span.start), span.stop, self.clock())
        )

    def _pump(self) -> bool:
        """Send each connection's first open replay what the connection takes, `REPLY_HWM`
        messages at most; close the replays that ended, lost their peer or stalled; did any
        send?"""
        now, moving, busy = self.clock(), False, set()
        self._release()
        for replay in list(self._replays):
            if replay.client in busy:  # waits for the one asked before it
                replay.since = now
                continue
            if self._send(replay):
                replay.since, moving = now, True
            if replay.ended or now - replay.since > STALL_S:
                self._replays.remove(replay)
            else:
                busy.add(replay.client)
        return moving

    def _release(self) -> None:
        """Forget the payloads ZMQ let go of (`QUEUED_BYTES`)."""
        self._held = [(tracker, payload) for tracker, payload in self._held if not tracker.done]
        self._sizes = {id(payload): len(payload) for _, payload in self._held}
        self.held_bytes = sum(self._sizes.values())

    def _send(self, replay: _Replay) -> int:
        """Send what its connection's queue takes of `replay`, then its end marker; how many
        sent."""
        client = replay.client
        sent = 0
        try:
            while sent < REPLY_HWM and replay.seq < replay.stop:
                payload = self.backlog.get(replay.topic, replay.seq)
                if payload is None:  # it left the backlog: end here, without a gap
                    replay.stop = replay.seq
                    break
                new = id(payload) not in self._sizes  # else already counted
                if new and self._held and self.held_bytes + len(payload) > QUEUED_BYTES:
                    return sent  # the rest once ZMQ lets some go (module doc)
                head = (client, b"", replay.topic.encode(), replay.seq.to_bytes(8, "big"))
                # never copied, and once sent held by ZMQ alone: done when ZMQ lets it go
                tracker = self.socket.send_multipart(
                    (*head, zmq.Frame(payload, copy=False, track=True)), zmq.NOBLOCK, copy=False
                )
                assert tracker is not None
                self._held.append((tracker, payload))
                if new:
                    self._sizes[id(payload)] = len(payload)
                    self.held_bytes += len(payload)
                replay.seq += 1
                sent += 1
            if replay.seq >= replay.stop:
                self.socket.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
                replay.ended = True
                self.served += 1
        except zmq.Again:
            pass  # the connection's queue is full: the rest at a later turn
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            replay.ended = True  # its peer is gone
        return sent
