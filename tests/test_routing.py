"""The prefix index a router scores with (`kvtier.routing`): event batches built here from the
wire format's field positions (msgpack, not kvtier's encoder) teach it where blocks live, it
answers weighted prefix lengths per pod, and hostile payloads change nothing it knows. Then
the subscriber over real ZMQ sockets, fed by a real `EventPublisher`: a late join recovered
through the replay endpoint, a gap nobody can fill forgotten, a restarted publisher's blocks
forgotten. `check()` after each step."""

from __future__ import annotations

import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
from conftest import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidTokensError
from kvtier.events import EventPublisher, EventSettings
from kvtier.routing import BadEvent, PrefixIndex, Router, Subscriber

BS = 4  # tokens per block
A, B = "kv@pod-a@m", "kv@pod-b@m"


def batch(*events: list[Any]) -> bytes:
    packed: bytes = msgpack.packb([time.time(), list(events), None])
    return packed


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU"
) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, BS, None, medium, None]


def removed(hashes: list[int], medium: str = "GPU") -> list[Any]:
    return ["BlockRemoved", hashes, medium]


PROMPT = list(range(100, 116))  # 4 blocks


def test_a_pod_scores_the_blocks_it_holds_in_a_row_weighted_by_medium() -> None:
    index = PrefixIndex(BS, {"GPU": 1.0, "CPU": 0.5, "DISK": 0.25})
    # pod a: blocks 0, 1 on GPU, in two events chained by the parent hash; block 2 on DISK
    index.apply(A, batch(stored([11, 12], None, PROMPT[:8])))
    index.apply(A, batch(stored([13], 12, PROMPT[8:12], "DISK")))
    # pod b: blocks 0..3, but its own hashes; block 0 on CPU as well as GPU
    index.apply(B, batch(stored([7, 8, 9, 10], None, PROMPT, "CPU"), stored([7], None, PROMPT[:4])))
    index.check()
    assert index.score(PROMPT) == {"pod-a": 4 * (1 + 1 + 0.25), "pod-b": 4 * (1 + 0.5 * 3)}
    # another prompt sharing block 0 only, then diverging
    assert index.score([*PROMPT[:4], 1, 2, 3, 4]) == {"pod-a": 4.0, "pod-b": 4.0}
    assert index.score([1, 2, 3, 4, *PROMPT[4:]]) == {}  # a prefix, not any run
    assert index.score(PROMPT[:3]) == {}  # no full block
    # pod b loses block 1 from CPU: its prefix ends at block 0
    index.apply(B, batch(removed([8], "CPU")))
    index.check()
    assert index.score(PROMPT) == {"pod-a": 9.0, "pod-b": 4.0}
    # block 0 of pod b leaves GPU but stays on CPU; then AllBlocksCleared forgets pod a
    index.apply(B, batch(removed([7])))
    index.apply(A, batch(["AllBlocksCleared"]))
    index.check()
    assert index.score(PROMPT) == {"pod-b": 2.0}
    assert index.pods() == {"pod-a": 0, "pod-b": 3}  # b: blocks 0, 2, 3 (2, 3 past a hole)


def test_an_unweighted_medium_counts_as_gpu_and_lora_names_are_kept_apart() -> None:
    index = PrefixIndex(BS, {"GPU": 1.0})
    lora = ["BlockStored", [1], None, PROMPT[:4], BS, 3, "NVME", "adapter-x"]
    index.apply(A, batch(lora, stored([2], None, PROMPT[:4], "SSD")))
    assert index.score(PROMPT) == {"pod-a": 4.0}  # SSD: no weight given, as GPU
    assert index.score(PROMPT, lora_name="adapter-x") == {"pod-a": 4.0}
    assert index.score(PROMPT, lora_name="other") == {}
    index.check()


HOSTILE = [
    b"\xc1",  # not msgpack
    msgpack.packb({"ts": 1}),  # not a batch
    msgpack.packb([1.0, "events", None]),
]
BAD_EVENTS = [
    ["BlockStored", [1], None, PROMPT[:4], 8, None, "GPU", None],  # other block size
    ["BlockStored", [1], None, PROMPT[:3], BS, None, "GPU", None],  # tokens short
    ["BlockStored", [1], 999, PROMPT[:4], BS, None, "GPU", None],  # unknown parent (orphan)
    ["BlockStored", [-1], None, PROMPT[:4], BS, None, "GPU", None],  # hash out of range
    ["BlockStored", [1.5], None, PROMPT[:4], BS, None, "GPU", None],  # a float hash
    ["BlockStored", [1], None, [-5, 1, 2, 3], BS, None, "GPU", None],  # token out of range
    ["BlockStored", [1], None, ["a", 1, 2, 3], BS, None, "GPU", None],
    ["BlockStored", [1], None, [t + 0.25 for t in PROMPT[:4]], BS, None, "GPU", None],  # floats
    ["BlockStored", [1], None, [2**64 - 1, -1, 2, 3], BS, None, "GPU", None],  # no one dtype
    ["BlockStored", [1], None, PROMPT[:4], BS, None, {"x": 1}, None],  # medium not a string
    ["BlockStored", [1], None, PROMPT[:4], BS, None, "GPU", 7],  # lora name not a string
    ["BlockStored", "ab", None, PROMPT[:4], BS, None, "GPU", None],
    ["BlockRemoved", 5, "GPU"],
    ["Nope", 1],
    [],
    "BlockStored",
]


@pytest.mark.parametrize("payload", HOSTILE)
def test_a_payload_that_is_no_event_batch_is_refused_and_changes_nothing(payload: bytes) -> None:
    index = PrefixIndex(BS)
    index.apply(A, batch(stored([1], None, PROMPT[:4])))
    with pytest.raises(BadEvent, match="payload"):
        index.apply(A, payload)
    index.check()
    assert index.score(PROMPT) == {"pod-a": 4.0}
    assert index.stats()["bad"] == 1


@pytest.mark.parametrize("event", BAD_EVENTS, ids=range(len(BAD_EVENTS)))
def test_a_bad_event_is_skipped_and_counted_and_the_good_ones_beside_it_applied(event: Any) -> None:
    index = PrefixIndex(BS)
    assert index.apply(A, batch(event, stored([1], None, PROMPT[:4]))) == 1
    index.check()
    assert index.score(PROMPT) == {"pod-a": 4.0}
    assert index.stats()["bad"] == 1


def test_a_hash_reused_for_other_tokens_moves_the_block() -> None:
    index = PrefixIndex(BS)
    index.apply(A, batch(stored([1], None, PROMPT[:4])))
    index.apply(A, batch(stored([1], None, PROMPT[4:8])))  # a publisher that reuses numbers
    index.check()
    assert index.score(PROMPT) == {}
    assert index.score(PROMPT[4:8]) == {"pod-a": 4.0}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([A, B]), st.integers(0, 5), st.booleans()), max_size=40))
def test_the_index_always_agrees_with_a_set_model(steps: list[tuple[str, int, bool]]) -> None:
    """Blocks 0..5 of one prompt, stored (with their parents) or removed at random per pod: the
    score is the model's longest run from block 0 held by each pod."""
    prompt = list(range(24))
    index = PrefixIndex(BS)
    held: dict[str, set[int]] = {A: set(), B: set()}
    for source, block, add in steps:
        base = 100 if source == A else 200  # each pod hashes its own way
        if add:
            parent = None if block == 0 else base + block - 1
            if block and block - 1 not in held[source]:
                assert index.apply(source, batch(stored([base + block], parent, []))) == 0
                continue  # an orphan (and a short token list): skipped
            index.apply(source, batch(stored([base + block], parent, prompt[block * 4 :][:4])))
            held[source].add(block)
        else:
            index.apply(source, batch(removed([base + block])))
            held[source].discard(block)
        index.check()
    expected = {}
    for source, blocks in held.items():
        run = next(i for i in range(7) if i not in blocks)
        if run:
            expected[source.split("@")[1]] = 4.0 * run
    assert index.score(prompt) == expected


def test_prefix_load_keeps_the_busiest_replica_near_the_mean() -> None:
    index = PrefixIndex(BS)
    index.apply(A, batch(stored([1], None, PROMPT[:4])))  # every prompt's block 0 is on pod a
    pods = ["pod-a", "pod-b", "pod-c"]
    prefix, balanced = Router(pods, "prefix", index), Router(pods, "prefix-load", index, 0.2)
    for n in range(300):
        prompt = PROMPT[:4] + [n] * 4
        prefix.choose(prompt)
        balanced.choose(prompt)
    assert prefix.assigned == {"pod-a": 300, "pod-b": 0, "pod-c": 0}  # a hot prefix pins
    assert balanced.imbalance() <= 1.2 + 3 / 100
    assert balanced.assigned["pod-a"] > balanced.assigned["pod-b"]  # still prefers the holder
    rr = Router(pods, "round-robin")
    assert [rr.choose(PROMPT) for _ in range(4)] == ["pod-a", "pod-b", "pod-c", "pod-a"]
    with pytest.raises(ValueError, match="policy"):
        Router(pods, "random", index)


# ---- the subscriber, over real sockets -----------------------------------------------------


def publisher(topic: str, replay: bool = True, host: str = "127.0.0.1") -> EventPublisher:
    return EventPublisher(
        f"tcp://{host}:0",
        f"tcp://{host}:0" if replay else None,
        EventSettings(topic, max_batch=1, flush_s=0.001),
    )


def tokens_of(block: int) -> list[int]:
    return [block * BS + j for j in range(BS)]


def announce(pub: EventPublisher, blocks: range, base: int = 0) -> None:
    for b in blocks:
        pub.stored("", [base + b], base + b - 1 if b else None, tokens_of(b), BS, "GPU")
    pub.flush()


PROMPT8 = [t for b in range(8) for t in tokens_of(b)]


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])  # ZMQ needs IPv6 asked for
def test_a_late_subscriber_recovers_what_it_missed_through_the_replay_endpoint(host: str) -> None:
    pub = publisher(A, host=host)
    assert pub.endpoint.startswith(f"tcp://{host}:")
    announce(pub, range(5))  # sent before anyone listens: lost to a SUB, kept for replay
    index = PrefixIndex(BS)
    sub = Subscriber(index)
    sub.add(pub.endpoint, pub.replay_endpoint)
    time.sleep(0.3)  # the subscription reaches the PUB
    announce(pub, range(5, 6))
    assert sub.wait(A, 6)
    assert index.score(PROMPT8) == {"pod-a": 6.0 * BS}
    assert sub.stats()["gaps"] == 1 and sub.stats()["replayed"] == 5
    index.check()
    sub.close()
    pub.close()


def test_a_gap_nobody_can_fill_forgets_the_topic_and_a_restart_too() -> None:
    pub = publisher(A, replay=False)
    announce(pub, range(3))
    index = PrefixIndex(BS)
    sub = Subscriber(index)
    sub.add(pub.endpoint)
    time.sleep(0.3)
    announce(pub, range(3, 4))  # chains from block 2, which the index never learnt
    assert sub.wait(A, 4)
    assert index.score(PROMPT8) == {}  # forgotten, and the orphan skipped
    assert sub.stats()["resets"] == 1
    port = pub.endpoint
    pub.close()
    # the same address, a new publisher: numbers start again; what it says first is kept
    again = EventPublisher(port, settings=EventSettings(A, max_batch=1, flush_s=0.001))

    def joined() -> bool:
        again.cleared("")  # nothing to forget; sent until the subscriber has reconnected
        again.flush()
        # a number below the last seen: a restart (and a gap after it when the first
        # messages went out before the subscriber had reconnected: forgotten once more)
        return sub.stats()["resets"] >= 2

    assert wait_until(joined)
    announce(again, range(2), base=50)
    assert wait_until(lambda: index.score(PROMPT8) == {"pod-a": 2.0 * BS})
    index.check()
    sub.close()
    again.close()


def test_scores_follow_several_real_publishers() -> None:
    pubs = [publisher(A), publisher(B)]
    index = PrefixIndex(BS)
    sub = Subscriber(index)
    for pub in pubs:
        sub.add(pub.endpoint, pub.replay_endpoint)
    time.sleep(0.3)
    announce(pubs[0], range(8))
    announce(pubs[1], range(3), base=1000)
    assert sub.wait(A, 8) and sub.wait(B, 3)
    assert index.score(np.array(PROMPT8)) == {"pod-a": 32.0, "pod-b": 12.0}
    pubs[0].removed("", [2], "GPU")
    pubs[0].flush()
    assert sub.wait(A, 9)
    assert index.score(PROMPT8) == {"pod-a": 8.0, "pod-b": 12.0}
    index.check()
    sub.close()
    for pub in pubs:
        pub.close()


def test_a_snapshot_that_is_stale_or_fails_ends_in_a_reset_not_a_loop() -> None:
    """A resync source that answers an old snapshot (its number below the message that showed
    the gap), then one that raises: each gap is asked about once, then the topic forgotten."""
    pub = publisher(A, replay=False)
    announce(pub, range(3))  # missed: sent before the subscriber joins
    stale = {"block_size": BS, "topics": [{"topic": A, "seq": 0, "events": batch()}]}
    calls: list[int] = []

    def snapshot() -> dict[str, Any]:
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionError("the sidecar is down")
        return stale

    index = PrefixIndex(BS)
    sub = Subscriber(index, resync_s=0.5)  # and every 0.5 s: the failing answers
    sub.add(pub.endpoint, None, snapshot)
    time.sleep(0.3)
    announce(pub, range(3, 4))  # seq 3: a gap the stale snapshot does not cover
    assert sub.wait(A, 4)
    pub.removed("", [0], "GPU")
    pub.flush()
    assert sub.wait(A, 5)  # the thread goes on
    stats = sub.stats()
    assert calls and stats["resyncs"] == 1 and stats["resets"] == 1
    assert wait_until(lambda: sub.stats()["resync_errors"] >= 1)  # counted, nothing else
    announce(pub, range(9, 10))
    assert sub.wait(A, 6) and sub.stats()["resets"] == 1
    index.check()
    sub.close()
    pub.close()


@pytest.mark.parametrize(
    "tokens",
    [[*PROMPT[:7], -1], [*PROMPT[:7], 2**32 + PROMPT[7]], [float(t) for t in PROMPT], [PROMPT]],
    ids=["negative", "past 32 bits", "floats", "2-D"],
)
def test_a_score_of_tokens_that_are_no_ids_is_refused_not_wrapped(tokens: Any) -> None:
    """-1 would be 0xFFFFFFFF and 2**32 + t would be t once cast to uint32: another prompt."""
    index = PrefixIndex(BS)
    index.apply(A, batch(stored([1, 2], None, PROMPT[:8])))
    assert index.score(PROMPT[:8]) == {"pod-a": 8.0}
    with pytest.raises(InvalidTokensError, match="tokens"):
        index.score(tokens)
    assert index.score(np.array(PROMPT[:8], dtype=np.uint32)) == {"pod-a": 8.0}
