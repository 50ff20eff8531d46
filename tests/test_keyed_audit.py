"""Audit of the keyed path behind the SGLang HiCache backend, without SGLang: engine keys as
pages (`kvtier.keyed`), and the client that carries them to a sidecar (`kvtier.client`).

- Different keys are different pages: a key that is not canonical hex (SGLang's are lowercase
  hex SHA-256) is its own page, never the page of the hex key it happens to decode like
  (whitespace, capitals) or of the bytes it encodes to; any str is a key (lone surrogates too).
- A client that mapped its sidecar's pools and outlives a restart of the sidecar (same URL, new
  pools) never serves a byte of the old pools: a load is bit-exact or a miss, never the old
  server's slot (another tenant's page, or nothing's), and a store still lands.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from service_server import kv_of, restartable, start

from kvtier.client import Client
from kvtier.errors import KVTierError
from kvtier.keyed import KeyedPages

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdefgh"


def test_keys_that_decode_alike_are_still_different_pages() -> None:
    pages = KeyedPages(8)
    hexkey = "6162"  # bytes.fromhex: b"ab"
    distinct = [hexkey, "61 62", "6162\n", " 6162", "ab", "AB", "Ab", "", "x"]
    made = [tuple(pages.page(key)) for key in distinct]
    assert len(set(made)) == len(distinct), "two different str keys gave one page"
    assert pages.page(hexkey) == pages.page(b"ab")  # canonical hex is its bytes (documented)
    assert pages.page("ab") == pages.page(b"\xab")  # "ab" is canonical hex of b"\xab"
    assert pages.page("xy") != pages.page(b"xy")  # text is not the bytes it encodes to
    assert pages.page("xy") != pages.page("7879")  # nor the hex of those bytes


def test_any_str_is_a_key_non_ascii_and_lone_surrogates_included() -> None:
    pages = KeyedPages(8)
    keys = ["\u00e9", "e\u0301", "\ud800", "\udc00", "\U0001f600", "\ud83d\ude00", "k" * 100_000]
    made = [tuple(pages.page(key)) for key in keys]
    assert len(set(made)) == len(keys)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_a_client_that_outlives_a_sidecar_restart_never_serves_the_old_pools(
    tmp_path: Path,
) -> None:
    pages = KeyedPages(8, "tp0/1")
    keys = [f"{i:064x}" for i in range(1, 5)]  # 4 pages of 8 tokens: 8 blocks of 4
    tokens = pages.tokens(keys)
    with restartable(tmp_path, {"alice": {"api_keys": [ALICE]}, "bob": {"api_keys": [BOB]}}) as (
        config,
        port,
        started,
    ):
        started.append(start(config, port=port))
        alice = Client(started[-1].url, api_key=ALICE)
        assert alice.pool_buffer("gpu") is not None  # mapped: loads read the pool in place
        with Client(started[-1].url, api_key=BOB) as bob:  # bob's pages in the old pools
            bob.store(tokens, kv_of(32, seed=66))
            assert torch.equal(bob.load(tokens).kv, kv_of(32, seed=66))
        started[-1].stop()
        started.append(start(config, port=port))  # same URL, new pools
        with Client(started[-1].url, api_key=ALICE) as fresh:
            fresh.store(tokens, kv_of(32, seed=1))  # alice's pages, in the new pools
        try:  # the client that mapped the old pools: refused once (nothing read), or exact
            got = alice.load(tokens)
        except KVTierError:
            got = alice.load(tokens)  # then through the body
        bobs = torch.equal(got.kv, kv_of(32, seed=66))
        assert got.num_tokens == 32
        assert torch.equal(got.kv, kv_of(32, seed=1)), f"old pools served (bob's: {bobs})"
        other = pages.tokens([f"{i:064x}" for i in range(10, 12)])
        stored = alice.store(other, kv_of(16, seed=2))  # a store after the restart lands
        assert stored.cached_tokens == 16
        got = alice.load(other)
        assert got.num_tokens == 16 and torch.equal(got.kv, kv_of(16, seed=2))
        alice.close()
