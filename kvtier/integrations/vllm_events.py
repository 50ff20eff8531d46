"""kvtier's KV events in vLLM's own event stream (`KvtierConnector.take_events`).

Why. A router such as llm-d learns where blocks live from each vLLM pod's KV events, and in its
pod-discovery mode it dials one endpoint a pod: vLLM's. The sidecar publishes what kvtier holds
(the host and disk copies vLLM's own events never mention) on an endpoint of its own
(`events`), which that mode never dials. With `kvtier.events_endpoint` set, the connector's
scheduler subscribes to the sidecar's events and hands them to vLLM at each step
(`take_events`), which publishes them with its own: one stream a pod, kvtier's media (CPU,
DISK; GPU for a gpu tier of the sidecar's) next to vLLM's GPU blocks. No event says REMOTE:
the medium is reserved, never sent (README "KV events": no node can tell truthfully what the
shared cluster gained or lost).

How. A `routing.Subscriber` feeds a `Relay` (its `reading.Sink`): a gap is filled from the
sidecar's replay endpoint (`kvtier.events_replay_endpoint`), else from its `GET /v1/blocks`
snapshot as the engine's tenant; a sidecar's retell (`events.retells`) tells the relay every
block held when it first connects. The relay checks each event as a router does
(`routing.reading`; the token ids as the store does) before vLLM's encoder sees it, and turns
it into vLLM's classes:
- a BlockStored as kvtier sent it (its hashes: numbers of the sidecar's publisher; parent,
  tokens, block size, LoRA, medium);
- a BlockRemoved naming only the hashes the relay queued as held in that medium;
- kvtier's AllBlocksCleared, and a topic forgotten (a gap nobody could fill, a sidecar that
  restarted), as a BlockRemoved of every block the relay told of there, per medium: never an
  AllBlocksCleared, which a router applies to the pod's own GPU blocks too;
- a snapshot as the removal of what it lacks of what was told, then its blocks stored.
Events that are not kvtier's to tell are dropped whole and counted: a block size other than
vLLM's (`block_size`: a router reads one size a pod; set the sidecar's `block_tokens` to vLLM's
`block_size`), extra keys (kvtier keys blocks by tokens alone), a payload that is not events or
a field of the wrong type (`bad`). Only `kvtier.events_topic` and the topics under it
(`<topic>@<tenant>`) are relayed (`relayed`; default: every topic the sidecar publishes; never
a topic that merely starts with the same characters, another tenant's whose id starts with
this one's): a sidecar shared by tenants sets
`events.per_tenant_topic`, and each engine the topic of its own tenant, else other tenants'
blocks are told as this pod's.

Bounds. The relay keeps each block it queued as held, with its media (`max_blocks` in all: a
BlockStored past it is dropped, counted as `full`), and the events vLLM has not taken yet. vLLM
takes them at its next step. A snapshot replaces the stores queued for its topic (it holds
them, as they are now), so what it queues is bounded by `max_blocks`; the messages applied
since vLLM last took are bounded by `max_pending` blocks. An idle engine takes none, so a busy
sidecar can pass that: then the queue's stores are dropped, its removals kept, and every block
queued as held is removed too (`lost`; some of them vLLM never published, which a router
ignores), and the relay is muted (drops what comes) until vLLM takes the queue;
the next message then makes the subscriber resync from the snapshot (for it, an orphan). A
router may, for a while, not know what kvtier holds; it is never left believing the pod holds
what kvtier dropped.

Invariants (`check()`): `blocks` is the number of hashes `held` maps, each to a media mask that
is not 0 and names only media the relay knows; `pending_blocks` counts the blocks of `pending`,
and `fresh` those of the messages applied since the last `take`, at most `max_pending` unless
muted.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvtier.blocks import encode_tokens
from kvtier.client import Client
from kvtier.errors import ConfigError, InvalidTokensError, shown
from kvtier.integrations.settings import ConnectorSettings
from kvtier.routing.reading import BadEvent, batch_events, block_hash, block_hashes, medium
from kvtier.routing.subscriber import Subscriber

log = logging.getLogger("kvtier.vllm")

MAX_BLOCKS = 1 << 20  # blocks queued as held, over all topics (a dict entry each: ~100 MiB)
MAX_PENDING = 1 << 18  # blocks of the messages applied since vLLM last took (~60 MiB)
MAX_MEDIA = 16
REMOVED_PER_EVENT = 8192  # hashes in one BlockRemoved the relay makes itself
COUNTS = ("events", "taken", "bad", "block_size", "full", "lost")


class Relay:
    def __init__(
        self, block_size: int, topic: str = "", max_blocks: int = MAX_BLOCKS,
        max_pending: int = MAX_PENDING,
    ) -> None:  # fmt: skip
        self.block_size, self.topic = block_size, topic
        self.max_blocks, self.max_pending = max_blocks, max_pending
        self._lock = threading.Lock()
        self.held: dict[str, dict[Any, int]] = {}  # topic -> hash -> media told of (bits)
        self.media: dict[str, int] = {}  # medium -> its bit
        self.blocks = 0  # hashes `held` maps
        self.pending: list[tuple[str, KVCacheEvent]] = []  # (topic, event) for vLLM's next step
        self.pending_blocks = 0
        self.fresh = 0  # blocks of `pending` from messages (not snapshots) since the last take
        self.counts = dict.fromkeys(COUNTS, 0)
        self.muted = False  # the queue overflowed and vLLM has not taken it since
        self.stale = False  # taken since: the next message asks for a snapshot
        self.asked = 0  # snapshots asked for (`orphans`)
        self._warned = False
        self.subscriber: Subscriber | None = None  # feeding it (`start`)
        self.client: Client | None = None  # the subscriber's snapshots

    # ---- `reading.Sink`: the subscriber's thread ----------------------------------------

    def apply(self, source: str, payload: bytes) -> int:
        return self._take_in(source, payload, snapshot=False)

    def reset(self, source: str, payload: bytes) -> int:
        return self._take_in(source, payload, snapshot=True)

    def _take_in(self, source: str, payload: bytes, snapshot: bool) -> int:
        """A message's events (`snapshot`: a snapshot's, which replace the topic's) queued."""
        events = self._read(payload)
        if not relayed(source, self.topic):
            return 0
        with self._lock:
            if self.muted:
                return 0
            if snapshot:
                self.stale = False
                return self._swap_in(source, events)
            if self.stale:
                self.stale, self.asked = False, self.asked + 1
            out: list[KVCacheEvent] = []
            applied = self._apply_all(self.held.setdefault(source, {}), events, out)
            self._queue(source, out)
            return applied

    def _swap_in(self, source: str, events: list[Any]) -> int:
        """`source`'s blocks become a snapshot's `events` (module doc). Lock held."""
        old = self.held.pop(source, {})
        self.blocks -= len(old)
        new: dict[Any, int] = {}
        self.held[source] = new
        stored: list[KVCacheEvent] = []
        applied = self._apply_all(new, events, stored)
        gone = {h: mask & ~new.get(h, 0) for h, mask in old.items()}
        queued = [(t, e) for t, e in self.pending if t != source or type(e) is BlockRemoved]
        self.pending, self.pending_blocks = queued, count(queued)
        self.fresh = min(self.fresh, self.pending_blocks)  # the stores it replaces left
        removed = self._removals({h: m for h, m in gone.items() if m})
        self.pending += [(source, e) for e in removed + stored]
        self.pending_blocks += count(self.pending[len(queued) :])
        return applied

    def clear(self, source: str) -> None:
        with self._lock:
            if self.muted:  # nothing is held then
                return
            told = self.held.pop(source, {})
            self.blocks -= len(told)
            self._queue(source, self._removals(told))

    def orphans(self) -> int:
        """Snapshots asked for after an overflow (module doc): each makes a subscriber
        resync."""
        with self._lock:
            return self.asked

    # ---- vLLM's side ------------------------------------------------------------------

    def take(self, stats: dict[str, int] | None = None) -> list[KVCacheEvent]:
        """The events queued since the last call, in order; `stats` (the connector's counts,
        `vllm_stats.COUNTERS`) updated."""
        with self._lock:
            taken = [event for _, event in self.pending]
            self.pending, self.pending_blocks, self.fresh = [], 0, 0
            self.counts["taken"] += len(taken)
            if stats is not None:
                stats["relayed_events"] = self.counts["taken"]
                stats["refused_events"] = self.counts["bad"]  # each refusal's kind counted too
                stats["relay_overflows"] = self.counts["lost"]
            if self.muted:
                self.muted, self.stale = False, True
            return taken

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        if self.client is not None:
            self.client.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "blocks": self.blocks, "pending_blocks": self.pending_blocks}

    def check(self) -> None:
        with self._lock:
            every = (1 << len(self.media)) - 1
            assert self.blocks == sum(len(told) for told in self.held.values()), self.blocks
            for told in self.held.values():
                assert all(0 < mask <= every for mask in told.values())
            assert count(self.pending) == self.pending_blocks, self.pending_blocks
            assert self.fresh <= self.pending_blocks
            assert self.muted or self.fresh <= self.max_pending, self.fresh

    # ---- inside -----------------------------------------------------------------------

    def _read(self, payload: bytes) -> list[Any]:
        try:
            return batch_events(payload)
        except BadEvent:
            with self._lock:
                self.counts["bad"] += 1
            raise

    def _apply_all(self, told: dict[Any, int], events: list[Any], out: list[KVCacheEvent]) -> int:
        applied = 0
        for event in events:
            try:
                self._apply_one(told, event, out)
            except BadEvent as e:
                self.counts["bad"] += 1
                log.debug("kvtier event not relayed: %s", e)
                continue
            applied += 1
        self.counts["events"] += applied
        return applied

    def _apply_one(self, told: dict[Any, int], event: Any, out: list[KVCacheEvent]) -> None:
        if not isinstance(event, list) or not event or not isinstance(event[0], str):
            raise BadEvent("event: expected [class name, fields...]")
        kind = event[0]
        if kind == "BlockStored" and len(event) >= 7:
            out.append(self._stored(told, event))
        elif kind == "BlockRemoved" and len(event) >= 2:
            name = medium(event[2] if len(event) > 2 else None)
            bit = self.media.get(name, 0)
            gone = []
            for h in block_hashes(event[1]):
                mask = told.get(h, 0)
                if mask & bit:
                    gone.append(h)
                    self._set(told, h, mask & ~bit)
            if gone:
                out.append(BlockRemoved(block_hashes=gone, medium=name))
        elif kind == "AllBlocksCleared":
            out.extend(self._removals(told))
            self.blocks -= len(told)
            told.clear()
        else:
            raise BadEvent(f"event: {kind!r} with {len(event)} fields")

    def _stored(self, told: dict[Any, int], event: list[Any]) -> BlockStored:
        hashes, tokens, size = block_hashes(event[1]), event[3], event[4]
        parent = None if event[2] is None else block_hash(event[2])
        if type(size) is not int or size != self.block_size:
            self.counts["block_size"] += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "kvtier events of %r-token blocks not relayed: vLLM's blocks hold %d (set "
                    "the sidecar's block_tokens to it)", size, self.block_size,
                )  # fmt: skip
            raise BadEvent(f"block_size: got {shown(size)}, expected {self.block_size}")
        if not isinstance(tokens, list) or len(tokens) != len(hashes) * size or not hashes:
            raise BadEvent(f"token_ids: expected {len(hashes)} blocks of {size}")
        try:  # the store's own check: ints in [0, 2**32), so vLLM's encoder takes them
            encode_tokens(tokens)
        except InvalidTokensError as e:
            raise BadEvent(f"token_ids: {e}") from None
        lora_id, lora_name = event[5], event[7] if len(event) > 7 else None
        if not (lora_id is None or (type(lora_id) is int and 0 <= lora_id < 1 << 63)):
            raise BadEvent("lora_id: expected an int or nil")
        if not (lora_name is None or (isinstance(lora_name, str) and len(lora_name) <= 256)):
            raise BadEvent("lora_name: expected a short string or nil")
        if len(event) > 8 and event[8] is not None:
            raise BadEvent("extra_keys: kvtier keys blocks by tokens alone")
        name = medium(event[6])
        bit = self.media.get(name)
        if bit is None:
            if len(self.media) >= MAX_MEDIA:
                raise BadEvent(f"medium: {name!r} past the {MAX_MEDIA} media relayed")
            bit = self.media[name] = 1 << len(self.media)
        if self.blocks + len({h for h in hashes if h not in told}) > self.max_blocks:
            self.counts["full"] += 1
            raise BadEvent(f"{len(hashes)} blocks more, past the {self.max_blocks} relayed")
        for h in hashes:
            self._set(told, h, told.get(h, 0) | bit)
        return BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
            lora_id=lora_id, medium=name, lora_name=lora_name,
        )  # fmt: skip

    def _set(self, told: dict[Any, int], h: Any, mask: int) -> None:
        if mask:
            self.blocks += h not in told
            told[h] = mask
        elif h in told:
            del told[h]
            self.blocks -= 1

    def _removals(self, told: dict[Any, int]) -> list[KVCacheEvent]:
        """A BlockRemoved per medium (and per `REMOVED_PER_EVENT` hashes) of every block in
        `told`, in that medium."""
        out: list[KVCacheEvent] = []
        for name, bit in self.media.items():
            hashes = [h for h, mask in told.items() if mask & bit]
            for at in range(0, len(hashes), REMOVED_PER_EVENT):
                out.append(BlockRemoved(block_hashes=hashes[at : at + REMOVED_PER_EVENT],
                                        medium=name))  # fmt: skip
        return out

    def _queue(self, source: str, events: list[KVCacheEvent]) -> None:
        """Queue `events` of a message for vLLM; past `max_pending` blocks since the last take,
        keep the queue's removals, remove every block queued as held, and mute (module doc)."""
        added = [(source, event) for event in events]
        self.pending += added
        self.pending_blocks += count(added)
        self.fresh += count(added)
        if self.fresh <= self.max_pending:
            return
        self.counts["lost"] += 1
        kept = [(t, e) for t, e in self.pending if type(e) is BlockRemoved]
        removed = [(t, e) for t, told in self.held.items() for e in self._removals(told)]
        self.pending = kept + removed
        self.pending_blocks = count(self.pending)
        self.fresh = min(self.fresh, self.pending_blocks)  # the stores dropped left with them
        self.held = {}
        self.blocks = 0
        self.muted = True


def relayed(source: str, topic: str) -> bool:
    """Whether the relay of `topic` takes a message of `source`: every topic for "", else
    `topic` itself and the topics under it (`topic@<tenant>`). Never a topic that only starts
    with the same characters: `kv@pod@model@alice` is not `kv@pod@model@alice.b`'s."""
    return not topic or source == topic or source.startswith(topic + "@")


def count(queued: list[tuple[str, KVCacheEvent]]) -> int:
    """The blocks the events of `queued` name."""
    return sum(len(event.block_hashes) for _, event in queued)


def start(settings: ConnectorSettings, vllm_config: Any, url: str) -> Relay | None:
    """The scheduler's relay of the sidecar's events at `settings.events` (None: not asked
    for), fed by a subscriber of its own whose snapshot is the sidecar at `url`'s `GET
    /v1/blocks` as the engine's tenant. A `ConfigError` if vLLM publishes no events."""
    where = settings.events
    if where is None:
        return None
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events:
        raise ConfigError(
            "kvtier.events_endpoint", where.endpoint,
            "unset, or vLLM's --kv-events-config with enable_kv_cache_events true: vLLM "
            "publishes kvtier's events with its own",
        )  # fmt: skip
    relay = Relay(int(vllm_config.cache_config.block_size), where.topic)
    relay.client = Client(url, api_key=settings.key or None)
    relay.subscriber = Subscriber(relay)
    relay.subscriber.add(where.endpoint, where.replay_endpoint, relay.client.blocks)
    return relay
