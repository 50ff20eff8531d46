"""Releases a client owes the server, sent on the next request rather than one of their own.

A shared-memory `load` is a lease, a copy out of the mapped pool and a release. Sending the
release as a request of its own made every load two round trips, which is most of a load's time
for prompts of a few MiB. Instead `load` hands its lease here once the copy is done, and:

- the client's next prefetch or reserve of the same tenant carries the ids in its `release`
  field (the server releases them once the request is known good, before its own work:
  `KVStore.prefetch` / `reserve`);
- whatever is still owed `RELEASE_AFTER_S` after it was handed in is released by the client's
  flusher (a thread of `Client`, a timer of `AsyncClient`) with `/v1/release`, so an idle
  client holds a lease at most that much longer than its load;
- `close()` releases everything owed.

Invariants: an id is owed at most once, and taken by one sender (the `take*` calls remove
what they return). A request that fails after taking ids gives them back (`give_back`): the
server may or may not have released them, and it passes over ids it no longer knows (an
explicit `/v1/release` of one is a `LeaseError`, which the flusher ignores), so sending one
twice is harmless. Thread-safe.

Requests: a prefetch or reserve carries `request`, a token the client drew (`new_token`). When
its reply is lost (a timeout, a reset connection, a cancelled task, a reply after `close()`)
the server may have granted a lease or reservation whose id the client never learned: the
token is owed instead (`add_request`), due at once, and given back by it (`/v1/release
{request}` for a lease, `/v1/abort {request}` for a reservation: `service/grants.py`) before
the client's next prefetch or reserve of that tenant, by the flusher, or at `close()`. The
server answers `{}` for a token it granted nothing under, so a give-back is done once answered.
"""

from __future__ import annotations

import secrets
import threading
import time

from kvtier.errors import ClosedError, InvalidArgumentError, LeaseError, shown
from kvtier.results import Lease

ID_LIMIT = 1 << 64
"""Ids a request can carry (msgpack's unsigned 64-bit); a lease's id is below 2**63."""


def release_of(lease: Lease | int) -> tuple[int, str]:
    """The lease id and tenant `release(lease)` sends, checked as `KVStore.release` checks
    them, before anything is sent: `InvalidArgumentError` for what is neither a `Lease` nor an
    int (a bool included), `LeaseError` for an int no lease has (outside [0, 2**64), which no
    request could carry: before, msgpack's `OverflowError`)."""
    raw = lease.lease_id if isinstance(lease, Lease) else lease
    if type(raw) is not int:
        raise InvalidArgumentError(f"lease: got {shown(lease)}, expected a Lease or an int id")
    if not 0 <= raw < ID_LIMIT:
        raise LeaseError(f"lease {raw}: unknown, released or expired")
    return raw, lease.tenant if isinstance(lease, Lease) else "default"


RELEASE_AFTER_S = 0.05
"""How long a release waits for a request to ride on before it is sent alone."""

MAX_CARRIED = 256
"""The most ids one request carries (the server's `wire.MAX_RELEASES`)."""


GIVE_BACK_PATHS = {"lease": "/v1/release", "reservation": "/v1/abort"}
"""Where a token owed for a lost reply of each kind is given back."""

Request = tuple[str, str, str]
"""A token owed: (kind: "lease" or "reservation", token, tenant)."""


def new_token() -> str:
    """A fresh request token: 16 lowercase hex chars (`wire.request_field`)."""
    return secrets.token_hex(8)


def may_have_reached(exc: BaseException, refusals: tuple[type[BaseException], ...]) -> bool:
    """Whether a prefetch or reserve that raised `exc` may have been granted on the server:
    anything but a refusal the server answered (`refusals`) or a call refused before it was
    sent (`ClosedError`)."""
    return not isinstance(exc, (ClosedError, *refusals))


class OwedReleases:
    """What one client owes: lease id -> (tenant, when it was handed in), and the tokens of
    lost replies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owed: dict[int, tuple[str, float]] = {}  # lease id -> (tenant, when handed in)
        self._requests: dict[tuple[str, str], str] = {}  # (kind, token) -> tenant

    def add_request(self, kind: str, token: str, tenant: str) -> None:
        """Owe the give-back of what request `token` (of `kind`) may have been granted."""
        with self._lock:
            self._requests[(kind, token)] = tenant

    def take_requests(self, tenant: str | None = None) -> list[Request]:
        """The tokens owed (for `tenant`; None: all), no longer owed."""
        with self._lock:
            taken = [(k, t, who) for (k, t), who in self._requests.items()
                     if tenant is None or who == tenant]  # fmt: skip
            for kind, token, _ in taken:
                del self._requests[(kind, token)]
        return taken

    def add(self, lease: Lease, tenant: str) -> None:
        """Owe `lease`'s release; `tenant` as the load that took it named it (the client's
        argument, so that the release goes out under the same headers)."""
        with self._lock:
            self._owed[lease.lease_id] = (tenant, time.monotonic())

    def take(self, tenant: str) -> list[int]:
        """The ids owed for `tenant` (at most `MAX_CARRIED`), no longer owed: to carry on a
        request of that tenant."""
        with self._lock:
            ids = [i for i, (t, _) in self._owed.items() if t == tenant][:MAX_CARRIED]
            for i in ids:
                del self._owed[i]
        return ids

    def take_due(self, now: float | None = None) -> list[tuple[int, str]]:
        """(id, tenant) of what has been owed `RELEASE_AFTER_S` or longer; all with
        `now=math.inf`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [(i, t) for i, (t, at) in self._owed.items() if now - at >= RELEASE_AFTER_S]
            for i, _ in due:
                del self._owed[i]
        return due

    def give_back(self, tenant: str, ids: list[int]) -> None:
        """Owe `ids` again (a request that carried them failed), due at once."""
        with self._lock:
            for i in ids:
                self._owed.setdefault(i, (tenant, 0.0))

    def next_due_in(self) -> float | None:
        """Seconds until the oldest owed id is due (0 if one is), or None if nothing is owed."""
        with self._lock:
            if self._requests:
                return 0.0
            if not self._owed:
                return None
            oldest = min(at for _, at in self._owed.values())
        return max(0.0, oldest + RELEASE_AFTER_S - time.monotonic())
