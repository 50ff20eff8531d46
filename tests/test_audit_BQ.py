"""Audit BQ: the sidecar's tenancy and its requests' budget (`service/budget.py`).

A load holds its body and then its reply in the call's hold; one call may hold at most
`Budget.largest()`: `min(max_inflight_bytes, share)`, and a tenant's share is
`max(max_inflight_bytes // tenants, max_body_bytes)`. Where the share is `max_body_bytes`
(four tenants and more on the defaults, or `max_inflight_bytes` set to `max_body_bytes`), a
load whose reply is `max_body_bytes` (any load of a prefix that long) could never be granted
beside its body: it waited out `body_timeout_s` on an idle server and was refused 503 `busy`,
which a client takes for a busy server and tries again, forever. Measured on `kvtier serve`
(four tenants, 128 KiB bodies, 512 KiB in flight, body_timeout_s 3): a load of 32 blocks took
3.06 s and answered 503 busy "this tenant holds 339 of its share of 131072 bytes" with
nothing else in flight, and `Client.load` of a 40-block prefix raised `ServiceError` 503.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import msgpack  # type: ignore[import-untyped]
import pytest
import torch
from service_server import ADMIN_KEY, BLOCK_BYTES, BT, DIM, HEADS, LAYERS, running, write_config

from kvtier.client import Client
from kvtier.service.budget import Budget
from kvtier.service.wire import WireError

KEYS = {name: f"audit-bq-tenant-{name}-0123456789" for name in "abcd"}
BODY = 32 * BLOCK_BYTES  # 128 KiB: a reply of 32 blocks is max_body_bytes whole


def test_a_take_past_what_one_call_may_hold_is_refused_at_once() -> None:
    """A call that holds its body and asks for a reply of all a call may hold: 413 now,
    holding what it held, not a wait to its deadline and a 503 busy."""

    async def scenario() -> None:
        budget = Budget(total=4000, share=1000)
        hold = budget.hold("a", own=True)
        await hold.take(10, time.monotonic() + 1)  # the load's body
        assert hold.room() == 990
        started = time.monotonic()
        with pytest.raises(WireError) as refused:
            await hold.take(1000, time.monotonic() + 2)
        assert time.monotonic() - started < 0.5, "waited for room that could never come"
        assert (refused.value.status, refused.value.kind) == (413, "body_too_large")
        assert "beside the 10 it holds" in refused.value.detail
        assert budget.held == 10 and budget.waits == 0 and budget.refused == 0
        budget.check()
        await hold.take(hold.room(), time.monotonic() + 1)  # what is left fits, at once
        assert budget.held == 1000 and hold.room() == 0
        budget.check()
        hold.release()
        assert budget.held == 0 and budget.by_tenant == {}
        budget.check()

    asyncio.run(scenario())


def test_a_load_of_max_body_bytes_with_four_tenants_is_not_a_busy_wait(tmp_path: Path) -> None:
    """Four tenants, `max_inflight_bytes` 4 x `max_body_bytes`: each tenant's share is one
    reply of `max_body_bytes`. A load of a prefix that long on an idle server is answered at
    once, 200 `truncated` (the reply sized to what the call may still hold beside its body),
    never 503 busy after `body_timeout_s`; the client asks on and loads it all; nothing stays
    held and the store checks."""
    service = {"max_body_bytes": BODY, "max_inflight_bytes": 4 * BODY, "body_timeout_s": 3.0}
    tenants = {name: {"api_keys": [key]} for name, key in KEYS.items()}
    config = write_config(tmp_path, gpu_blocks=64, host_blocks=128, service=service,
                          tenants=tenants)  # fmt: skip
    tokens = list(range(500, 500 + 40 * BT))
    kv = torch.randn(LAYERS, 2, len(tokens), HEADS, DIM, generator=torch.Generator().manual_seed(7))
    with running(config) as server:
        with Client(server.url, api_key=KEYS["a"]) as client:
            assert client.store(tokens, kv.half()).stored_tokens == len(tokens)
        body = msgpack.packb({"tokens": tokens[: 32 * BT]}, use_bin_type=True)
        headers = {"authorization": f"Bearer {KEYS['a']}", "content-type": "application/msgpack"}
        started = time.monotonic()
        reply = server.post("/v1/load", content=body, headers=headers)
        took = time.monotonic() - started
        answer = msgpack.unpackb(reply.content)
        assert reply.status_code != 503, answer
        assert took < 2.0, f"{took:.2f} s: the load waited for room it could never have"
        assert reply.status_code == 200, answer  # the reply sized to the call's room
        assert answer["truncated"] is True and 0 < answer["num_tokens"] < 32 * BT
        with Client(server.url, api_key=KEYS["a"]) as client:  # asks on from `num_tokens`
            loaded = client.load(tokens)
        assert loaded.num_tokens == len(tokens) and torch.equal(loaded.kv, kv.half())
        # four at once, bodies of 6.5 KB: each reply sized to what is free now (review R2:
        # each took its room beside its body, and they waited on each other into 503 busy)
        padded = msgpack.packb({"tokens": tokens + list(range(70_000, 71_200))})
        answers: list[tuple[int, float]] = []

        def load() -> None:
            began = time.monotonic()
            status = server.post("/v1/load", content=padded, headers=headers).status_code
            answers.append((status, time.monotonic() - began))

        threads = [threading.Thread(target=load) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [status for status, _ in answers] == [200] * 4, answers
        assert max(took for _, took in answers) < 2.5, answers  # body_timeout_s is 3
        status = server.get("/v1/status", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        inflight = status.json()["inflight"]
        assert inflight["held_bytes"] == 0 and inflight["busy"] == 0, inflight
        assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}
