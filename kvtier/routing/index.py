"""Where each pod's blocks live, learnt from KV events, and how much of a prompt each pod holds.

`PrefixIndex.apply(source, payload)` takes one event message of one source (a publisher's
topic: `kv@<pod>@<model>[@<tenant>]`, so a pod is the topic's second field) as it came off the
wire (`kvtier.events`; kvtier's positional events or vLLM 0.33's tagged maps: `reading`).
`score(tokens)` answers `{pod: weighted prefix length}`: for each pod, the leading full blocks
of `tokens` it holds in a row, each counted as `block_size * weight` of the best medium the pod
holds it in (`DEFAULT_WEIGHTS`); with `tenant=`, in its topics and those of no tenant only (a
topic tenants share, `kv@<pod>@<model>`, cannot tell them apart: every tenant's copy counts).

Keys. A publisher's block hashes are its own (kvtier's are counters, vLLM's are hashes of its
own chaining, salted per process), so the index keys blocks by content: a block's key chains
the previous block's key with the block's tokens (BLAKE2b, 8 bytes), the first block's from a
seed of the LoRA name. Two pods holding the same tokens hold the same keys; a prompt's keys
are computed the same way. Each source maps its hashes to keys (`Source.keys`), so a
BlockRemoved (hashes only) finds them, and a BlockStored's parent hash finds the key its
blocks chain from.

Trust. A payload is untrusted bytes: a message that is not a msgpack event batch, or an event
whose fields have the wrong types or sizes, is skipped whole and counted (`stats()["bad"]`),
naming nothing stored; a BlockStored whose parent hash the source never stored is counted as
an orphan and skipped (its keys cannot be known); a block size other than the index's is
counted and skipped. Nothing a payload holds is executed or taken as a path.

Bounds. What one source says stays its own and is bounded: a pod maps at most `max_blocks`
hashes over all its sources (a BlockStored past it is skipped, counted as `full`: one cut in
pieces, `runs`, keeps those before; a snapshot keeps its events in order until full, as in
place), each source names at most `keys.MAX_MEDIA` media, in a table of its own, and keeps the
weights of `keys.MAX_WEIGHTS` media masks.

One key, several hashes. A source may hold the same tokens under several hashes at once, each
in its own media: the tenants of one kvtier topic (each namespace numbers its own blocks), or
vLLM's requests of two cache salts. Each hash keeps its own media, and the key is held in the
media of all of them: a BlockRemoved of one hash leaves the key held by the others, and a
BlockStored chained to any of them finds its parent; a key keeps its last `MAX_HASHES` hashes
(a hash past them drops the oldest, so a publisher that tells of one block under ever new hashes
costs bounded work an event). Keeping only the hash that stored the tokens last lost the
others: a tenant's next block, chained to its own hash, was an orphan, and the removal of the
last hash told the router the tokens were gone while another tenant held them.

Invariants (`check()`):
- `_where[key][source]` is the media bitmask of `key` at `source`, never 0; the same pairs as
  every source's `held`;
- every hash a source maps leads to a key it holds, with media of its own (never 0), and every
  key it holds has its hashes, whose media together are the key's;
- `_blocks[pod]` is the number of hashes the pod's sources map.

Thread safety: every method takes the index's lock (a subscriber's thread applies, the router
scores). A message is decoded, its events of no known shape counted and, past
`runs.PACK_BLOCKS` blocks, its token ids packed outside it (`reading` bounds the decode), then
applied `runs.APPLY_BLOCKS` blocks a hold, long events cut in pieces (`runs`), so a score waits
for one run (a few ms), not a whole message nor one long event; a snapshot (`reset`) is built
outside the lock, in an index of its own, and put in place in one hold, so that no score sees
its topic empty: a hold of about 0.5 us per block forgotten and put in place (86-120 ms for
200,000 over as many; it held the lock while it applied every event: 1.3 s). `clear` forgets
its topic (`stats()["cleared"]` counts the clears of topics heard of since their last `clear`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvtier.blocks import Tokens, encode_tokens
from kvtier.errors import shown
from kvtier.routing import checks, runs
from kvtier.routing.keys import Source, chain, pod_of, seed, weight
from kvtier.routing.keys import bit as bit_of
from kvtier.routing.reading import BadEvent, batch_events, block_hash, block_hashes, positional
from kvtier.routing.reading import medium as medium_of

# Per medium, about the share of a recomputation a hit from it saves (1: all of it). kvtier's
# TTFT benchmark (`benchmarks/bench_ttft.py`: SmolLM2-135M, 2000-token prompt, 1900 shared:
# cold 10.0 s; hits from gpu 0.47 s, host 0.46 s, disk 0.53 s) measures 1.0, 1.0, 0.99; the
# remote tier, which it does not load from, reads at about a third of the disk tier's bandwidth
# (`bench_remote.py` / `bench_disk.py`). The weights keep that order with a small step per
# tier, so that of two pods holding the same prefix, the one holding it faster scores higher.
DEFAULT_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.99, "DISK": 0.98, "REMOTE": 0.95}
MAX_BLOCKS = 1 << 21
"""The blocks a pod may make an index hold by default (530-570 bytes each, measured with
`tracemalloc` over 100k-262k blocks: some 1.2 GiB)."""
MAX_HASHES = 256
"""Hashes a source may keep for one key (module doc): tenants of a topic, cache salts."""


class PrefixIndex:
    def __init__(
        self,
        block_size: int,
        weights: Mapping[str, float] | None = None,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        self.block_size = int(checks.number("block_size", block_size, 1, integer=True))
        self.max_blocks = int(checks.number("max_blocks", max_blocks, 1, integer=True))
        self.weights = checks.weights(DEFAULT_WEIGHTS if weights is None else weights)
        self._sources: dict[str, Source] = {}
        self._where: dict[bytes, dict[str, int]] = {}  # key -> {source: media bitmask}
        self._blocks: dict[str, int] = {}  # pod -> hashes its sources map
        self._topics: dict[str, int] = {}  # pod -> its sources (`clear` forgets an empty pod)
        self._stats = dict.fromkeys(
            ("events", "bad", "orphans", "block_size", "full", "cleared"), 0
        )
        self._lock = threading.Lock()

    # ---- learning ----------------------------------------------------------------------

    def apply(self, source: str, payload: bytes) -> int:
        """Apply one message's event batch from `source` (a topic); the events applied. A
        payload that is no event batch raises `BadEvent` (counted); a bad event within one is
        skipped and counted. Decoded and sorted from events of no known shape outside the
        lock, applied `runs.APPLY_BLOCKS` blocks a hold of it (module doc, Thread safety)."""
        return self._apply_events(source, self._decode(payload))

    def _apply_events(self, source: str, events: list[Any]) -> int:
        events = self._shaped(events)
        if runs.whole(events, self.block_size):  # most messages: one hold, no piece cut
            with self._lock:
                return self._apply_all(source, events)
        applied, failed = 0, False
        for run in runs.runs(events, self.block_size):
            with self._lock:
                done, failed = self._apply_run(source, run, failed)
            applied += done
        return applied

    def _shaped(self, events: list[Any]) -> list[Any]:
        """`events` but those of no known kind and field count, counted as `bad`."""
        kept = [event for event in events if runs.shaped(event)]
        if len(kept) < len(events):
            with self._lock:
                self._stats["bad"] += len(events) - len(kept)
        return kept

    def reset(self, source: str, payload: bytes) -> int:
        """Forget `source`'s blocks and apply `payload` (a snapshot, `GET /v1/blocks`) in one
        step: a score never sees the source empty in between. Built outside the lock, in an
        index of its own bounded by the room the pod's other sources leave (its events applied
        in order until full, as in place), and put in place in one hold (module doc, Thread
        safety); one that those sources have made too big meanwhile is refused whole, counted
        as `full`, and the source left empty."""
        events = self._decode(payload, snapshot=True)
        with self._lock:  # the room the pod's other sources leave it: as full as in place
            mine = self._sources.get(source)
            others = self._blocks.get(pod_of(source), 0) - (len(mine.keys) if mine else 0)
        built = PrefixIndex(self.block_size, self.weights, max(1, self.max_blocks - others))
        built.max_blocks = self.max_blocks - others  # 0: the other sources fill the pod
        applied = built._apply_events(source, events)
        new = built._sources[source]
        with self._lock:
            self._clear(source)
            src = self._source(source)
            for name, count in built._stats.items():
                self._stats[name] += count
            if self._blocks[src.pod] + len(new.keys) > self.max_blocks:  # others grew meanwhile
                self._stats["full"] += 1
                self._stats["events"] -= applied
                return 0
            src.take(new)
            self._blocks[src.pod] += len(new.keys)
            for key, mask in new.held.items():
                self._where.setdefault(key, {})[source] = mask
            return applied

    def _decode(self, payload: bytes, snapshot: bool = False) -> list[Any]:
        try:  # a snapshot, a whole topic, may hold more events than a message (`reading`)
            return [positional(event) for event in batch_events(payload, snapshot)]
        except BadEvent:
            with self._lock:
                self._stats["bad"] += 1
            raise

    def _apply_all(self, source: str, events: list[Any]) -> int:
        """Apply `events`, none cut (`runs.whole`); the events applied."""
        applied, src = 0, self._source(source)
        for event in events:
            try:
                self._apply_one(source, src, event)
            except BadEvent:
                self._stats["bad"] += 1
                continue
            applied += 1
        self._stats["events"] += applied
        return applied

    def _apply_run(self, source: str, run: list[runs.Piece], failed: bool) -> tuple[int, bool]:
        """Apply a `run` of pieces (`runs`); `failed`: the piece before was refused (its event's
        next pieces are skipped). The events applied (an event counts at its last piece, never
        both applied and `bad`), and `failed` after."""
        applied, src = 0, self._source(source)
        for event, continues, ends in run:
            if continues and failed:
                continue
            try:
                self._apply_one(source, src, event)
            except BadEvent:
                self._stats["bad"] += 1
                failed = True
                continue
            failed = False
            applied += ends
        self._stats["events"] += applied
        return applied, failed

    def clear(self, source: str) -> None:
        """Forget every block of `source` (lost events that replay could not fill, a pod
        removed) and the source itself, heard of again by its next message (the sources of
        removed pods were kept, empty, without end)."""
        with self._lock:
            self._clear(source)
            src = self._sources.pop(source, None)
            if src is not None:
                self._topics[src.pod] -= 1
                if not self._topics[src.pod]:
                    del self._topics[src.pod], self._blocks[src.pod]

    def _source(self, source: str) -> Source:
        found = self._sources.get(source)
        if found is None:
            parts = source.split("@")
            tenant = parts[3] if len(parts) > 3 else None
            found = self._sources[source] = Source(pod_of(source), tenant)
            self._blocks.setdefault(found.pod, 0)
            self._topics[found.pod] = self._topics.get(found.pod, 0) + 1
        return found

    def _apply_one(self, name: str, src: Source, event: Any) -> None:
        if not isinstance(event, list) or not event or not isinstance(event[0], str):
            raise BadEvent("event: expected [class name, fields...]")
        kind = event[0]
        if kind == "BlockStored" and len(event) >= 7:
            self._stored(name, src, event)
        elif kind == "BlockRemoved" and len(event) >= 2:
            hashes = block_hashes(event[1])
            bit = src.media.get(medium_of(event[2] if len(event) > 2 else None), 0)
            for h in hashes:  # a medium the source never named holds none of them
                self._drop(name, src, h, bit)
        elif kind == "AllBlocksCleared":
            self._clear(name)
        else:
            raise BadEvent(f"event: {kind!r} with {len(event)} fields")

    def _stored(self, name: str, src: Source, event: list[Any]) -> None:
        hashes, parent, tokens, block_size = block_hashes(event[1]), event[2], event[3], event[4]
        if type(block_size) is not int or block_size != self.block_size:
            self._stats["block_size"] += 1
            raise BadEvent(f"block_size: got {shown(block_size)}, expected {self.block_size}")
        # packed outside the lock (`runs.cut`), else here
        data = (
            tokens if type(tokens) is runs.Encoded else runs.packed(tokens, len(hashes), block_size)
        )
        lora = event[7] if len(event) > 7 else None
        if lora is not None and not isinstance(lora, str):
            raise BadEvent("lora_name: expected a string or nil")
        bit = bit_of(src, medium_of(event[6]))
        if parent is None:
            previous = seed(lora)
        else:
            found = src.keys.get(block_hash(parent))
            if found is None:
                self._stats["orphans"] += 1
                raise BadEvent("parent_block_hash: not a block this source holds")
            previous = found
        new = len({h for h in hashes if h not in src.keys})
        if self._blocks[src.pod] + new > self.max_blocks:
            self._stats["full"] += 1
            raise BadEvent(f"pod {src.pod!r}: {new} blocks more, past the {self.max_blocks}")
        for h, key in zip(hashes, chain(previous, data, block_size), strict=True):
            old = src.keys.get(h)
            if old is not None and old != key:  # a hash reused for other tokens: move it
                self._drop(name, src, h, -1)
            if h not in src.keys:
                if len(src.hashes.get(key, ())) >= MAX_HASHES:  # the oldest goes (module doc)
                    self._drop(name, src, src.hashes[key][0], -1)
                self._blocks[src.pod] += 1
                src.keys[h] = key
                src.hashes[key] = (*src.hashes.get(key, ()), h)  # one key, several hashes
            src.masks[h] = src.masks.get(h, 0) | bit
            src.held[key] = src.held.get(key, 0) | bit
            self._where.setdefault(key, {})[name] = src.held[key]

    def _drop(self, name: str, src: Source, h: Any, bit: int) -> None:
        """`h` lost the media of `bit` (-1: all) at `src`; its key keeps the media of its other
        hashes (module doc)."""
        key = src.keys.get(h)
        if key is None:
            return
        mask = src.masks[h] & ~bit
        if mask:
            src.masks[h] = mask
        else:
            del src.masks[h], src.keys[h]
            self._blocks[src.pod] -= 1
            src.hashes[key] = tuple(other for other in src.hashes[key] if other != h)
        held = 0
        for other in src.hashes[key]:
            held |= src.masks[other]
        holders = self._where.get(key, {})
        if held:
            src.held[key] = holders[name] = held
            return
        src.held.pop(key, None)
        src.hashes.pop(key, None)
        holders.pop(name, None)
        if not holders:
            self._where.pop(key, None)

    def _clear(self, name: str) -> None:
        src = self._sources.get(name)
        if src is None:
            return
        self._stats["cleared"] += 1
        for key in src.held:
            holders = self._where.get(key)
            if holders is not None:
                holders.pop(name, None)
                if not holders:
                    del self._where[key]
        self._blocks[src.pod] -= len(src.keys)
        src.keys.clear()  # emptied in place: a batch that goes on after it still holds `src`
        src.masks.clear()
        src.held.clear()
        src.hashes.clear()

    # ---- answering ---------------------------------------------------------------------

    def score(
        self, tokens: Tokens, lora_name: str | None = None, tenant: str | None = None
    ) -> dict[str, float]:
        """`{pod: weighted prefix length in tokens}` for every pod holding the first block
        (`tenant`: in its topics, or in topics of no tenant: module doc);
        `InvalidTokensError` unless `tokens` are ids in [0, 2**32) (a cast would wrap -1 or
        2**32 + 5 into another prompt's ids), `InvalidArgumentError` unless `lora_name` and
        `tenant` are strings or None (`checks`)."""
        checks.name("tenant", tenant)
        data = encode_tokens(tokens)  # first: None, "" or a dict is an InvalidTokensError too
        keys = chain(seed(checks.name("lora_name", lora_name)), data, self.block_size)
        scores: dict[str, float] = {}
        with self._lock:
            alive: set[str] | None = None
            for key in keys:
                best: dict[str, float] = {}
                for name, mask in self._where.get(key, {}).items():
                    src = self._sources[name]
                    if tenant is not None and src.tenant not in (None, tenant):
                        continue
                    if alive is None or src.pod in alive:
                        best[src.pod] = max(best.get(src.pod, 0.0), weight(src, mask, self.weights))
                if not best:
                    break
                for pod, best_weight in best.items():
                    scores[pod] = scores.get(pod, 0.0) + best_weight * self.block_size
                alive = set(best)
        return scores

    def pods(self) -> dict[str, int]:
        """Blocks known per pod heard from (0: it told of none, or told to forget them)."""
        with self._lock:
            out: dict[str, int] = {}
            for src in self._sources.values():
                out[src.pod] = out.get(src.pod, 0) + len(src.held)
            return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "blocks": len(self._where), "sources": len(self._sources)}

    def orphans(self) -> int:
        """BlockStored events skipped so far for want of their parent (`stats()["orphans"]`)."""
        with self._lock:
            return self._stats["orphans"]

    def check(self) -> None:
        with self._lock:
            pairs = {(k, n): m for k, holders in self._where.items() for n, m in holders.items()}
            held = {(k, n): m for n, s in self._sources.items() for k, m in s.held.items()}
            assert pairs == held, "_where and the sources' held media differ"
            assert all(pairs.values()), "a key held in no medium"
            mapped, topics = dict.fromkeys(self._blocks, 0), dict.fromkeys(self._topics, 0)
            for src in self._sources.values():
                src.check()
                mapped[src.pod] += len(src.keys)
                topics[src.pod] += 1
            assert mapped == self._blocks, f"blocks per pod {self._blocks}, mapped {mapped}"
            assert topics == self._topics, f"sources per pod {self._topics}, held {topics}"
