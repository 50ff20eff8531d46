"""The router of a replayed fleet (`replicas.py` with a policy; `routed.py` documents the
run): each replica publishes its events on loopback, one `Subscriber` feeds one `PrefixIndex`
from all of them, a `Router` chooses by it, and `settle` waits after each request until the
router has every event of the store it used."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.routing import PrefixIndex, Router, Subscriber
from kvtier.routing.keys import pod_of
from kvtier.store import KVStore

SETTLE_TIMEOUT_S = 10.0


def events_config(replica: int) -> dict[str, Any]:
    return {
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "topic": topic(replica),
        "buffer": 1000,  # the router waits for each store's events: it never needs more
    }


def topic(replica: int) -> str:
    return f"kv@replica-{replica}@replay"


class FleetRouter:
    """The router of a replayed fleet: `Router` over the replicas, fed by their events."""

    def __init__(self, stores: Sequence[KVStore], policy: str, block_tokens: int) -> None:
        self.stores = list(stores)
        self.index = PrefixIndex(block_tokens)
        self.subscriber = Subscriber(self.index)
        pods = [pod_of(topic(i)) for i in range(len(self.stores))]
        for store, pod in zip(self.stores, pods, strict=True):
            publisher = store.parts.events
            assert publisher is not None, "a routed replica publishes events"
            self.subscriber.add(publisher.endpoint, publisher.replay_endpoint, pod=pod)
        self._replica = {pod: i for i, pod in enumerate(pods)}
        self.router = Router(pods, policy, self.index)
        self._joined = False

    def choose(self, tokens: Any) -> int:
        if not self._joined:
            self._join()
        return self._replica[self.router.choose(tokens)]

    def settle(self, replica: int) -> None:
        """Wait until the subscriber has applied every event `replica` has published."""
        publisher = self.stores[replica].parts.events
        assert publisher is not None
        publisher.flush()
        name = topic(replica)
        if not self.subscriber.wait(name, publisher.next_seq(name), SETTLE_TIMEOUT_S):
            raise RuntimeError(f"replica {replica}: its events did not reach the router")

    def check(self) -> None:
        self.index.check()
        stats = self.subscriber.stats()
        assert stats["bad"] == 0 and self.index.stats()["bad"] == 0, (stats, self.index.stats())

    def close(self) -> None:
        self.subscriber.close()

    def _join(self) -> None:
        """Wait until every replica's PUB has the subscription (ZMQ drops messages sent to a
        SUB that has not joined yet): each sends a message until the subscriber has one."""
        for i, store in enumerate(self.stores):
            publisher = store.parts.events
            assert publisher is not None
            for _ in range(int(SETTLE_TIMEOUT_S / 0.05)):
                publisher.cleared("")  # an empty replica: nothing for a router to forget
                publisher.flush()
                if self.subscriber.wait(topic(i), 1, 0.05):
                    break
            else:
                raise RuntimeError(f"replica {i}: the router could not subscribe")
        self._joined = True
