"""Huge integers in a caller's arguments get the typed error a small bad value gets, with a
short message (the fourth audit): each test fails on the code before its fix.

- The embedded `KVStore`'s `lookup` (a token), `prefetch(ttl_s=)`, `release`, `evict`
  (`num_blocks`), `load(start=)`, `store(start=)`, `commit` and `abort` given 10**5000 (or its
  negative) raise the kvtier error a small bad value raises, not Python's bare `ValueError`
  about converting an int of more than 4300 digits to text; given a 4000-digit int, the same
  error with a message of under 300 characters (before: the whole number, 4 KB). Nothing
  stored changes: `check()` passes and a stored prompt loads bit-exact.
- `shown`, the one place messages format a caller's value, bounds ints, strings and containers.
- Through a real `kvtier serve`, a lookup with a 4000-digit token is a 400 `invalid_tokens` of
  under 1 KB (before: the number echoed whole).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from service_server import running, write_config

from kvtier import errors
from kvtier.config import parse_config
from kvtier.errors import KVTierError
from kvtier.store import KVStore

HUGE = 10**5000
DIGITS_4000 = 10**3999 + 7
BT = 4
TOKENS = list(range(100, 100 + 2 * BT))

CALLS: dict[str, Callable[[KVStore, int], Any]] = {
    "lookup": lambda s, v: s.lookup([1, 2, 3, v]),
    "prefetch": lambda s, v: s.prefetch([1, 2, 3, 4], ttl_s=v),
    "release": lambda s, v: s.release(v),
    "evict": lambda s, v: s.evict("host", -abs(v)),
    "load": lambda s, v: s.load([1, 2, 3, 4], start=v),
    "store": lambda s, v: s.store([1, 2, 3, 4], torch.zeros(1, 2, 4, 1, 8).half(), start=v),
    "commit": lambda s, v: s.commit(v),
    "abort": lambda s, v: s.abort(v),
}
SMALL_BAD = {"lookup": -1, "prefetch": -1, "release": 12345, "evict": 1, "load": 3,
             "store": 3, "commit": 12345, "abort": 12345}  # fmt: skip


@pytest.fixture
def store() -> Any:
    config = parse_config(
        {
            "model": {
                "name": "t",
                "num_layers": 1,
                "num_kv_heads": 1,
                "head_dim": 8,
                "dtype": "float16",
            },
            "block_tokens": BT,
            "tiers": {
                "gpu": {"capacity": "64KiB", "device": "cpu"},
                "host": {"capacity": "128KiB"},
            },
        }
    )
    with KVStore(config) as kv_store:
        yield kv_store


def _error(call: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("value", [HUGE, -HUGE, DIGITS_4000], ids=["1e5000", "-1e5000", "4000"])
@pytest.mark.parametrize("name", list(CALLS))
def test_a_huge_int_gets_the_typed_error_of_a_small_bad_value(
    store: KVStore, name: str, value: int
) -> None:
    kv = torch.randn(1, 2, len(TOKENS), 1, 8).half()
    store.store(TOKENS, kv)
    small = _error(lambda: CALLS[name](store, SMALL_BAD[name]))
    assert isinstance(small, KVTierError), repr(small)
    error = _error(lambda: CALLS[name](store, value))
    assert type(error) is type(small), repr(error)[:200]
    assert len(str(error)) < 300, str(error)[:400]
    store.check()
    loaded = store.load(TOKENS)
    assert loaded.num_tokens == len(TOKENS)
    assert torch.equal(loaded.kv, kv)


def test_shown_bounds_what_it_shows() -> None:
    shown = errors.shown
    assert shown(HUGE) == "an integer of 16610 bits"
    assert shown(-HUGE) == "a negative integer of 16610 bits"
    assert shown(12345) == "12345" and shown("tier") == "'tier'"
    assert "16610 bits" in shown([1, HUGE]) and "16610 bits" in shown({"a": HUGE})
    for value in ("x" * 10_000, list(range(10_000)), DIGITS_4000, {i: "y" * 99 for i in range(99)}):
        assert len(shown(value)) < 120


def test_the_sidecar_answers_a_4000_digit_token_in_a_short_400(tmp_path: Path) -> None:
    with running(write_config(tmp_path)) as server:
        response = server.post("/v1/lookup", json={"tokens": [1, 2, 3, DIGITS_4000]})
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"] == "invalid_tokens", response.text[:300]
        assert len(response.content) < 1024, len(response.content)
