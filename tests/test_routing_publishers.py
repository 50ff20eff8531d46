"""A `Subscriber` hears at most `checks.MAX_PUBLISHERS` publishers at once, and every one it
took is heard. Each costs 3 ZMQ sockets of the context's 1,023: before, past 341 publishers
ZMQ refused the sockets, `add` took them all the same and those publishers went unheard,
silently (audit AY: `kvtier replay --replicas 400 --route prefix` died after 77 s)."""

from __future__ import annotations

import socket
import time

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from kvtier.errors import InvalidArgumentError
from kvtier.routing import PrefixIndex, Subscriber
from kvtier.routing.checks import MAX_PUBLISHERS


def dead_address() -> str:
    """A loopback TCP address nothing listens on (a port taken and given back)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_the_last_publisher_a_subscriber_takes_is_heard_and_one_more_is_refused() -> None:
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(PrefixIndex(16))
    try:
        address = dead_address()
        for i in range(MAX_PUBLISHERS - 1):
            sub.add(address, pod=f"dead-{i}")
        sub.add(f"tcp://127.0.0.1:{port}", pod="live")
        with pytest.raises(InvalidArgumentError, match=f"{MAX_PUBLISHERS} publishers"):
            sub.add(address, pod="one-more")
        sub.remove("dead-0")
        sub.add(address, pod="in-its-place")  # a slot given back is taken again
        batch = msgpack.packb([time.time(), [], None], use_bin_type=True)
        deadline = time.monotonic() + 30
        while sub.applied("kv@live@m") == 0 and time.monotonic() < deadline:
            pub.send_multipart([b"kv@live@m", (0).to_bytes(8, "big"), batch])  # (slow joiner)
            sub.wait("kv@live@m", 1, timeout=0.2)
        assert sub.applied("kv@live@m") == 1  # the 256th publisher is heard
    finally:
        sub.close()
        pub.close()
        context.term()
