"""Audit S of the public store API, pinned (an engine author's misuse, each refused typed):

- `load(out=...)` into a view of one of the store's own pools is an `InvalidArgumentError`
  naming `out`, and the cached blocks of other prompts stay as they were;
- `PagedAttention(a)` refuses a lease of another store (`LeaseError`), and a lone `Lease`
  where a list of them is asked for (`InvalidArgumentError`);
- a store is per process: in a forked child its calls raise `ClosedError` at once (never a
  write into the parent's shared-memory slots, never a wait on a mover thread the child does
  not have), and the child's pool teardown leaves the parent's /dev/shm segments in place;
- tokens as a meta, sparse or nested tensor, a nested `kv`, a bad `drain` timeout, a bad
  `KVStore` config, secret or clock, and a reference `Engine` over no model or no cache are
  typed errors naming the value, not raw tracebacks.
"""

from __future__ import annotations

import glob
import os
import select
import signal
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import kv_for
from test_engine_audit3 import tiny_llama

from kvtier import KVStore, parse_config
from kvtier.config import KVTierConfig
from kvtier.errors import (
    InvalidArgumentError,
    InvalidKVError,
    InvalidTokensError,
    KVTierError,
    LeaseError,
)
from kvtier.kernels.attention import PagedAttention
from kvtier.reference.engine import Engine

Stores = Callable[..., KVStore]
X, Y = list(range(1, 13)), list(range(500, 512))  # 3 blocks of 4 tokens each


def config(*, background: bool = True, write: str = "write_through") -> KVTierConfig:
    return parse_config(
        {
            "model": {
                "name": "demo",
                "num_layers": 2,
                "num_kv_heads": 2,
                "head_dim": 8,
                "dtype": "float32",
            },
            "block_tokens": 4,
            "tiers": {
                "gpu": {"capacity": "64KiB", "device": "cpu"},
                "host": {"capacity": "256KiB", "pinned": False},
            },
            "policy": {"write": write, "lease_ttl_s": 5},
            "mover": {"background": background},
        }
    )


@pytest.fixture
def stores() -> Iterator[Stores]:
    """`stores(**config kwargs, shared_memory=None)`: stores closed after the test (in the
    process that built them)."""
    made: list[KVStore] = []
    home = os.getpid()

    def factory(shared_memory: str | None = None, **kwargs: bool | str) -> KVStore:
        store = KVStore(config(**kwargs), shared_memory=shared_memory)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield factory
    if os.getpid() == home:
        for store in made:
            store.close()


def in_child(work: Callable[[], str], parent: Callable[[], object] = lambda: None) -> str:
    """Fork; `parent()` runs here first, then `work()` in the child, whose answer (or the name of
    what it raised) comes back through a pipe. A child silent for 10 s is killed: 'hung'."""
    go_read, go_write = os.pipe()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.read(go_read, 1)
            try:
                answer = work()
            except BaseException as exc:  # its name is the answer
                answer = type(exc).__name__
            os.write(write, answer.encode())
        finally:
            os._exit(0)
    os.close(write)
    answer = "hung"
    try:
        parent()
    finally:
        os.write(go_write, b"x")
        ready, _, _ = select.select([read], [], [], 10.0)
        if ready:
            answer = os.read(read, 4096).decode()
        else:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (go_read, go_write, read):
            os.close(fd)
    return answer


# ---- A.1: an `out` in the store's own pool ---------------------------------------------------


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_a_load_into_a_view_of_a_pool_of_the_store_is_refused(stores: Stores, tier: str) -> None:
    store = stores(write="write_through")
    kx, ky = kv_for(store, 12, seed=1), kv_for(store, 12, seed=2)
    store.store(X, kx)
    store.store(Y, ky)
    pool = store.gpu_pool if tier == "gpu" else store.host_pool
    with pytest.raises(InvalidArgumentError, match=f"out: .*the '{tier}' tier's pool"):
        store.load(Y, out=pool.buffer[0:3], layout="blocks")
    with pytest.raises(InvalidArgumentError, match="out: "):  # one slot as a "layers" out
        store.load(Y[:4], out=pool.buffer[1])
    assert torch.equal(store.load(X).kv, kx) and torch.equal(store.load(Y).kv, ky)
    store.check()
    out = torch.empty(3, 2, 2, 4, 2, 8)  # memory of the caller's own: loaded into
    assert store.load(Y, out=out, layout="blocks").num_tokens == 12
    assert torch.equal(out.permute(1, 2, 0, 3, 4, 5).flatten(2, 3), ky)


# ---- A.2: a lease of another store -------------------------------------------------------------


def test_paged_attention_refuses_a_lease_of_another_store(stores: Stores) -> None:
    a, b = stores(), stores()
    a.store(X, kv_for(a, 12, seed=1))
    b.store(Y, kv_for(b, 12, seed=2))
    # long leases: the interpreted kernels below outlast the stores' 5 s ttl on a loaded machine
    mine, theirs = a.prefetch(X, ttl_s=600), b.prefetch(Y, ttl_s=600)
    assert mine.block_table == theirs.block_table  # same slot numbers, other pools
    q = torch.randn(1, 4, 8)
    with pytest.raises(LeaseError, match=rf"leases\[0\]: lease {theirs.lease_id} .*another store"):
        PagedAttention(a).decode(q, 0, [theirs])
    with pytest.raises(LeaseError, match=r"leases\[1\]: .*another store"):
        PagedAttention(a).extend(q, q[:, :2], q[:, :2], 0, [mine, theirs], [1, 1])
    with pytest.raises(InvalidArgumentError, match=r"leases: got Lease\(.*expected a list"):
        PagedAttention(a).decode(q, 0, mine)  # type: ignore[arg-type]
    torch.testing.assert_close(
        PagedAttention(a).decode(q, 0, [mine]), PagedAttention(a).decode(q, 0, (mine,))
    )
    a.release(mine)
    b.release(theirs)


# ---- A.3: a store in a forked child ------------------------------------------------------------


def test_a_forked_child_cannot_write_the_parents_shared_memory_slots(stores: Stores) -> None:
    store = stores(shared_memory="auditS", background=False)
    store.store(X, kv_for(store, 12, seed=1))
    kv_c = kv_for(store, 12, seed=3)

    def child() -> str:  # in its stale view, C's slots are free
        store.store(Y, torch.full((2, 2, 12, 2, 8), 7.0))
        return "stored"

    answer = in_child(child, parent=lambda: store.store(list(range(900, 912)), kv_c))
    assert answer == "ClosedError"
    assert torch.equal(store.load(list(range(900, 912))).kv, kv_c)
    store.check()


def test_a_forked_child_leaves_the_parents_shared_memory_segments(stores: Stores) -> None:
    store = stores(shared_memory="auditSu", background=False)
    pattern = f"/dev/shm/auditSu-{os.getpid()}-*"
    segments = sorted(glob.glob(pattern))
    assert len(segments) == 2

    def child() -> str:
        try:
            store.close()
            answer = "closed"
        except KVTierError as exc:
            answer = type(exc).__name__
        for pool in store.memory:  # what the child's exit does to its copy of each pool
            pool.close()
        return answer

    assert in_child(child) == "ClosedError"
    assert sorted(glob.glob(pattern)) == segments
    store.store(X, kv_for(store, 12))
    store.close()
    assert glob.glob(pattern) == []  # the process that made them unlinks them


def test_a_forked_child_of_a_store_with_a_mover_is_refused_not_hung(stores: Stores) -> None:
    store = stores(background=True)
    kv = kv_for(store, 12)
    store.store(X, kv)
    assert store.drain()
    store.evict("gpu", 100)
    assert store.lookup(X).host_tokens == 12

    def child() -> str:
        answers = []
        for call in (lambda: store.prefetch(X), lambda: store.lookup(X), lambda: store.load(X)):
            try:
                call()
                answers.append("ok")
            except KVTierError as exc:
                answers.append(type(exc).__name__)
        return ",".join(answers)

    assert in_child(child) == "ClosedError,ClosedError,ClosedError"
    lease = store.prefetch(X)  # the parent's store is untouched
    assert lease.num_tokens == 12
    store.release(lease)
    store.check()


# ---- B: typed errors, not raw tracebacks -----------------------------------------------------


def odd_tokens() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype: torch says so
        nested = torch.nested.nested_tensor([torch.arange(8)])
    return {
        "meta": torch.arange(8, device="meta"),
        "sparse": torch.arange(8).to_sparse(),
        "nested": nested,
    }


@pytest.mark.parametrize("kind", ["meta", "sparse", "nested"])
@pytest.mark.parametrize("call", ["lookup", "load", "prefetch", "store"])
def test_tokens_without_dense_data_are_invalid_tokens(stores: Stores, kind: str, call: str) -> None:
    store = stores()
    store.store(list(range(8)), kv_for(store, 8))
    tokens = odd_tokens()[kind]
    args = (tokens, kv_for(store, 8)) if call == "store" else (tokens,)
    with pytest.raises(InvalidTokensError, match=r"tokens: got a .* tensor on .*expected a dense"):
        getattr(store, call)(*args)
    assert store.lookup(list(range(8))).num_tokens == 8
    store.check()


def test_a_nested_kv_and_bad_drain_timeouts_are_refused(stores: Stores) -> None:
    store = stores()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(2, 8, 2, 8)])
    with pytest.raises(InvalidKVError, match="kv: got a nested tensor"):
        store.store(list(range(8)), nested)
    for bad in ("1", None, -1, float("nan"), True):
        with pytest.raises(InvalidArgumentError, match=f"timeout_s: got {bad!r}"):
            store.drain(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="timeout_s: got an integer of 1329 bits"):
        store.drain(10**400)  # no float: it was an OverflowError
    assert store.drain(1)
    assert store.lookup(list(range(8))).num_tokens == 0
    store.check()


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (({"model": {"name": "m"}},), {}, "config: got .*dict.*expected a KVTierConfig"),
        (("configs/default.yaml",), {}, "config: got 'configs/default.yaml'.*KVTierConfig"),
        ((None,), {"secret": "abc"}, "secret: got str, expected bytes"),
        ((None,), {"clock": 5}, "clock: got 5, expected a callable"),
        ((None,), {"clock": lambda: "now"}, "clock: got .*expected a callable that returns"),
        ((None,), {"clock": lambda: float("nan")}, r"clock: got .*\(it read nan\).*finite"),
        ((None,), {"clock": lambda: 10**400}, r"clock: got .*\(it read an integer.*finite"),
    ],
    ids=["dict", "path", "str secret", "int clock", "clock of str", "NaN clock", "huge clock"],
)
def test_a_store_of_bad_arguments_is_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        KVStore(*args, **kwargs).close()


def test_a_reference_engine_needs_a_model_and_a_cache(stores: Stores) -> None:
    store = stores()
    with pytest.raises(InvalidArgumentError, match=r"cache: got None .*expected a KVStore"):
        Engine(tiny_llama(), None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"model: got None .*expected a reference Llama"):
        Engine(None, store)  # type: ignore[arg-type]
