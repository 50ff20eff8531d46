"""Ids that a client sees (leases, reservations): random, so that they tell nothing.

An id drawn from a shared counter counts the calls of every other client between two of one's
own, and a small id is easy to guess (issue 11, point 4). Every such id is instead 63 random
bits from `secrets` (it fits a signed 64-bit integer, so msgpack, JSON and SQL all carry it
intact), never 0 (0 means "none" in `Reservation`), and unique among the ids live in its
table. Guessing a live id of another client takes about 2**63 / (live ids) tries.
"""

from __future__ import annotations

import secrets
from collections.abc import Container

ID_BITS = 63


def fresh_id(taken: Container[int]) -> int:
    """A random id in [1, 2**63) that is not in `taken` (the ids live now)."""
    while True:
        candidate = secrets.randbits(ID_BITS)
        if candidate and candidate not in taken:
            return candidate
