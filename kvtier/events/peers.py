"""The publisher's sockets and the peers that join them (`publisher.py`, `replay.py`).

- `allow_ipv6(sock, *addresses)`: ZMQ refuses an IPv6 literal (`tcp://[::1]:5557`: "No such
  device") unless the socket asks for IPv6; IPv4 addresses alone leave it off, so that a bound
  IPv4 endpoint keeps its IPv4 spelling.
- `limit_frames(pub, topic, per_tenant, max_message_bytes)`: a peer of the PUB sends it
  subscriptions, and ZMQ took a frame of any size whole (a 64 MiB one grew the sidecar by 64 MiB
  and more); now a frame longer than the longest subscription of use (a topic the publisher can
  send, and its header: one byte in ZMTP 3.0, a `SUBSCRIBE` command's 10 in ZMTP 3.1, which libzmq
  4.3 speaks: `SUBSCRIBE_BYTES`), or than `HANDSHAKE_BYTES` (ZMQ bounds the handshake's frames by
  the same option), drops its peer (`MAXMSGSIZE`). What it does not bound: ZMQ keeps every
  distinct subscription in a trie, some 45 bytes a byte (100,000 distinct ones of 70 bytes: 320
  MiB), and `XPUB_MANUAL` keeps them as well; only keeping the endpoint from untrusted peers
  prevents that. And a peer that stops reading makes the PUB hold what it sends that peer:
  `min(ZMQ_HWM, SUBSCRIBER_BYTES // max_message_bytes)` messages at most, one at least (`SNDHWM`;
  128 by default, so 1 GiB at most of 8 MiB ones, where ZMQ's default, 1,000, let one stalled
  subscriber hold 8 GiB: 8 stalled ones of 128 KiB messages grew a sidecar by 160 MiB). Past that
  ZMQ drops that peer's messages (a PUB never blocks): its sequence numbers show the gap, and its
  router replays it. Not fewer: a subscriber that reads while a retell of a large store comes in a
  burst (a thousand messages) must not lose it.
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
TENANT_BYTES = 64  # a tenant id's longest (`config/tenants.py`: [A-Za-z0-9_.-]{1,64})
SUBSCRIBE_BYTES = 10
"""A subscription's header at most: ZMTP 3.1's command (a name-length byte and `SUBSCRIBE`)."""
SUBSCRIBER_BYTES = 1 << 30  # about what the PUB holds for a peer that stops reading, at most
ZMQ_HWM = 1000  # ZMQ's default high-water mark: messages
HANDSHAKE_BYTES = 1024
"""A peer's ZMTP READY command: its socket type and a routing id of up to 255 bytes."""


def allow_ipv6(sock: zmq.Socket[bytes], *addresses: str) -> None:
    if any("[" in address for address in addresses):
        sock.setsockopt(zmq.IPV6, 1)


def limit_frames(
    pub: zmq.Socket[bytes], topic: str, per_tenant: bool, max_message_bytes: int
) -> None:
    """Bound the frames `pub`'s peers may send, and what it holds for each (module doc); and
    linger a second at close. Before `pub` binds or connects."""
    longest = len(topic.encode()) + (1 + TENANT_BYTES if per_tenant else 0)
    pub.setsockopt(zmq.MAXMSGSIZE, max(SUBSCRIBE_BYTES + longest, HANDSHAKE_BYTES))
    pub.setsockopt(zmq.SNDHWM, min(ZMQ_HWM, max(1, SUBSCRIBER_BYTES // max_message_bytes)))
    pub.setsockopt(zmq.LINGER, 1000)


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
