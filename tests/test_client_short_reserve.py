"""A client's store over shared memory whose reservation has room for its first blocks only.

The server reserves the blocks it has room for and its commit counts the rest dropped, so the
commit's `cached + dropped` is the sequence's whole blocks; the client bounded a commit reply by
the reserved tokens alone and raised `ReplyError` ("store: cached + dropped + pending: got 24,
expected at most the 16 tokens sent") for a store the server had done right (a `/tmp` soak of
three tenants' clients: 4 of 15 runs). A reservation now says what it had no room for
(`Reservation.dropped_tokens`), and the bound counts it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from service_server import BT, kv_of, running, tokens_of, write_config

from kvtier.client import Client
from kvtier.errors import ReplyError
from kvtier.service import replies


def test_a_mapped_store_short_of_room_returns_what_the_server_did(tmp_path: Path) -> None:
    config = write_config(tmp_path, gpu_blocks=4, host_blocks=2, write="write_back")
    theirs, mine, new = tokens_of(100, 2 * BT), tokens_of(200, 2 * BT), tokens_of(300, 4 * BT)
    kv = kv_of(4 * BT, 3)
    with running(config) as server, Client(server.url) as client:
        assert client.pool_buffer("gpu") is not None  # the mapped path is the one taken
        client.store(theirs, kv_of(2 * BT, 1))
        client.store(mine, kv_of(2 * BT, 2))
        lease = client.prefetch(mine, ttl_s=600)  # 2 of gpu's 4 slots leased
        reservation = client.reserve(new)
        assert (reservation.num_tokens, reservation.dropped_tokens) == (2 * BT, 2 * BT)
        client.abort(reservation)
        result = client.store(new, kv)  # was: ReplyError
        assert (result.cached_tokens, result.stored_tokens) == (2 * BT, 2 * BT)
        assert result.dropped_tokens == 2 * BT
        loaded = client.load(new)
        assert loaded.num_tokens == 2 * BT and torch.equal(loaded.kv, kv[:, :, : 2 * BT])
        client.release(lease)
        assert server.admin("/v1/admin/check").json() == {"ok": True, "detail": ""}


def test_a_reservation_reply_past_the_sequence_is_refused() -> None:
    body = {"reservation_id": 7, "tenant": "default", "cached_tokens": 4, "num_tokens": 4,
            "tier": "gpu", "slots": [0], "expires_at": 1.0, "dropped_tokens": 8,
            "instance": "0123456789abcdef"}  # fmt: skip
    try:
        replies.reservation(body, None, 12)
    except ReplyError as refused:
        assert "tokens [4, 8) and 8 more without room of a 12-token" in str(refused)
    else:
        raise AssertionError("a reservation of 16 tokens of a 12-token sequence was taken")
    assert replies.reservation({**body, "dropped_tokens": 4}, None, 12).dropped_tokens == 4
