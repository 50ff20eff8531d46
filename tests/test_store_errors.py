"""KVStore bad input: every public method refuses bad arguments with the right `kvtier.errors`
type and a message naming the problem, and the store is exactly as it was afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_store, kv_for

from kvtier.errors import (
    InvalidArgumentError,
    InvalidKVError,
    InvalidTokensError,
    KVTierError,
    LeaseError,
    UnknownTenantError,
)
from kvtier.results import Lease
from kvtier.store import KVStore

GOOD = list(range(8))  # 2 blocks, cached on gpu
DEMOTED = list(range(100, 108))  # 2 blocks, cached on host only
UNCACHED = list(range(200, 208))


@pytest.fixture
def store() -> Iterator[KVStore]:
    """gpu 4 blocks, host 8: GOOD on gpu (and host) under a live lease, DEMOTED on host."""
    store = build_store(gpu_blocks=4, host_blocks=8)
    store.store(DEMOTED, kv_for(store, 8, seed=1))
    store.evict("gpu", 2)
    store.store(GOOD, kv_for(store, 8, seed=2))
    store.prefetch(GOOD)
    store.check()
    yield store
    store.close()


def snapshot(store: KVStore) -> dict[str, Any]:
    """What a refused call must leave as it was: cached prefixes by tier, KV, bytes, leases."""
    status = store.status()
    return {
        "lookups": [store.lookup(t) for t in (GOOD, DEMOTED, UNCACHED)],
        "kv": [store.load(t, device="cpu").kv.clone() for t in (GOOD, DEMOTED)],
        "tiers": {
            name: (figures["used_bytes"], figures["blocks"], figures["leased_blocks"])
            for name, figures in status["tiers"].items()
        },
        "index_blocks": status["index"]["blocks"],
        "leases": store.leases(),
    }


def assert_refused(
    store: KVStore, call: Callable[[KVStore], object], error: type[KVTierError], message: str
) -> None:
    before = snapshot(store)
    with pytest.raises(error, match=message):
        call(store)
    store.check()
    after = snapshot(store)
    kv_before, kv_after = before.pop("kv"), after.pop("kv")
    assert after == before
    assert all(torch.equal(a, b) for a, b in zip(kv_after, kv_before, strict=True))


# ---- tokens, for every method that takes them ----------------------------------------------

BAD_TOKENS: list[tuple[str, object, str]] = [
    ("2-D tensor", torch.arange(8).reshape(2, 4), r"shape \(2, 4\), expected a 1-D tensor"),
    ("2-D array", np.arange(8).reshape(2, 4), r"shape \(2, 4\), expected 1-D"),
    ("nested list", [[0, 1, 2, 3], [4, 5, 6, 7]], r"tokens\[0\]: got \[0, 1, 2, 3\] \(list\)"),
    ("float tensor", torch.arange(8, dtype=torch.float32), "torch.float32, expected integers"),
    ("float array", np.arange(8, dtype=np.float64), "float64, expected integers"),
    ("float list", [0, 1, 2.0, 3], r"tokens\[2\]: got 2.0 \(float\), expected an int"),
    ("negative list", [0, 1, -5, 3], r"tokens\[2\]: got -5, expected a token id in \[0, 2\*\*32\)"),
    ("negative tensor", torch.tensor([0, -1, 2, 3]), r"tokens\[1\]: got -1"),
    ("too large", [0, 2**32, 2, 3], r"tokens\[1\]: got 4294967296"),
    ("empty list", [], "empty sequence, expected at least one token"),
    ("empty tensor", torch.tensor([], dtype=torch.long), "empty array"),
    ("str", "0 1 2 3", "got str, expected a list, tuple, ndarray or tensor of ints"),
    ("None", None, "got NoneType"),
    ("int", 7, "got int"),
]

TOKEN_METHODS: dict[str, Callable[[KVStore, Any], object]] = {
    "lookup": lambda s, tokens: s.lookup(tokens),
    "store": lambda s, tokens: s.store(tokens, kv_for(s, 8)),
    "load": lambda s, tokens: s.load(tokens),
    "prefetch": lambda s, tokens: s.prefetch(tokens),
}


@pytest.mark.parametrize("method", sorted(TOKEN_METHODS))
@pytest.mark.parametrize(
    ("tokens", "message"), [(t, m) for _, t, m in BAD_TOKENS], ids=[i for i, _, _ in BAD_TOKENS]
)
def test_bad_tokens_are_refused(store: KVStore, method: str, tokens: object, message: str) -> None:
    def call(s: KVStore) -> object:
        return TOKEN_METHODS[method](s, tokens)

    assert_refused(store, call, InvalidTokensError, message)


# ---- kv --------------------------------------------------------------------------------------

BAD_KV: list[tuple[str, Callable[[KVStore, int], object], str]] = [
    # (id, kv for n tokens, message with {n})
    ("list", lambda s, n: kv_for(s, n).tolist(), "kv: got list, expected a torch.Tensor"),
    ("ndarray", lambda s, n: kv_for(s, n).numpy(), "kv: got ndarray, expected a torch.Tensor"),
    ("None", lambda s, n: None, "kv: got NoneType, expected a torch.Tensor"),
    ("float64", lambda s, n: kv_for(s, n).double(), "dtype torch.float64, expected torch.float32"),
    ("bfloat16", lambda s, n: kv_for(s, n).bfloat16(), "dtype torch.bfloat16, expected"),
    (
        "no K/V axis",
        lambda s, n: kv_for(s, n)[:, 0],
        r"shape \(2, {n}, 2, 4\), expected \(2, 2, {n},",
    ),
    ("one head", lambda s, n: kv_for(s, n)[..., :1, :], r"shape \(2, 2, {n}, 1, 4\), expected"),
    (
        "block-major",
        lambda s, n: torch.zeros(n // 4, 2, 2, 4, 2, 4),
        r"shape \({b}, 2, 2, 4, 2, 4\), expected \(2, 2, {n}, 2, 4\) = \[num_layers, 2, len",
    ),
    (
        "too few tokens",
        lambda s, n: kv_for(s, n - 4),
        r"shape \(2, 2, {m}, 2, 4\), expected \(2, 2, {n},",
    ),
    ("too many tokens", lambda s, n: kv_for(s, n + 1), r"shape \(2, 2, {p}, 2, 4\), expected"),
]


@pytest.mark.parametrize("tokens", [UNCACHED, GOOD + UNCACHED], ids=["new", "extending"])
@pytest.mark.parametrize(
    ("make_kv", "message"), [(k, m) for _, k, m in BAD_KV], ids=[i for i, _, _ in BAD_KV]
)
def test_bad_kv_is_refused_by_store(
    store: KVStore, tokens: list[int], make_kv: Callable[[KVStore, int], object], message: str
) -> None:
    n = len(tokens)
    kv = make_kv(store, n)
    expected = message.format(n=n, b=n // 4, m=n - 4, p=n + 1)

    def call(s: KVStore) -> object:
        return s.store(tokens, kv)  # type: ignore[arg-type]

    assert_refused(store, call, InvalidKVError, expected)


# ---- tenants ---------------------------------------------------------------------------------

TENANT_CALLS: dict[str, Callable[[KVStore], object]] = {
    "lookup": lambda s: s.lookup(GOOD, tenant="mallory"),
    "store": lambda s: s.store(UNCACHED, kv_for(s, 8), tenant="mallory"),
    "load": lambda s: s.load(GOOD, tenant="mallory"),
    "prefetch": lambda s: s.prefetch(DEMOTED, tenant="mallory"),
}


@pytest.mark.parametrize("method", sorted(TENANT_CALLS))
def test_an_unknown_tenant_is_refused(store: KVStore, method: str) -> None:
    message = r"tenant 'mallory': unknown, expected one of \['default'\]"
    assert_refused(store, TENANT_CALLS[method], UnknownTenantError, message)


def test_unknown_tenant_error_is_a_key_error_with_a_plain_message(store: KVStore) -> None:
    with pytest.raises(KeyError) as info:
        store.lookup(GOOD, tenant="")
    assert str(info.value) == "tenant '': unknown, expected one of ['default']"


def test_an_unknown_tenant_of_a_megabyte_is_named_by_its_head_and_length(store: KVStore) -> None:
    # a name can be as long as a lane frame (about 1 MiB): the refusal must not echo it whole
    with pytest.raises(UnknownTenantError) as info:
        store.lookup(GOOD, tenant="m" * (1 << 20))
    assert str(info.value) == (
        f"tenant {'m' * 64!r} (of {1 << 20} characters): unknown, expected one of ['default']"
    )


# ---- other arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ttl_s", [0, -1, 0.0, float("inf"), float("nan"), "5", True, [5]], ids=repr
)
def test_prefetch_refuses_a_bad_ttl_and_promotes_nothing(store: KVStore, ttl_s: object) -> None:
    def call(s: KVStore) -> object:
        return s.prefetch(DEMOTED, ttl_s=ttl_s)  # type: ignore[arg-type]

    message = r"ttl_s: got .*, expected a number of seconds in \(0, 600.0\]"
    assert_refused(store, call, InvalidArgumentError, message)


@pytest.mark.parametrize("device", ["bogus", "tpu", "meta", "cuda:7", 3.5], ids=repr)
def test_load_refuses_a_bad_device(store: KVStore, device: object) -> None:
    def call(s: KVStore) -> object:
        return s.load(GOOD, device=device)  # type: ignore[arg-type]

    assert_refused(store, call, InvalidArgumentError, rf"device: got {device!r}")


@pytest.mark.parametrize("lease_id", [999, 0, -1], ids=repr)
def test_release_refuses_an_unknown_lease(store: KVStore, lease_id: object) -> None:
    def call(s: KVStore) -> object:
        s.release(lease_id)  # type: ignore[arg-type]
        return None

    assert_refused(store, call, LeaseError, rf"lease {lease_id}: unknown, released or expired")


def test_release_refuses_a_released_lease(store: KVStore) -> None:
    lease = store.prefetch(DEMOTED)
    store.release(lease)
    store.check()
    assert_refused(store, lambda s: s.release(lease), LeaseError, rf"lease {lease.lease_id}: ")
    forged = Lease(12345, "default", 8, (0, 1), 0.0)
    assert_refused(store, lambda s: s.release(forged), LeaseError, "lease 12345: unknown")


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ("disk", "tier: got 'disk', expected one of \\('gpu', 'host'\\)"),
        ("GPU", "tier: got 'GPU'"),
        ("", "tier: got ''"),
        (0, "tier: got 0"),
        (None, "tier: got None"),
    ],
    ids=repr,
)
def test_evict_refuses_a_bad_tier(store: KVStore, tier: object, message: str) -> None:
    def call(s: KVStore) -> object:
        return s.evict(tier, 1)  # type: ignore[arg-type]

    assert_refused(store, call, InvalidArgumentError, message)


@pytest.mark.parametrize("num_blocks", [-1, -100, 1.0, 1.5, True, "2", None], ids=repr)
def test_evict_refuses_a_bad_block_count(store: KVStore, num_blocks: object) -> None:
    def call(s: KVStore) -> object:
        return s.evict("gpu", num_blocks)  # type: ignore[arg-type]

    message = rf"num_blocks: got {num_blocks!r}, expected an int >= 0"
    assert_refused(store, call, InvalidArgumentError, message)


def test_errors_are_also_the_closest_builtin(store: KVStore) -> None:
    with pytest.raises(ValueError):
        store.lookup([-1])
    with pytest.raises(ValueError):
        store.store(GOOD, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.evict("gpu", -1)
    with pytest.raises(KeyError):
        store.release(999)
    store.check()


@pytest.mark.parametrize("bad", [3.0, "1", None, True])
def test_release_refuses_what_is_not_a_lease_or_an_int(store: KVStore, bad: object) -> None:
    live = [x.lease_id for x in store.leases()]
    assert live, "the fixture holds a lease"
    refuse = lambda s: s.release(bad)  # noqa: E731
    assert_refused(store, refuse, InvalidArgumentError, "lease: got")
    assert [x.lease_id for x in store.leases()] == live
