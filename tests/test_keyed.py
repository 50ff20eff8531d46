"""`kvtier.keyed`: an engine's chain of page keys stored and found through the token API, in
pages of synthetic tokens that never meet a prompt's, scoped (tensor-parallel rank), refused
for pages too short to carry a key."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from conftest import kv_for, same
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError
from kvtier.keyed import KeyedPages
from kvtier.store import KVStore


def chain(count: int, seed: int = 0) -> list[str]:
    """SGLang-like keys: hex SHA-256, each over the previous digest and a page id."""
    keys, prior = [], b""
    for page in range(count):
        prior = hashlib.sha256(prior + f"{seed}/{page}".encode()).digest()
        keys.append(prior.hex())
    return keys


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=2, max_size=20, unique=True))
def test_different_keys_give_different_pages_of_high_tokens(keys: list[bytes]) -> None:
    pages = KeyedPages(8)
    made = [tuple(pages.page(key)) for key in keys]
    assert len(set(made)) == len(keys)
    assert all(2**31 <= token < 2**32 for page in made for token in page)
    assert made[0] == tuple(pages.page(keys[0]))  # a function of the key alone


def test_pages_fill_to_page_tokens_and_scopes_keep_apart() -> None:
    keys = chain(3)
    sixteen = KeyedPages(16)
    assert len(sixteen.tokens(keys)) == 48 and sixteen.pages(47) == 2
    assert sixteen.page(keys[0])[:8] == KeyedPages(8).page(keys[0])
    assert KeyedPages(16, "tp0/2").page(keys[0]) != KeyedPages(16, "tp1/2").page(keys[0])
    assert sixteen.page(keys[0]) == sixteen.page(bytes.fromhex(keys[0]))  # hex or bytes
    for bad in (7, 0, True, 8.0):
        with pytest.raises(InvalidArgumentError, match="page_tokens"):
            KeyedPages(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="scope"):
        KeyedPages(8, b"tp0/2")  # type: ignore[arg-type]


def test_a_chain_of_keys_is_stored_and_found_by_its_leading_pages(
    make_store: Callable[..., KVStore],
) -> None:
    store = make_store(gpu_blocks=32, host_blocks=32)
    pages = KeyedPages(8)  # 2 blocks of 4 per page
    keys = chain(4)
    tokens = pages.tokens(keys)
    kv = kv_for(store, len(tokens), seed=3)
    assert store.store(tokens, kv).stored_tokens == 32
    assert pages.pages(store.lookup(tokens).num_tokens) == 4
    assert pages.pages(store.lookup(pages.tokens(keys[:2] + chain(2, seed=1))).num_tokens) == 2
    assert store.lookup(pages.tokens(keys[1:])).num_tokens == 0  # a page only under its prefix
    assert same(store.load(pages.tokens(keys[:3])).kv, kv[:, :, :24])
    store.check()
