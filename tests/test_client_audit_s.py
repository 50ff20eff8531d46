"""The sidecar clients against a real `kvtier serve` (audit S): what they check before a
request is sent, and what a forked child may do with its parent's client.

Pinned here:
- a store through the body (no mapped pools) checks `kv` against the served layout and the
  tokens from `start` on, as the mapped path and `KVStore` do: a KV of the whole prompt with
  `start=4`, all the pages with `start=4`, or more tokens than `tokens` is an
  `InvalidKVError`, and nothing is stored (before, block 1 was stored with the KV of tokens
  0..3, and every load served it);
- a client used in another process than its maker's (a fork) raises `ClosedError` at every
  call, `close()` included, and sends nothing (before, parent and child read each other's
  replies on the shared sockets);
- misuse is a typed error naming the value, never a raw AttributeError / TypeError /
  NotImplementedError: commit and abort take a `Reservation` or its id (as `KVStore`),
  `wait_for` a `Lease` and a number, tokens a tensor with data, a constructor's `api_key`,
  `tenant` and `timeout_s` are checked at construction;
- the store's methods the README promised: `cancel`, `reset(tenant)` positional,
  `prefetch(wait=1)` refused as the store refuses it, and with an API key a call's `tenant=`
  naming another tenant than the key's refused, not silently ignored (before, reset of
  tenant "zzz" reset the key's own tenant).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from service_server import BT, Server, kv_of, running, tokens_of, write_config

from kvtier.blocks import to_blocks
from kvtier.client import AsyncClient, Client
from kvtier.errors import (
    InvalidArgumentError,
    InvalidKVError,
    InvalidTokensError,
    LeaseError,
)
from kvtier.results import LeaseState

KEY_A, KEY_B = "audit-s-key-a-0123456789", "audit-s-key-b-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(
        tmp_path_factory.mktemp("audit_s"),
        tenants={"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
    )
    with running(config) as live:
        yield live


def _raises(exc: type[BaseException], call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(exc) as caught:
        call(*args, **kwargs)
    return str(caught.value)


# ---- 1. the body path checks the KV as the mapped path does ---------------------------------


def test_a_body_store_of_misplaced_kv_is_refused_and_stores_nothing(server: Server) -> None:
    tokens, full = tokens_of(1000, 2 * BT), kv_of(2 * BT, seed=1)
    with Client(server.url, api_key=KEY_A, shared_memory=False) as client:
        assert client.store(tokens[:BT], full[:, :, :BT]).stored_tokens == BT
        _raises(InvalidKVError, client.store, tokens, full, start=BT)  # the whole prompt's
        pages = to_blocks(full, BT)  # every page, where the tail's one is meant
        _raises(InvalidKVError, client.store, tokens, pages, start=BT, layout="blocks")
        for longer in (3 * BT, 4 * BT):  # more tokens of KV than `tokens`
            other = tokens_of(2000 + longer, 2 * BT)
            _raises(InvalidKVError, client.store, other, kv_of(longer, seed=2))
            assert client.lookup(other).num_tokens == 0
        assert client.lookup(tokens).num_tokens == BT  # block 1 never stored from block 0's
        assert client.store(tokens, full[:, :, BT:], start=BT).stored_tokens == BT
        loaded = client.load(tokens)
        assert loaded.num_tokens == 2 * BT and torch.equal(loaded.kv, full)


def test_an_async_body_store_of_misplaced_kv_is_refused(server: Server) -> None:
    tokens, full = tokens_of(3000, 2 * BT), kv_of(2 * BT, seed=3)

    async def main() -> None:
        async with AsyncClient(server.url, api_key=KEY_A, shared_memory=False) as client:
            assert (await client.store(tokens[:BT], full[:, :, :BT])).stored_tokens == BT
            with pytest.raises(InvalidKVError):
                await client.store(tokens, full, start=BT)
            with pytest.raises(InvalidKVError):
                await client.store(tokens, to_blocks(full, BT), start=BT, layout="blocks")
            with pytest.raises(InvalidKVError):
                await client.store(tokens_of(3100, 2 * BT), kv_of(3 * BT, seed=4))
            assert (await client.lookup(tokens)).num_tokens == BT

    asyncio.run(main())


# ---- 2. a client is its maker process's -----------------------------------------------------


def _in_child(child: Any) -> str:
    """What `child()` (run in a forked child) returned, or the name of what it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            outcome = str(child())
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        os.write(write, outcome.encode()[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        outcome = pipe.read().decode()
    os.waitpid(pid, 0)
    return outcome


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_client_used_in_a_forked_child_refuses_every_call(
    server: Server, shared_memory: bool
) -> None:
    tokens, kv = tokens_of(4000, 2 * BT), kv_of(2 * BT, seed=5)
    with Client(server.url, api_key=KEY_A, shared_memory=shared_memory) as client:
        client.store(tokens, kv)
        calls = {
            "lookup": lambda: client.lookup(tokens),
            "load": lambda: client.load(tokens),
            "store": lambda: client.store(tokens, kv),
            "prefetch": lambda: client.prefetch(tokens),
            "status": client.status,
            "close": client.close,
        }
        for name, call in calls.items():
            outcome = _in_child(call)
            assert outcome.startswith("ClosedError") and "process" in outcome, (name, outcome)
        # the parent's client was never touched by its children
        assert client.lookup(tokens).num_tokens == 2 * BT
        assert torch.equal(client.load(tokens).kv, kv)


def test_an_async_client_used_in_a_forked_child_refuses_every_call(server: Server) -> None:
    tokens = tokens_of(4500, BT)
    client = AsyncClient(server.url, api_key=KEY_A, shared_memory=False)
    asyncio.run(client.lookup(tokens))  # it has a connection to inherit
    for call in (client.lookup(tokens), client.status(), client.aclose()):
        outcome = _in_child(lambda c=call: asyncio.run(c))
        call.close()  # (the parent's copy of the coroutine, never run)
        assert outcome.startswith("ClosedError") and "process" in outcome, outcome


# ---- 3. misuse is a typed error naming the value --------------------------------------------


@pytest.mark.parametrize("shared_memory", [True, False])
def test_misuse_of_a_call_is_a_typed_error(server: Server, shared_memory: bool) -> None:
    tokens, kv = tokens_of(5000 + 100 * shared_memory, 2 * BT), kv_of(2 * BT, seed=6)
    with Client(server.url, api_key=KEY_A, shared_memory=shared_memory) as client:
        _raises(LeaseError, client.commit, 5)  # an id, as `KVStore.commit` takes: none such
        assert "reservation" in _raises(InvalidArgumentError, client.abort, None)
        assert "lease" in _raises(InvalidArgumentError, client.wait_for, None)
        lease = client.prefetch(tokens, wait=False)
        assert "timeout_s" in _raises(InvalidArgumentError, client.wait_for, lease, "1")
        client.release(lease)
        meta = torch.arange(2 * BT, device="meta")
        assert "tokens" in _raises(InvalidTokensError, client.lookup, meta)
        _raises(InvalidKVError, client.store, tokens, kv.numpy())
        _raises(InvalidKVError, client.store, tokens, None)
        assert "start" in _raises(InvalidArgumentError, client.store, tokens, kv, start=4.0)
        _raises(InvalidKVError, client.store, tokens, kv, layout="blocks")
        assert client.lookup(tokens).num_tokens == 0  # nothing of it stored
        reservation = client.reserve(tokens)  # committed and aborted by id, as the store does
        client.abort(reservation.reservation_id)
        _raises(LeaseError, client.commit, reservation.reservation_id)


def test_misuse_of_an_async_call_is_a_typed_error(server: Server) -> None:
    tokens, kv = tokens_of(5500, 2 * BT), kv_of(2 * BT, seed=7)

    async def main() -> None:
        async with AsyncClient(server.url, api_key=KEY_A, shared_memory=False) as client:
            with pytest.raises(LeaseError):
                await client.commit(5)
            with pytest.raises(InvalidArgumentError, match="reservation"):
                await client.abort(None)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError, match="lease"):
                await client.wait_for(None)  # type: ignore[arg-type]
            with pytest.raises(InvalidTokensError, match="tokens"):
                await client.lookup(torch.arange(2 * BT, device="meta"))
            with pytest.raises(InvalidKVError):
                await client.store(tokens, None)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError, match="start"):
                await client.store(tokens, kv[:, :, BT:], start=4.0)  # type: ignore[arg-type]

    asyncio.run(main())


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"api_key": 5}, "api_key"),
        ({"tenant": 5}, "tenant"),
        ({"timeout_s": "5"}, "timeout_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"shared_memory": 1}, "shared_memory"),
    ],
)
def test_a_bad_constructor_argument_is_refused_at_construction(
    server: Server, options: dict[str, Any], named: str
) -> None:
    arguments = {"shared_memory": False, **options}
    assert named in _raises(InvalidArgumentError, Client, server.url, **arguments)
    assert named in _raises(InvalidArgumentError, AsyncClient, server.url, **arguments)


# ---- 4. the store's methods, as the README says ---------------------------------------------


def test_cancel_reset_and_wait_are_the_stores(server: Server) -> None:
    tokens, kv = tokens_of(6000, 2 * BT), kv_of(2 * BT, seed=8)
    with Client(server.url, api_key=KEY_B, shared_memory=False) as client:
        client.store(tokens, kv)
        lease = client.prefetch(tokens)
        client.cancel(lease)  # `KVStore.cancel`: a ready lease released
        _raises(LeaseError, client.release, lease)  # ended already
        assert "wait" in _raises(InvalidArgumentError, client.prefetch, tokens, wait=1)
        assert client.reset("default")["dropped_blocks"] == 2  # positional, as the store's
        assert client.lookup(tokens).num_tokens == 0


def test_a_tenant_other_than_the_keys_is_refused_not_ignored(server: Server) -> None:
    tokens, kv = tokens_of(7000, 2 * BT), kv_of(2 * BT, seed=9)
    with Client(server.url, api_key=KEY_A, shared_memory=False) as client:
        client.store(tokens, kv, tenant="a")  # the key's own tenant, by name
        message = _raises(InvalidArgumentError, client.reset, tenant="zzz")
        assert "'zzz'" in message and "'a'" in message
        _raises(InvalidArgumentError, client.lookup, tokens, tenant="b")
        _raises(InvalidArgumentError, client.store, tokens, kv, tenant="b")
        assert client.lookup(tokens).num_tokens == 2 * BT  # tenant a's KV not reset

    async def main() -> None:
        async with AsyncClient(server.url, api_key=KEY_A, shared_memory=False) as aclient:
            with pytest.raises(InvalidArgumentError, match="zzz"):
                await aclient.reset(tenant="zzz")
            assert (await aclient.lookup(tokens, tenant="a")).num_tokens == 2 * BT
            lease = await aclient.prefetch(tokens)
            await aclient.cancel(lease)
            assert lease.state is not LeaseState.PENDING

    asyncio.run(main())


def test_close_checks_its_timeout(server: Server) -> None:
    client = Client(server.url, api_key=KEY_A, shared_memory=False)
    _raises(InvalidArgumentError, client.close, "1")
    client.close()
