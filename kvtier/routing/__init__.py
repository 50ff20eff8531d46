"""Cache-aware routing (issue 16): a prefix index fed by KV events, and the scorer a gateway
calls to send a request to the replica that already holds its prefix.

- `index.py`: `PrefixIndex` (events in, `score(tokens) -> {pod: weighted prefix length}`);
  `keys.py`, its content keys; `runs.py`, a message's events cut into runs of blocks that one
  hold of its lock applies;
- `subscriber.py`: `Subscriber`, the thread that feeds it from ZMQ publishers and recovers
  lost messages through their replay endpoints (`replays.py`) and snapshots (`snapshots.py`:
  each asked on a thread of its own, waited for a bounded time);
- `links.py`: one publisher's SUB socket, bounded, reopened with a backoff;
- `allowance.py`: what one publisher may make the subscriber do (the pod it speaks for, the
  time its recoveries may take);
- `reading.py`: the wire's untrusted fields read, and `Sink`, what a subscriber feeds;
- `policies.py`: how a replica is chosen from the scores (round robin, prefix, prefix-load).
"""

from kvtier.routing.index import DEFAULT_WEIGHTS, PrefixIndex
from kvtier.routing.policies import POLICIES, Router
from kvtier.routing.reading import BadEvent
from kvtier.routing.subscriber import Subscriber

__all__ = ["DEFAULT_WEIGHTS", "POLICIES", "BadEvent", "PrefixIndex", "Router", "Subscriber"]
