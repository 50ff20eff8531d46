"""One publisher's SUB socket as a router's subscriber holds it (`subscriber.py`): bounded, and
opened again after a disconnection, with a backoff.

`Link(context, endpoint, max_message_bytes, max_queue_bytes)`; `open()` makes a SUB connected
to `endpoint`, subscribed to every topic, and the monitor socket that tells of its
disconnections (`socket`, `monitor`; None while closed). `Watch` polls the links of a
subscriber's thread.

Bounds. ZMQ refuses a frame past `max_message_bytes` before it is buffered, and keeps at most
`max_queue_bytes // max_message_bytes` messages unread (`RCVHWM`, 1 at least): past that it
stops reading the connection, and the publisher's own queue drops what follows (a gap to the
subscriber, recovered as any other). What one publisher can make the router hold unread is so
about `max_queue_bytes` plus one message being read (and the kernel's socket buffer), whatever
it sends: ZMQ's default, 1000 messages, let one that sends only long messages queue 1000 of
them (64 GiB at the former 64 MiB frame bound).

Reopening (`lost`, `due`). ZMQ connects again by itself after a network error, but not after
a protocol error such as a frame past `max_message_bytes`, and a publisher that sent one long
message must not go unheard from then on. So a disconnected SUB is closed and a new one
opened: at once if the connection lasted `delay` seconds (a publisher restarted: its first
messages are not missed), else `delay` seconds later (`due`), the delay doubling then up to
`MAX_DELAY`; it starts at `MIN_DELAY`, and goes back to it once a message arrives (`heard`).
An address that accepts connections and closes them at once (a pod going away, a half-dead
peer) so costs a reopen every `MAX_DELAY` seconds, where a reopen at once each time spun a core
(8,000 in 3 s), and one that keeps each connection longer, a reopen every `MIN_DELAY` at most.
A new socket rather
than a second `connect` on the old one: that would hold two connections to a publisher that ZMQ
did reconnect, and take each message twice.
"""

from __future__ import annotations

import time
from typing import Generic, TypeVar

import zmq

from kvtier.events.peers import allow_ipv6

MIN_DELAY = 0.05
MAX_DELAY = 3.2
T = TypeVar("T")


class Link:
    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        max_message_bytes: int,
        max_queue_bytes: int,
    ) -> None:
        self.context, self.endpoint = context, endpoint
        self.max_message_bytes = max_message_bytes
        self.hwm = max(1, max_queue_bytes // max_message_bytes)
        self.socket: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.delay = MIN_DELAY  # before the next reopen
        self.reopen_at = 0.0  # while closed: when `due`
        self.opened_at = 0.0

    def open(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """Open the SUB and its monitor (module doc); closed before. `zmq.ZMQError`, both
        closed again, when ZMQ refuses the address."""
        assert self.socket is None and self.monitor is None
        sub = self.context.socket(zmq.SUB)
        allow_ipv6(sub, self.endpoint)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.RCVHWM, self.hwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket, self.monitor = sub, monitor
        self.opened_at = time.monotonic()  # a refusal is a connection that lasted nothing
        try:
            sub.connect(self.endpoint)
        except zmq.ZMQError:  # an address ZMQ refuses (`tcp://..:5`): closed, for `lost`
            self.close()
            raise
        return sub, monitor

    def close(self) -> None:
        """Close the SUB and its monitor, if open."""
        if self.socket is not None and self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.socket.close(linger=0)
        self.socket = self.monitor = None

    def lost(self) -> None:
        """The SUB lost its connection: closed, to be opened again at once if it lasted
        `delay`, else in `delay` seconds, and the delay after that doubled (module doc)."""
        self.close()
        now = time.monotonic()
        if now - self.opened_at >= self.delay:
            self.reopen_at = now
        else:
            self.reopen_at = now + self.delay
            self.delay = min(MAX_DELAY, self.delay * 2)

    def heard(self) -> None:
        """A message arrived: the next disconnection is reopened after `MIN_DELAY`."""
        self.delay = MIN_DELAY

    def due(self, now: float) -> bool:
        """Closed after `lost`, and time to open again?"""
        return self.socket is None and now >= self.reopen_at


class Watch(Generic[T]):
    """The subscriber thread's poller over its links' sockets, each mapped to its owner."""

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.owners: dict[zmq.Socket[bytes], T] = {}  # a SUB, or its monitor -> its owner

    def add(self, link: Link, owner: T) -> bool:
        """Poll `link`'s sockets, opened now, for `owner`; False when ZMQ refused the address
        (`link` is then `lost`: opened again after its backoff, and the thread goes on)."""
        try:
            sockets = link.open()
        except zmq.ZMQError:
            link.lost()
            return False
        for sock in sockets:
            self.owners[sock] = owner
            self.poller.register(sock, zmq.POLLIN)
        return True

    def drop(self, link: Link) -> None:
        """Stop polling `link`'s sockets, and close them."""
        for sock in (link.socket, link.monitor):
            if sock is not None and self.owners.pop(sock, None) is not None:
                self.poller.unregister(sock)
        link.close()

    def ready(self, timeout_ms: int) -> list[tuple[zmq.Socket[bytes], T]]:
        """The sockets with something to read within `timeout_ms`, and their owners: look
        each one up again (`owners`) if an earlier one's handling may have dropped it. With
        none to poll, a sleep: ZMQ's poll of nothing returns at once (a spinning thread)."""
        if not self.owners:
            time.sleep(timeout_ms / 1000)
            return []
        return [(sock, self.owners[sock]) for sock, _ in self.poller.poll(timeout_ms)]
