"""Two tenants on a real `kvtier serve`, one of them hostile (issue 11, points 3 and 4).

Tenant A stores prompts; tenant B, with its own key, makes thousands of hostile calls: blind
reserve/commit, lease floods up to and past its quota, guessed lease and reservation ids,
status/metrics/config reads, huge `ttl_s`, and stores that would evict A. Then A loads
everything bit-exact, A keeps its floor on the gpu, and B learned nothing: no byte of A's KV
in any answer B got, and no trace of A's activity in B's status.

Assertions that rest on other parts of issue 11: a blind commit answers 409 `not_written`
(canaries, `tenancy.py`); `/metrics` and `/v1/config` answer 403 to a tenant key
(`service/app.py`). The rest is this suite's own (`tenancy.py`, `index/eviction.py`,
`status.py`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from service_server import ADMIN_KEY, BT, Server, kv_of, running, tokens_of, write_config

from kvtier.blocks import encode_tokens
from kvtier.client import Client
from kvtier.service import wire

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-9876543210"
GPU_BLOCKS, HOST_BLOCKS = 32, 64  # each tenant: quota and floor of 16 gpu and 32 host blocks
PROMPTS = 12  # A's prompts, of 2 blocks each: 24 blocks, more than its gpu floor of 16
B_LEASES = 64  # B's lease quota, small so that its flood passes it quickly


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = write_config(
        tmp_path,
        gpu_blocks=GPU_BLOCKS,
        host_blocks=HOST_BLOCKS,
        tenants={
            "a": {"api_keys": [KEY_A]},
            "b": {"api_keys": [KEY_B], "quota": {"leases": B_LEASES}},
        },
    )
    with running(config) as live:
        yield live


class Hostile:
    """Tenant B over raw HTTP: msgpack bodies (so that KV could come back as bytes), every
    answer kept, and every answer checked to be a documented status with `{error, detail}`."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(
            base_url=url,
            timeout=30,
            headers={
                "authorization": f"Bearer {KEY_B}",
                "content-type": wire.MSGPACK,
                "accept": wire.MSGPACK,
            },
        )
        self.answers: list[bytes] = []
        self.statuses: dict[int, int] = {}

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        response = self.http.post(path, content=wire.encode(body, True))
        return self._keep(response)

    def get(self, path: str, **params: Any) -> tuple[int, dict[str, Any]]:
        return self._keep(self.http.get(path, params=params))

    def _keep(self, response: httpx.Response) -> tuple[int, dict[str, Any]]:
        self.answers.append(response.content)
        status = response.status_code
        self.statuses[status] = self.statuses.get(status, 0) + 1
        assert status < 500, (status, response.text[:300])
        if status == 200 and response.headers["content-type"].startswith("text/plain"):
            return status, {}  # /metrics, were it ever open to a tenant
        body = wire.decode(response.content, response.headers["content-type"])
        if status != 200:
            assert set(body) == {"error", "detail"}, body
        return status, body

    def close(self) -> None:
        self.http.close()


def tokens(base: int, blocks: int) -> bytes:
    return encode_tokens(tokens_of(base, blocks * BT))


def probes(kv: torch.Tensor) -> list[bytes]:
    """64-byte pieces of every block of `kv` (raw, block-major as the pools hold them): one
    of them in an answer would be a byte of A's KV seen by B."""
    raw = kv.permute(2, 0, 1, 3, 4).contiguous().view(torch.uint8).numpy().tobytes()
    return [raw[i : i + 64] for i in range(0, len(raw), 1024)]


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_hostile_tenant_neither_starves_reads_nor_watches_another(server: Server) -> None:
    rng = random.Random(11)
    prompts = [(tokens_of(1000 + 100 * i, 2 * BT), kv_of(2 * BT, seed=i)) for i in range(PROMPTS)]
    with Client(server.url, api_key=KEY_A, shared_memory=False) as a:
        for toks, kv in prompts:
            assert a.store(toks, kv).stored_tokens == 2 * BT
        a_lease = a.prefetch(prompts[0][0])  # held by A all through B's campaign
    b = Hostile(server.url)
    try:
        _campaign(b, rng, a_lease.lease_id, [toks for toks, _ in prompts])
        # B's status, then A busy (lookups, loads through the body: nothing that needs room),
        # then B's status again: equal, to the byte
        assert server.admin("/v1/admin/clear", params={"tenant": "b"}).json()["dropped_blocks"]
        _, before = b.get("/v1/status")
        assert before["tenant"] == "b"
        assert not {"paths", "mover", "index", "recovery", "hit_rate_global"} & set(before)
        assert not {"used_bytes", "free_slots", "bytes_in"} & set(before["tiers"]["gpu"])
        with Client(server.url, api_key=KEY_A, shared_memory=False) as a:
            for toks, kv in prompts:
                assert a.lookup(toks).num_tokens == 2 * BT
                loaded = a.load(toks)
                assert loaded.num_tokens == 2 * BT
                assert torch.equal(loaded.kv.view(torch.int16), kv.view(torch.int16))
            a.release(a_lease)  # A's lease outlived B's guesses
        _, after = b.get("/v1/status")
        assert after == before
        for answer in b.answers:  # B saw no byte of A's KV
            for _, kv in prompts:
                assert not any(probe in answer for probe in probes(kv))
    finally:
        b.close()
    status = server.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert status["tiers"]["gpu"]["blocks"] >= 16  # A's floor held, whatever B stored
    with Client(server.url, api_key=KEY_A, shared_memory=False) as a:
        assert sum(a.lookup(toks).gpu_tokens for toks, _ in prompts) >= 16 * BT
    assert server.admin("/v1/admin/check").json()


def _campaign(b: Hostile, rng: random.Random, a_lease_id: int, a_prompts: list[list[int]]) -> None:
    """B's hostile calls (about 2000), each answer asserted."""
    # reads of A's prompts: nothing of A, for B
    for toks in a_prompts:
        assert b.post("/v1/lookup", {"tokens": encode_tokens(toks)})[1]["num_tokens"] == 0
        assert b.post("/v1/load", {"tokens": encode_tokens(toks)})[1]["num_tokens"] == 0
    # blind reservations: reserve, commit without writing (409: canaries), load, abort
    for i in range(150):
        status, reservation = b.post("/v1/reserve", {"tokens": tokens(50_000 + 10 * i, 2)})
        assert status == 200, reservation
        rid = reservation["reservation_id"]
        assert b.post("/v1/commit", {"reservation_id": rid})[0] == 409  # not_written
        status, loaded = b.post("/v1/load", {"tokens": tokens(50_000 + 10 * i, 2)})
        assert (status, loaded["num_tokens"]) == (200, 0)
        assert b.post("/v1/abort", {"reservation_id": rid})[0] == 200
    # a reservation flood up to B's quotas, then 429, then all given back: 16 gpu slots (with
    # their write_through host copies), then 16 host slots, B's 32 on host
    held = []
    tiers = []
    for i in range(30):
        status, reservation = b.post("/v1/reserve", {"tokens": tokens(52_000 + 10 * i, 2)})
        if status == 200:
            held.append(reservation["reservation_id"])
            tiers.append(reservation["tier"])
        else:
            assert (status, reservation["error"]) == (429, "quota"), reservation
    assert tiers == ["gpu"] * 8 + ["host"] * 8
    for rid in held:
        assert b.post("/v1/abort", {"reservation_id": rid})[0] == 200
    # huge ttl_s, on prefetch and reserve
    for ttl in (1e9, 1e300, 601.0):
        for path in ("/v1/prefetch", "/v1/reserve"):
            status, body = b.post(path, {"tokens": tokens(60_000, 1), "ttl_s": ttl})
            assert (status, body["error"]) == (400, "invalid_argument")
            assert "max_ttl_s" in body["detail"]
    # stores that would evict A: 120 prompts of 2 blocks, far more than the tiers hold
    for i in range(120):
        kv = kv_of(2 * BT, seed=10_000 + i)
        status, stored = b.post(
            "/v1/store", {"tokens": tokens(70_000 + 10 * i, 2), **wire.kv_to_wire(kv)}
        )
        assert status == 200 and stored["stored_tokens"] == 2 * BT, stored
    # lease floods: distinct prefixes up to the gpu quota, then one prefix up to the lease quota
    leased: list[int] = []
    leased_tokens = quota_refusals = 0
    for i in range(40):  # the newest first; older ones were evicted (empty leases)
        status, body = b.post("/v1/prefetch", {"tokens": tokens(70_000 + 10 * (119 - i), 2)})
        if status == 200:
            leased.append(body["lease_id"])
            leased_tokens += body["num_tokens"]
        else:
            assert body["error"] == "quota", body
            quota_refusals += 1
    assert leased_tokens == 16 * BT and quota_refusals > 0  # B's gpu quota: 16 blocks
    for _ in range(B_LEASES + 20):
        status, body = b.post("/v1/prefetch", {"tokens": tokens(70_000 + 10 * 119, 2)})
        if status == 200:
            leased.append(body["lease_id"])
        else:
            assert body["error"] == "quota", body
    assert len(leased) == B_LEASES
    # id guessing: A's lease, neighbours of B's own ids, random ids; all unknown to B
    guesses = [
        a_lease_id,
        a_lease_id + 1,
        a_lease_id - 1,
        *(rng.getrandbits(63) for _ in range(200)),
    ]
    guesses += [lease_id + d for lease_id in leased[:20] for d in (-2, -1, 1, 2)]
    for guess in guesses:
        if guess in leased:
            continue
        assert b.post("/v1/release", {"lease_id": guess})[0] == 404
        assert b.get(f"/v1/leases/{guess}")[0] == 404
        assert b.post("/v1/commit", {"reservation_id": guess})[0] == 404
        assert b.post("/v1/abort", {"reservation_id": guess})[0] == 404
    # figures: B's own status; /metrics and /v1/config are the admin's
    for _ in range(20):
        status, mine = b.get("/v1/status")
        assert status == 200 and mine["tenant"] == "b"
        assert mine["leases"] == {"live": B_LEASES, "quota": B_LEASES}
        assert mine["tiers"]["gpu"]["held_blocks"] <= mine["tiers"]["gpu"]["quota_blocks"]
    assert b.get("/metrics")[0] == 403
    assert b.get("/v1/config")[0] == 403
    for lease_id in leased:
        assert b.post("/v1/release", {"lease_id": lease_id})[0] == 200
