"""Asking a KV-event publisher's replay endpoint (vLLM's protocol, `kvtier.events.replay`) for
the messages of one topic, bounded whatever the endpoint sends: a subscriber's gap recovery
(`subscriber.py`).

`ask(...)` sends `[b"", first (8 bytes, big-endian), topic]` from a DEALER and collects the
replies `[b"", topic, seq, payload]` of that topic with `first <= seq < stop`, each number once,
until the end marker, a reply of another shape, `timeout` seconds in all, or `budget` bytes
(each message counts `ENTRY` besides its payload; ZMQ refuses a frame past `max_message_bytes`,
and holds at most `budget // max_message_bytes` of them unread, `RCVHWM`: about `budget`).
What came is returned as it came; `run(...)` judges it: the run of a gap, or None.
"""

from __future__ import annotations

import time

import zmq

from kvtier.events.peers import allow_ipv6

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENTRY = 256  # bytes a replayed message counts besides its payload


def ask(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    topic: str,
    span: range,
    max_message_bytes: int,
    timeout: float,
    budget: int,
) -> dict[int, bytes]:
    """The messages of `topic` numbered in `span` that `endpoint` replays (module doc)."""
    dealer = context.socket(zmq.DEALER)
    allow_ipv6(dealer, endpoint)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    dealer.setsockopt(zmq.RCVHWM, max(1, budget // max_message_bytes))  # unread: ~`budget`
    deadline = time.monotonic() + timeout
    name = topic.encode()
    got: dict[int, bytes] = {}
    try:
        try:
            dealer.connect(endpoint)
        except zmq.ZMQError:  # an address ZMQ refuses (`tcp://..:5`): no replay, not a crash
            return got
        dealer.send_multipart([b"", span.start.to_bytes(8, "big"), name])
        while (left := deadline - time.monotonic()) > 0 and dealer.poll(int(left * 1000) + 1):
            frames = dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8 or frames[2] == END_SEQ:
                break
            seq = int.from_bytes(frames[2], "big")
            if frames[1] == name and seq in span and seq not in got:
                budget -= len(frames[3]) + ENTRY
                if budget < 0:
                    break
                got[seq] = frames[3]
    finally:
        dealer.close()
    return got


def run(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    topic: str,
    start: int | None,
    stop: int,
    max_message_bytes: int,
    timeout: float,
    budget: int,
) -> dict[int, bytes] | None:
    """Messages start..stop-1 of `topic` (`start` None: nothing is known of the topic, asked
    from 0, and whatever run the endpoint holds that ends at stop-1 taken), every one of them,
    or None: a replay that does not begin at `start` is refused whole (what it lacks may be
    another life's, `subscriber.py`), and a span that could not fit in `budget` (`ENTRY` a
    message) is not asked for."""
    first = 0 if start is None else start
    if (stop - first) * ENTRY > budget:
        return None
    got = ask(context, endpoint, topic, range(first, stop), max_message_bytes, timeout, budget)
    if start is None and got:  # the run the endpoint holds, if it ends at stop-1
        first = min(got)
    return got if got and len(got) == stop - first else None
