"""A shared-memory load never returns another prompt's KV because its lease expired during the
copy (`kvtier/client/held.py`), against a real `kvtier serve` whose `policy.lease_ttl_s` is 1 s.

The copy out of the mapped gpu pool is paused at its start (the real copy then runs): past the
ttl, while another client's stores take the leased slots, both `Client.load` and
`AsyncClient.load` (into the caller's `out` too) must return the prompt's own KV (through the
body), where they returned the new owner's; a prefix that grew meanwhile comes whole. A copy
past half the ttl but within it is kept once its release, sent at once, is answered; one well
within it sends nothing more than before (its release owed). The prefetch reply says the
lease's `ttl_s`, and a malformed one is a `ReplyError`."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
import yaml
from service_server import Server, kv_of, running, tokens_of, write_config

from kvtier.blocks import encode_tokens
from kvtier.client import AsyncClient, Client
from kvtier.client import pools as pools_module
from kvtier.client import releases as owed_module
from kvtier.errors import ReplyError
from kvtier.kernels import block_copy

TTL_S = 1.0
NUM_TOKENS = 32  # 8 blocks: half the gpu tier


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("lease-expiry"), gpu_blocks=16, host_blocks=256, write="write_back"
    )
    data = yaml.safe_load(config.read_text())
    data["policy"]["lease_ttl_s"] = TTL_S
    config.write_text(yaml.safe_dump(data))
    with running(config) as live:
        yield live


def releases_sent(server: Server) -> int:
    """`/v1/release` requests the server has answered (its request histogram)."""
    text = httpx.get(server.url + "/metrics").text
    found = re.search(r'^kvtier_request_seconds_count\{route="/v1/release"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def same(got: torch.Tensor, kv: torch.Tensor) -> bool:
    """Bit for bit (fp16 compared as int16: a NaN equals itself)."""
    return torch.equal(got.view(torch.int16), kv.view(torch.int16))


def pause_copy(monkeypatch: pytest.MonkeyPatch, during: Callable[[Any, Any], None]) -> list[int]:
    """Run `during(pool, slots)` once, just before the next copy out of a mapped pool (the real
    copy then runs); the list counts the copies paused."""
    real = block_copy.copy_blocks_slices  # what `pools` calls
    paused: list[int] = []

    def paused_copy(src: Any, dst: Any, src_slots: Any, dst_slots: Any) -> None:
        if not paused:
            paused.append(1)
            during(src, list(src_slots))
        real(src, dst, src_slots, dst_slots)

    monkeypatch.setattr(pools_module, "copy_blocks_slices", paused_copy)
    return paused


def take_the_slots(
    writer: Client, prompt: list[int], *first: tuple[list[int], torch.Tensor]
) -> Callable[[Any, Any], None]:
    """Past the lease's ttl, store `first` (tokens, kv), then other prompts until the leased
    slots hold other bytes (the gpu tier has room for two prompts)."""

    def take(pool: torch.Tensor, slots: list[int]) -> None:
        leased = pool[slots].clone()
        time.sleep(TTL_S * 1.2)
        for tokens, kv in first:
            writer.store(tokens, kv)
        for k in range(1, 13):
            writer.store(tokens_of(prompt[0] + 100 * k, NUM_TOKENS), kv_of(NUM_TOKENS, k))
            if not same(pool[slots], leased):
                return
        raise AssertionError("the leased slots were not taken: the test proves nothing")

    return take


def test_a_load_whose_lease_expired_in_its_copy_returns_the_prompts_kv(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt, kv = tokens_of(10_000, NUM_TOKENS), kv_of(NUM_TOKENS, 1)
    with Client(server.url) as reader, Client(server.url, shared_memory=False) as writer:
        writer.store(prompt, kv)
        paused = pause_copy(monkeypatch, take_the_slots(writer, prompt))
        loaded = reader.load(prompt)
    assert paused == [1]  # the mapped path was taken, and its copy read the slots retaken
    assert loaded.num_tokens == NUM_TOKENS
    assert same(loaded.kv, kv), "another prompt's KV"


def test_an_async_load_whose_lease_expired_in_its_copy_returns_the_prompts_kv(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt, kv = tokens_of(20_000, NUM_TOKENS), kv_of(NUM_TOKENS, 2)

    out = torch.full_like(kv, 7.0)  # the caller's buffer: the prompt's KV lands there

    async def run() -> torch.Tensor:
        async with AsyncClient(server.url) as reader:
            loaded = await reader.load(prompt, out=out)
        assert loaded.num_tokens == NUM_TOKENS and loaded.kv.data_ptr() == out.data_ptr()
        return loaded.kv

    with Client(server.url, shared_memory=False) as writer:
        writer.store(prompt, kv)
        paused = pause_copy(monkeypatch, take_the_slots(writer, prompt))
        got = asyncio.run(run())
    assert paused == [1]
    assert same(got, kv) and same(out, kv), "another prompt's KV"


def test_a_prefix_grown_while_its_copy_was_thrown_away_is_loaded_whole(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    longer, kv = tokens_of(50_000, NUM_TOKENS + 16), kv_of(NUM_TOKENS + 16, 5)
    with Client(server.url) as reader, Client(server.url, shared_memory=False) as writer:
        writer.store(longer[:NUM_TOKENS], kv[:, :, :NUM_TOKENS])  # leased: 8 blocks of 12
        paused = pause_copy(monkeypatch, take_the_slots(writer, longer, (longer, kv)))
        loaded = reader.load(longer)  # the body has all 12 by then
    assert paused == [1]
    assert loaded.num_tokens == NUM_TOKENS + 16
    assert same(loaded.kv, kv), "another prompt's KV"


def test_a_copy_past_half_the_ttl_is_kept_once_its_release_is_answered(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owed_module, "RELEASE_AFTER_S", 3600.0)  # no flush within the test
    prompt, kv = tokens_of(30_000, NUM_TOKENS), kv_of(NUM_TOKENS, 3)
    with Client(server.url) as reader, Client(server.url, shared_memory=False) as writer:
        writer.store(prompt, kv)
        pause_copy(monkeypatch, lambda *_: time.sleep(TTL_S * 0.6))  # past half the ttl
        before = releases_sent(server)
        loaded = reader.load(prompt)
        assert releases_sent(server) == before + 1  # sent at once, answered: the copy kept
        assert reader._owed.take("default") == []  # nothing left owed for it
    assert same(loaded.kv, kv), "another prompt's KV"


def test_a_prefetch_says_its_ttl_and_a_quick_load_owes_its_release(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owed_module, "RELEASE_AFTER_S", 3600.0)  # no flush within the test
    prompt, kv = tokens_of(40_000, NUM_TOKENS), kv_of(NUM_TOKENS, 4)
    with Client(server.url) as reader:
        reader.store(prompt, kv)
        reply = reader._post("/v1/prefetch", {"tokens": encode_tokens(prompt)}, "default")
        assert reply["ttl_s"] == TTL_S  # over the lane; and over HTTP:
        over_http = httpx.post(server.url + "/v1/prefetch", json={"tokens": prompt}).json()
        assert over_http["ttl_s"] == TTL_S
        for lease_id in (reply["lease_id"], over_http["lease_id"]):
            reader.release(lease_id)
        before = releases_sent(server)
        loaded = reader.load(prompt)
        assert releases_sent(server) == before  # within the ttl by time: no request more
        assert len(reader._owed.take("default")) == 1  # owed, to ride on a later request
    assert same(loaded.kv, kv), "another prompt's KV"


@pytest.mark.parametrize("ttl", ["1", True, 0, -1.0, math.nan, math.inf, [1]])
def test_a_malformed_ttl_in_a_lease_reply_is_a_reply_error(ttl: object) -> None:
    from kvtier.client.held import held_until  # new with the check: each test fails alone

    with pytest.raises(ReplyError, match=r"lease\.ttl_s: got .*expected a number of seconds"):
        held_until(0.0, {"ttl_s": ttl})


def test_a_lease_reply_without_ttl_is_held_by_nothing_but_its_release() -> None:
    from kvtier.client.held import HELD_SHARE, held_until

    assert held_until(5.0, {}) is None
    assert held_until(5.0, {"ttl_s": 2}) == 5.0 + 2 * HELD_SHARE
