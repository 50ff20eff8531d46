"""Audit BA: what one tenant learns of another through the KV events (a real `kvtier serve`).

Event hashes came from one serial for every tenant, so a tenant that read its own blocks
(`GET /v1/blocks` with its key, per-tenant topics) before and after its stores learnt exactly
how many new nodes the other tenants had made in between: the gap between two of its hashes.
Each tenant now numbers from a serial of its own (`events/observer.py`, `FIRST_SERIALS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import yaml
from service_server import ADMIN_KEY, free_port, kv_of, running, write_config

from kvtier.blocks import BlockHasher, encode_tokens
from kvtier.client import Client
from kvtier.events import EventPublisher, EventSettings
from kvtier.events.observer import IndexEvents
from kvtier.index import RadixIndex

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-0123456789"


def _config(tmp_path: Path, per_tenant: bool) -> Path:
    path = write_config(
        tmp_path,
        tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
    )
    config = yaml.safe_load(path.read_text())
    config["events"] = {
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "topic": "kv@pod@tiny",
        "per_tenant_topic": per_tenant,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _first_hashes(snapshot: dict[str, Any], firsts: set[int]) -> dict[int, int]:
    """The hash of the first block of each prompt whose first token is in `firsts`."""
    found: dict[int, int] = {}
    for topic in snapshot["topics"]:
        _, events, _ = msgpack.unpackb(topic["events"], raw=False)
        for event in events:
            if event[0] == "BlockStored" and event[2] is None and event[3][0] in firsts:
                found[event[3][0]] = event[1][0]
    return found


def _gap(a: Client, b: Client, others: int, base: int) -> int:
    """B stores a prompt, A stores `others` new ones, B stores another: the gap between the
    hashes of B's two prompts in B's own snapshot."""
    b.store([base + 1] * 8, kv_of(8, 1))
    for i in range(others):
        a.store([base + 100 + i] * 4, kv_of(4, 2))
    b.store([base + 2] * 8, kv_of(8, 3))
    found = _first_hashes(b.blocks(), {base + 1, base + 2})
    return found[base + 2] - found[base + 1]


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_tenants_hashes_do_not_count_another_tenants_nodes(tmp_path: Path) -> None:
    with (
        running(_config(tmp_path, per_tenant=True)) as server,
        Client(server.url, api_key=KEY_A, shared_memory=False) as a,
        Client(server.url, api_key=KEY_B, shared_memory=False) as b,
    ):
        alone = _gap(a, b, 0, 1000)
        busy = _gap(a, b, 5, 2000)
        busier = _gap(a, b, 17, 3000)
        assert alone == busy == busier, (alone, busy, busier)  # was alone * (1 + others)
        assert server.admin("/v1/admin/check").json()["ok"] is True


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_tenants_hashes_stay_apart_on_a_shared_topic(tmp_path: Path) -> None:
    """On one topic the tenants' hashes never meet (a router keys a source's blocks by them),
    each prompt's blocks numbered consecutively."""
    with (
        running(_config(tmp_path, per_tenant=False)) as server,
        Client(server.url, api_key=KEY_A, shared_memory=False) as a,
        Client(server.url, api_key=KEY_B, shared_memory=False) as b,
    ):
        for i in range(6):
            a.store([5000 + i] * 8, kv_of(8, i))
            b.store([5000 + i] * 8, kv_of(8, i))  # the same tokens: other namespaces
        with Client(server.url, api_key=ADMIN_KEY, shared_memory=False) as admin:
            snapshot = admin.blocks()
        (topic,) = snapshot["topics"]
        _, events, _ = msgpack.unpackb(topic["events"], raw=False)
        hashes = [h for event in events if event[0] == "BlockStored" for h in event[1]]
        # 2 tenants, 6 prompts of 2 blocks: 24 blocks, told once per medium (gpu and host)
        assert len(hashes) == 2 * 24 and len(set(hashes)) == 24
        for event in events:
            if event[0] == "BlockStored":
                assert event[1] == list(range(event[1][0], event[1][0] + len(event[1])))
        assert server.admin("/v1/admin/check").json()["ok"] is True


class _Two:
    """A bare index of two tenants' namespaces and its observer (its queue kept: sent at close);
    `tenant_of` counts its calls (the observer asks it once per node it looks at)."""

    def __init__(self) -> None:
        hasher = BlockHasher()
        self.index = RadixIndex(("gpu",), 1, hasher, node_blocks=8)
        settings = EventSettings("kv@pod@tiny", queue_limit=10**6, per_tenant=True, flush_s=60.0)
        self.publisher = EventPublisher("tcp://127.0.0.1:0", settings=settings)
        self.seeds = {t: hasher.seed(b"\0" * 16, t.encode()) for t in ("alice", "bob")}
        owners: dict[bytes, str] = {seed: t for t, seed in self.seeds.items()}
        self.asked = 0

        def tenant_of(namespace: bytes) -> str | None:
            self.asked += 1
            return owners.get(namespace)

        self.observer = IndexEvents(self.publisher, self.index, tenant_of, tenants=self.seeds)
        self.index.observer = self.observer
        self.slot = 0

    def store(self, tenant: str, tokens: list[int]) -> int:
        """Insert `tokens` for `tenant`; the event hash of its first new block."""
        key = encode_tokens(tokens)
        match = self.index.match(self.seeds[tenant], key)
        count = len(tokens) - match.num_blocks
        self.index.insert(match, key, {0: list(range(self.slot, self.slot + count))})
        self.slot += count
        return int(self.observer.pending[-1][1][3])  # the told_stored spec's first hash

    def close(self) -> None:
        self.publisher.close()


def test_a_tenants_hash_gaps_are_the_same_whatever_the_others_store() -> None:
    two = _Two()
    try:
        gaps = []
        for others in (0, 3, 40):
            first = two.store("bob", [10_000 + others])
            for i in range(others):
                two.store("alice", [20_000 + 100 * others + i])
            gaps.append(two.store("bob", [30_000 + others]) - first)
        assert gaps[0] == gaps[1] == gaps[2], gaps  # was range * (1 + others)
        two.index.check()
    finally:
        two.close()


def test_a_tenants_snapshot_walks_its_own_namespace_only() -> None:
    """`told` for one tenant asks whose each node is only for that tenant's nodes (and each
    namespace's root): 3 asks, not 2,001 (one per node of every tenant)."""
    two = _Two()
    try:
        for i in range(2000):
            two.store("alice", [i + 1])
        two.store("bob", [7])
        two.asked = 0
        told = two.observer.told(lambda tenant: tenant == "bob")
        assert [tenant for tenant, _ in told] == ["bob"]
        assert two.asked <= 3, two.asked
        everyone = two.observer.told(lambda tenant: True)
        assert len(everyone) == 2001
        two.index.check()
    finally:
        two.close()
