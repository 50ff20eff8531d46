"""The publisher's sockets and the peers that join them (`publisher.py`, `replay.py`).

- `allow_ipv6(sock, *addresses)`: ZMQ refuses an IPv6 literal (`tcp://[::1]:5557`: "No such
  device") unless the socket asks for IPv6; IPv4 addresses alone leave it off, so that a bound
  IPv4 endpoint keeps its IPv4 spelling.
- `BindError`: an address the publisher could not bind or connect to.
- `Joins` watches a PUB for peers that join it (a subscriber that connects to its endpoint,
  or one of `events.connect` that it reaches; ZMQ's handshake-succeeded event, after each
  reconnection too). A PUB sends a peer nothing before the peer's subscription arrives, and
  nothing of what it sent before: a router that does not replay (llm-d) would otherwise never
  hear of blocks that do not change after it joined (a restarted store's recovered disk tier,
  blocks held for days). `due(now)` says a joiner is owed the store's state, `JOIN_GRACE_S`
  after its handshake (its subscription follows it); the publisher then tells every topic
  every block held (`EventPublisher._retell`) and calls `told()`. Several joins in a row are
  told once.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.errors import InvalidArgumentError

JOIN_GRACE_S = 0.2


def allow_ipv6(sock: zmq.Socket[bytes], *addresses: str) -> None:
    if any("[" in address for address in addresses):
        sock.setsockopt(zmq.IPV6, 1)


class BindError(InvalidArgumentError):
    """An address the publisher could not bind (or connect to): `name` ("endpoint",
    "replay_endpoint" or "connect"), `address`, and ZMQ's `reason`."""

    def __init__(self, name: str, address: str, reason: str) -> None:
        verb = "connect to" if name == "connect" else "bind"
        super().__init__(f"{name}: cannot {verb} {address!r} ({reason})")
        self.name, self.address, self.reason = name, address, reason


class Joins:
    def __init__(self, pub: zmq.Socket[bytes]) -> None:
        self._pub = pub
        self._monitor = pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._due: float | None = None
        self.joined = 0  # handshakes seen since start

    def due(self, now: float) -> bool:
        """Whether a peer that joined is owed the state now (reads the monitor, no wait)."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.joined += 1
                self._due = now + JOIN_GRACE_S  # the latest joiner's subscription too
        return self._due is not None and now >= self._due

    def told(self) -> None:
        self._due = None

    def close(self) -> None:
        self._pub.disable_monitor()
        self._monitor.close(linger=0)
