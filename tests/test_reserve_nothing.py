"""A reserve that reserves nothing (id 0: every slot leased) can be aborted: nothing to give
back, no error. An engine that aborts whatever it reserved on any failure got `LeaseError`
("reservation 0: unknown") in process, and 404 through the sidecar (audit BB)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import kv_for
from service_server import BT, kv_of, running, tokens_of, write_config

from kvtier.client import Client
from kvtier.errors import InvalidArgumentError, LeaseError
from kvtier.store import KVStore


def test_aborting_what_reserved_nothing_in_process(make_store: Callable[..., KVStore]) -> None:
    store = make_store(gpu_blocks=3, host_blocks=3, background=False)
    store.store(list(range(12)), kv_for(store, 12))
    lease = store.prefetch(list(range(12)))  # every gpu and host slot held
    reservation = store.reserve(list(range(100, 108)))
    assert reservation.reservation_id == 0 and reservation.num_tokens == 0
    store.abort(reservation)  # before: LeaseError
    store.abort(0)
    with pytest.raises(InvalidArgumentError):
        store.abort(False)  # (a bool is no id)
    with pytest.raises(LeaseError):
        store.abort(12345)  # a live id or nothing
    store.check()
    store.release(lease)
    assert store.reserve(list(range(100, 108))).num_tokens == 8  # the store unchanged
    store.check()


def test_aborting_what_reserved_nothing_through_the_sidecar(tmp_path: Path) -> None:
    config = write_config(tmp_path, gpu_blocks=2, host_blocks=2)
    with running(config) as server, Client(server.url) as client:
        tokens = tokens_of(0, 2 * BT)
        client.store(tokens, kv_of(2 * BT, seed=1))
        lease = client.prefetch(tokens)
        reservation = client.reserve(tokens_of(500, 2 * BT))
        assert reservation.reservation_id == 0, reservation
        client.abort(reservation)  # before: 404 LeaseError
        client.abort(0)
        client.release(lease)
        server.admin("/v1/admin/check")
