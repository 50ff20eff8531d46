"""KV events (issue 16): where kvtier's blocks live, told to routers in the wire format vLLM's
publisher uses and llm-d's consumer reads.

- `publisher.py`: `EventPublisher`, the ZMQ PUB and replay ROUTER (the wire format, the
  contract);
- `replay.py`: `Backlog` and `ReplayServer`, the replay endpoint, bounded against peers that
  ask and never read;
- `observer.py`: `IndexEvents`, the index's observer that feeds it: a block gaining or losing a
  copy in a tier;
- `wire.py`: the msgpack bytes of an event, packed with numpy.
"""

from kvtier.events.observer import MEDIUM_OF_TIER, IndexEvents
from kvtier.events.publisher import MEDIUM, EventPublisher, EventSettings

__all__ = ["MEDIUM", "MEDIUM_OF_TIER", "EventPublisher", "EventSettings", "IndexEvents"]
