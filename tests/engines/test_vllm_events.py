"""kvtier's blocks in vLLM's own KV-event stream (`kvtier.integrations.vllm_events`): the
connector's scheduler subscribes to the sidecar's events and vLLM publishes them with its own.

End to end: a `kvtier serve` with events on, a vLLM engine (`vllm_engine.py`: vLLM's real
`Scheduler` with its ZMQ publisher) whose request the connector saves; a subscriber of vLLM's
PUB decodes, with vLLM's own classes, kvtier's copies next to vLLM's GPU blocks. Then the relay
alone, fed over real ZMQ by a real sidecar and by a hostile publisher: what vLLM is handed
follows the sidecar's residency, bad events never reach vLLM's encoder, and a queue that vLLM
does not drain (an idle engine) ends in removals and a resync, never in a claim of what kvtier
dropped.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \
        python -m pytest tests/engines/test_vllm_events.py
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import yaml
import zmq
from engine_process import launch as run_engine
from engine_process import report as engine_report
from service_server import ADMIN_KEY, Server, free_port, kv_of, running, write_config

from kvtier.client import Client
from kvtier.errors import ConfigError

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvtier.integrations.settings import ConnectorSettings
from kvtier.integrations.vllm_events import Relay
from kvtier.routing import Subscriber

ENGINE = Path(__file__).with_name("vllm_engine.py")
ALICE = "alice-key-0123456789abcdef"
BLOCK = 16  # vLLM's block size in vllm_engine.py, and the sidecar's here
TOPIC = "kv@pod-1@tiny"
PROMPT = list(range(1000, 1040))  # 40 tokens: 2 whole blocks saved


def sidecar_config(directory: Path, block: int = BLOCK, replay: bool = True) -> tuple[Path, str]:
    """A sidecar of `block`-token blocks with events on; its config and events endpoint."""
    config = write_config(directory, tenants={"alice": {"api_keys": [ALICE]}})
    document = yaml.safe_load(config.read_text())
    document["block_tokens"] = block
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    document["events"] = {"endpoint": endpoint, "topic": TOPIC}
    if replay:
        document["events"]["replay_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    config.write_text(yaml.safe_dump(document))
    return config, endpoint


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    config, endpoint = sidecar_config(tmp_path)
    with running(config) as server:
        yield server, endpoint


def engine(server: Server, **args: Any) -> dict[str, Any]:
    body = {"url": server.url, "api_key": ALICE, "prompt": PROMPT, "seed": 5, **args}
    return engine_report(run_engine(ENGINE, body))


def test_kvtiers_copies_go_out_in_vllms_own_stream_next_to_its_gpu_blocks(
    sidecar: tuple[Server, str],
) -> None:
    server, endpoint = sidecar
    report = engine(server, kv_events=free_port(), relayed_blocks=4,
                    extra={"kvtier.events_endpoint": endpoint})  # fmt: skip
    assert report["finished"] == "FINISHED_LENGTH_CAPPED", report
    events = report["vllm_events"]
    with Client(server.url, api_key=ADMIN_KEY, shared_memory=False) as admin:
        snapshot = admin.blocks()["topics"][0]  # a shared topic's: the admin's to take
    ours = {h for e in msgpack.unpackb(snapshot["events"])[1] for h in e[1]}  # kvtier's hashes
    assert len(ours) == 2
    own = [e for e in events if e[0] == "BlockStored" and not ours & set(e[2])]
    assert own and {e[1] for e in own} == {"GPU"}, events  # vLLM's own blocks
    kvtier: dict[str, list[int]] = {}  # medium -> tokens kvtier told of there, in order
    for kind, medium, hashes, tokens in events:
        if kind == "BlockStored" and set(hashes) <= ours:
            kvtier.setdefault(medium, []).extend(tokens)
    # write_through: the two whole blocks in kvtier's gpu and host tiers, in vLLM's stream
    assert kvtier == {"GPU": PROMPT[:32], "CPU": PROMPT[:32]}, (kvtier, events)
    stats = report["relay_stats"]
    assert stats["bad"] == 0 and stats["lost"] == 0 and stats["blocks"] == 2, stats
    counts = report["scheduler_stats"]  # the connector's counts, reported through vLLM's
    relayed = len([e for e in events if set(e[2]) <= ours])
    assert counts["relayed_events"] == relayed and counts["refused_events"] == 0, counts


def test_events_of_another_block_size_are_not_relayed(tmp_path: Path) -> None:
    config, endpoint = sidecar_config(tmp_path, block=4)  # a divisor of vLLM's 16: loads work
    with running(config) as server:
        report = engine(server, kv_events=free_port(), relayed_blocks=1,
                        extra={"kvtier.events_endpoint": endpoint})  # fmt: skip
    assert report["hit"] == 0 and report["finished"] == "FINISHED_LENGTH_CAPPED", report
    assert not [e for e in report["vllm_events"] if e[1] != "GPU"], report["vllm_events"]
    stats = report["relay_stats"]
    assert stats["block_size"] >= 1 and stats["blocks"] == 0, stats
    assert report["scheduler_stats"]["refused_events"] == stats["bad"] >= 1, report


def test_an_events_endpoint_without_vllms_events_is_refused_at_start(
    sidecar: tuple[Server, str],
) -> None:
    body = {"url": sidecar[0].url, "api_key": ALICE, "prompt": PROMPT, "seed": 5,
            "extra": {"kvtier.events_endpoint": sidecar[1]}}  # fmt: skip
    done = run_engine(ENGINE, body)
    assert done.returncode != 0
    assert "kvtier.events_endpoint" in done.stderr and "enable_kv_cache_events" in done.stderr


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"kvtier.events_endpoint": "tcp://*:5557"}, "kvtier.events_endpoint"),  # binds
        ({"kvtier.events_endpoint": "http://host:5557"}, "kvtier.events_endpoint"),
        ({"kvtier.events_endpoint": "tcp://h:99999"}, "kvtier.events_endpoint"),
        ({"kvtier.events_endpoint": 5557}, "kvtier.events_endpoint"),
        ({"kvtier.events_replay_endpoint": "tcp://h:1"}, "kvtier.events_endpoint"),
        ({"kvtier.events_endpoint": "tcp://h:1", "kvtier.events_topic": 7}, "kvtier.events_topic"),
        ({"kvtier.events_endpint": "tcp://h:1"}, "kvtier.events_endpint"),
    ],
)
def test_bad_relay_settings_are_refused_by_name(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        ConnectorSettings.parse(extra, 1)
    assert key in str(raised.value)


# ---- the relay alone, over real ZMQ ------------------------------------------------------


def through_vllm(events: list[Any]) -> list[Any]:
    """`events` as a subscriber of vLLM's PUB gets them: encoded by vLLM's own encoder."""
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))
    return list(msgspec.msgpack.Decoder(KVEventBatch).decode(payload).events)


def fold(state: dict[tuple[int, str], list[int]], events: list[Any], strict: bool = True) -> None:
    """Apply vLLM-stream events to `state` ((hash, medium) -> tokens), as a router would;
    `strict`: every removal names a block `state` holds."""
    for e in events:
        if isinstance(e, BlockStored):
            for i, h in enumerate(e.block_hashes):
                state[(h, e.medium)] = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
        else:
            assert isinstance(e, BlockRemoved), e
            for h in e.block_hashes:
                assert not strict or (h, e.medium) in state, (h, e.medium)
                state.pop((h, e.medium), None)


def held(server: Server) -> dict[tuple[int, str], list[int]]:
    """The sidecar's residency, from its snapshot: (hash, medium) -> tokens."""
    with Client(server.url, api_key=ADMIN_KEY, shared_memory=False) as admin:
        topics = admin.blocks()["topics"]
    state: dict[tuple[int, str], list[int]] = {}
    for topic in topics:
        for e in msgpack.unpackb(topic["events"])[1]:
            for i, h in enumerate(e[1]):
                state[(h, e[6])] = e[3][i * e[4] : (i + 1) * e[4]]
    return state


def settle(relay: Relay, state: dict[tuple[int, str], list[int]], want: Callable[[], Any]) -> None:
    """Take and fold the relay's events until `state` is `want()` (or 10 s)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        fold(state, through_vllm(relay.take()))
        relay.check()
        if state == want():
            return
        time.sleep(0.05)
    assert state == want()


def test_the_relay_follows_the_sidecars_residency_through_stores_moves_and_clears(
    sidecar: tuple[Server, str],
) -> None:
    server, endpoint = sidecar
    relay = Relay(BLOCK)
    with Client(server.url, api_key=ADMIN_KEY, shared_memory=False) as admin:
        sub = Subscriber(relay, resync_s=None)
        sub.add(endpoint, None, admin.blocks)
        time.sleep(0.3)
        state: dict[tuple[int, str], list[int]] = {}
        with Client(server.url, api_key=ALICE, shared_memory=False) as alice:
            for n in range(12):  # more than the gpu tier's 16 blocks: demotions and drops
                alice.store(list(range(10_000 * n, 10_000 * n + 48)), kv_of(48, seed=n))
                settle(relay, state, lambda: held(server))
        assert {m for _, m in state} == {"GPU", "CPU"} and len(state) > 16
        server.admin("/v1/admin/clear", params={"tenant": "alice"})
        settle(relay, state, lambda: held(server))
        assert state == {}
        sub.close()
    assert relay.stats()["bad"] == relay.stats()["lost"] == 0


def test_hostile_events_never_reach_vllm_and_good_ones_beside_them_do() -> None:
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    relay = Relay(4)
    sub = Subscriber(relay, resync_s=None)
    sub.add(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)
    good = ["BlockStored", [1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU", None]
    bad: list[Any] = [
        ["BlockStored", [3], None, [-1, 2, 3, 4], 4, None, "CPU"],  # a token below 0
        ["BlockStored", [3], None, [2**32, 2, 3, 4], 4, None, "CPU"],  # past uint32
        ["BlockStored", [3], None, [1.5, 2, 3, 4], 4, None, "CPU"],
        ["BlockStored", [-1], None, [1, 2, 3, 4], 4, None, "CPU"],  # no uint64
        ["BlockStored", ["x"], None, [1, 2, 3, 4], 4, None, "CPU"],
        ["BlockStored", [3], "parent", [1, 2, 3, 4], 4, None, "CPU"],
        ["BlockStored", [3], None, [1, 2, 3], 4, None, "CPU"],  # tokens short of a block
        ["BlockStored", [3], None, [1, 2, 3, 4], 4, None, {"m": 1}],
        ["BlockStored", [3], None, [1, 2, 3, 4], 4, None, "CPU", None, [["salt"]]],
        ["BlockStored", [3], None, [1, 2, 3, 4], 4, None, "CPU", 12],  # a LoRA name of 12
        ["BlockStored", [3], None, [1, 2, 3, 4], 4, "x", "CPU"],  # a LoRA id of "x"
        ["BlockRemoved", "all", "CPU"],
        ["Evicted", [1]],
        "BlockStored",
    ]
    seq = 0
    for payload in (msgpack.packb([0.0, [*bad, good], None]), b"\xc1 not msgpack"):
        pub.send_multipart([b"kv@p@m", seq.to_bytes(8, "big"), payload])
        seq += 1
    removal = msgpack.packb(
        [0.0, [["BlockRemoved", [2, 99], "CPU"], ["BlockRemoved", [1], "DISK"]]]
    )
    pub.send_multipart([b"kv@p@m", seq.to_bytes(8, "big"), removal])
    assert sub.wait("kv@p@m", 3)
    taken = through_vllm(relay.take())
    assert [type(e).__name__ for e in taken] == ["BlockStored", "BlockRemoved"], taken
    assert taken[0].block_hashes == [1, 2] and taken[0].token_ids == good[3]
    assert taken[1].block_hashes == [2] and taken[1].medium == "CPU"  # 99 and DISK: never told
    stats = relay.stats()
    assert stats["bad"] == len(bad) + 1 and stats["blocks"] == 1, stats
    relay.check()
    sub.close()
    pub.close()


def test_a_queue_vllm_does_not_drain_ends_in_removals_and_a_resync(tmp_path: Path) -> None:
    config, endpoint = sidecar_config(tmp_path)
    with (
        running(config) as server,
        Client(server.url, api_key=ALICE) as alice,
        Client(server.url, api_key=ADMIN_KEY, shared_memory=False) as admin,
    ):
        relay = Relay(BLOCK, max_pending=6)
        sub = Subscriber(relay, resync_s=None)
        sub.add(endpoint, None, admin.blocks)  # a shared topic's snapshot: the admin's
        time.sleep(0.3)
        state: dict[tuple[int, str], list[int]] = {}
        alice.store(PROMPT[:32], kv_of(32, seed=1))  # 2 blocks in 2 media: 4 of the 6
        settle(relay, state, lambda: held(server))
        for n in range(3):  # an idle engine: nothing taken while 12 blocks' events come
            alice.store(list(range(5000 * (n + 1), 5000 * (n + 1) + 32)), kv_of(32, seed=n))
        deadline = time.monotonic() + 10
        while relay.stats()["lost"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # the rest of the stores' events come, and are dropped
        assert relay.stats()["lost"] == 1 and relay.muted
        relay.check()  # muted: every invariant holds
        taken = through_vllm(relay.take())
        assert all(isinstance(e, BlockRemoved) for e in taken), taken
        fold(state, taken, strict=False)  # blocks queued, dropped unsent, are removed too
        assert state == {}  # the router is told kvtier holds nothing, not something it lacks
        alice.store(PROMPT[:16] + [1, 2, 3, 4] * 4, kv_of(32, seed=9))  # the next message
        settle(relay, state, lambda: held(server))  # a snapshot brought everything back
        assert len(state) == 2 * 9 and sub.stats()["resyncs"] >= 1  # 9 blocks, 2 media
        sub.close()
