"""A client's commit of a reservation that had room for its first blocks only.

The server reserves the blocks it has room for and its commit counts the rest dropped, so the
commit's `cached + dropped` is the sequence's whole blocks; the client bounded a commit reply by
the reserved tokens alone and raised `ReplyError` ("store: cached + dropped + pending: got 24,
expected at most the 16 tokens sent") for a store the server had done right (a `/tmp` soak of
three tenants' clients over shared memory, a sidecar SIGKILLed and restarted: 4 of 15 runs). A
reservation now says what it had no room for (`Reservation.dropped_tokens`), the reply is
checked against the tokens sent, and the commit's bound counts it.
"""

from __future__ import annotations

import pytest

from kvtier.client.arguments import reservation_of
from kvtier.client.pages import stored
from kvtier.errors import ReplyError
from kvtier.results import Reservation
from kvtier.service import replies

REPLY = {
    "reservation_id": 7, "tenant": "default", "cached_tokens": 4, "num_tokens": 4, "tier": "gpu",
    "slots": [0], "expires_at": 1.0, "instance": "0123456789abcdef",
}  # fmt: skip


def test_a_short_reservations_commit_counts_what_it_had_no_room_for() -> None:
    reservation = replies.reservation({**REPLY, "dropped_tokens": 8}, None, 16)
    assert reservation.dropped_tokens == 8
    most = reservation_of(reservation).most_tokens
    assert most == 16  # was 8: the reserved tokens alone
    commit = {"cached_tokens": 8, "stored_tokens": 4, "dropped_tokens": 8, "pending_tokens": 0}
    assert stored(commit, most).dropped_tokens == 8  # was: ReplyError
    with pytest.raises(ReplyError, match="cached \\+ dropped \\+ pending: got 20"):
        stored({**commit, "dropped_tokens": 12}, most)


def test_a_reservation_reply_past_the_sequence_is_refused() -> None:
    with pytest.raises(ReplyError, match=r"tokens \[4, 8\) and 8 more without room of a 12-"):
        replies.reservation({**REPLY, "dropped_tokens": 8}, None, 12)
    assert replies.reservation(REPLY, None, 12).dropped_tokens == 0  # a server before the field
    assert Reservation(0, "default", 0, 0, "gpu", (), 0.0).dropped_tokens == 0
