"""What one KV-event publisher may make a router's subscriber do (`subscriber.py`, Trust):

- `Voice`: the pod it speaks for and the topics it speaks on. A publisher speaks for one pod
  (`keys.pod_of` its topic), the first it names that no other publisher spoke for, on at most
  a set number of topics of at most `MAX_TOPIC_CHARS` characters: one pod's publisher cannot
  clear, restart or add to another pod's blocks, nor hold topics without end. First come,
  unless the router names each publisher's pod when it adds it (`Subscriber.add(pod=...)`):
  then no other publisher can take that pod, whoever is heard first.
- `Ration`: the time its recoveries (a replay, a snapshot asked on a gap) may take, about
  `RECOVERY_SHARE` of the subscriber's thread in the long run: a publisher whose endpoints let
  every request run to its timeout cannot keep the other publishers waiting. A replay is charged
  the time its endpoint took, not the time the subscriber then takes to apply what it brought
  (what those messages would have cost live): a router slow enough to lose messages was
  charged for being slow, and its next gap forgot every block of the pod without asking.
- `Added`, `Publisher`: a publisher as `Subscriber.add` names it, and as its thread holds it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvtier.routing.keys import pod_of
from kvtier.routing.links import Link
from kvtier.routing.snapshots import Asker, Snapshot

MAX_TOPIC_CHARS = 256  # as a sidecar's snapshot names one at most
RECOVERY_SHARE = 0.1


@dataclass
class Voice:
    """What one publisher may say (module doc): for one pod, the first it names that no other
    publisher spoke for, on at most `limit` topics."""

    limit: int
    pod: str | None = None
    topics: set[str] = field(default_factory=set)

    def admits(self, topic: str, owners: dict[str, Voice]) -> bool:
        """May it speak on `topic`? (`owners`: pod -> the voice that spoke for it first.)"""
        if topic in self.topics:
            return True
        if len(topic) > MAX_TOPIC_CHARS:
            return False
        pod = pod_of(topic)
        if self.pod is None and pod not in owners:
            self.pod, owners[pod] = pod, self
        if self.pod != pod or len(self.topics) >= self.limit:
            return False
        self.topics.add(topic)
        return True


@dataclass
class Ration:
    """The seconds of recovery a publisher may still take: `cap` at most, and coming back at
    `RECOVERY_SHARE` of the time passed."""

    cap: float
    credit: float = field(init=False)
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.credit = self.cap  # a publisher starts with one whole recovery

    def allows(self) -> bool:
        """Has it credit left for a recovery now?"""
        now = time.monotonic()
        self.credit = min(self.cap, self.credit + (now - self.at) * RECOVERY_SHARE)
        self.at = now
        return self.credit > 0

    def spent(self, since: float) -> None:
        """A recovery that began at `since` has ended."""
        self.credit -= time.monotonic() - since


@dataclass(frozen=True)
class Added:
    endpoint: str
    replay_endpoint: str | None
    snapshot: Snapshot | None
    tenant: str | None  # the snapshot is this tenant's view; None: the pod's whole
    voice: Voice


@dataclass
class Publisher:
    link: Link
    added: Added
    ration: Ration
    asker: Asker | None  # its snapshot's, if it has one
    resynced_at: float = 0.0
