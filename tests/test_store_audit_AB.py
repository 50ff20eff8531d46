"""Audit AB of the in-process API (`KVStore`) as an engine author uses it: what a store keeps of
a KV that requires grad, the timeouts a lease waits with, token lists with tensor items, and
the keyed API's chain of keys. Real stores on the CPU, real leases; each scenario failed before
its fix.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import kv_for, leased_kv, same

from kvtier.errors import InvalidArgumentError, InvalidTokensError
from kvtier.keyed import KeyedPages
from kvtier.store import KVStore

TOKENS = list(range(100, 116))  # 4 blocks of the tiny layout


def _depth(tensor: torch.Tensor) -> int:
    """How many autograd nodes hang behind `tensor` along its first inputs."""
    depth, node = 0, tensor.grad_fn
    while node is not None:
        depth += 1
        node = next((fn for fn, _ in node.next_functions if fn is not None), None)
    return depth


def test_a_kv_that_requires_grad_is_stored_as_values_never_as_a_graph(
    make_store: Callable[..., KVStore],
) -> None:
    # Before: the copy into the slots chained the caller's graph to the pools' buffers, which
    # then required grad; every later store added a node to that chain (memory without end),
    # and every load came back requiring grad.
    store = make_store(gpu_blocks=16, host_blocks=32, background=False)
    kv = kv_for(store, 16, seed=1)
    weights = torch.ones((), requires_grad=True)
    computed = kv * weights  # an engine's forward outside no_grad / inference_mode
    assert store.store(TOKENS, computed).stored_tokens == 16
    for i in range(5):
        store.store([5000 + i] * 4 + list(range(12)), kv)
    for pool in store.memory:
        assert not pool.buffer.requires_grad and pool.buffer.grad_fn is None, pool.name
        assert _depth(pool.buffer) == 0
    loaded = store.load(TOKENS).kv
    assert not loaded.requires_grad and same(loaded, kv)
    lease = store.prefetch(TOKENS)
    assert same(leased_kv(store, lease), kv)
    store.release(lease)
    pages = kv.view(2, 2, 4, 4, 2, 4).permute(2, 0, 1, 3, 4, 5).contiguous().requires_grad_()
    store.store(list(range(300, 316)), pages, layout="blocks")
    assert not store.gpu_pool.buffer.requires_grad
    assert same(store.load(list(range(300, 316))).kv, kv)
    # the out= check still tells a view of a pool apart (it said "requires grad" before)
    view = store.gpu_pool.buffer.view(-1)[: kv.numel()].view(kv.shape)
    with pytest.raises(InvalidArgumentError, match="overlaps the 'gpu' tier's pool"):
        store.load(TOKENS, out=view)
    store.check()


@pytest.mark.parametrize("timeout", [float("nan"), "1", True, [1.0], torch.tensor([1.0, 2.0])])
def test_a_lease_wait_refuses_a_timeout_that_is_no_seconds(
    make_store: Callable[..., KVStore], timeout: object
) -> None:
    # Before: a NaN waited without limit on a pending lease, a string or a 2**1329 raised
    # TypeError / OverflowError from inside the wait, and a ready lease took any of them.
    store = make_store(background=False)
    store.store(TOKENS, kv_for(store, 16))
    lease = store.prefetch(TOKENS)
    with pytest.raises(InvalidArgumentError, match="timeout: got"):
        lease.wait(timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="timeout: got"):
        lease.wait_layer(0, timeout)  # type: ignore[arg-type]
    assert lease.wait(0) and lease.wait(float("inf")) and lease.wait_layer(1, 10**400)
    # what waited before still does: a deadline already past (0), NumPy and tensor seconds
    assert lease.wait(-1.0) and lease.wait(np.float32(0.5)) and lease.wait(torch.tensor(1))  # type: ignore[arg-type]
    store.release(lease)
    store.check()


@pytest.mark.parametrize(
    "item",
    [torch.tensor(1.0), np.array(True), torch.tensor(True), torch.tensor([3])],
    ids=["float tensor", "0-d bool array", "bool tensor", "1-d tensor"],
)
def test_a_token_list_item_that_is_no_int_is_an_invalid_tokens_error(
    make_store: Callable[..., KVStore], item: object
) -> None:
    # Before: a float tensor's or a 0-d bool array's __index__ raised TypeError out of the
    # store; a tensor of one bool or one element was read as a token id.
    store = make_store(background=False)
    store.store(TOKENS, kv_for(store, 16))
    before = store.status()["tiers"]
    tokens = [*TOKENS[:4], item, *TOKENS[5:]]
    with pytest.raises(InvalidTokensError, match=r"tokens\[4\]: got .*expected an int"):
        store.lookup(tokens)  # type: ignore[arg-type]
    with pytest.raises(InvalidTokensError, match=r"tokens\[4\]"):
        store.store(tokens, kv_for(store, 16))  # type: ignore[arg-type]
    assert store.status()["tiers"] == before
    # 0-d integer tensors (a `list(tensor)`) stay the ints they hold
    assert store.lookup(list(torch.tensor(TOKENS))).num_tokens == 16
    store.check()


@pytest.mark.parametrize("key", ["ab" * 32, b"\x01\x02", bytearray(b"\x01")])
def test_keyed_tokens_refuse_one_key_for_a_chain(key: object) -> None:
    # Before: a str was iterated as its characters, one page each (a 64-character hex key,
    # 64 pages of keys no engine ever named).
    pages = KeyedPages(8, "scope")
    with pytest.raises(InvalidArgumentError, match="keys: got one key"):
        pages.tokens(key)  # type: ignore[arg-type]
    assert pages.tokens(["ab" * 32]) == pages.page("ab" * 32)
