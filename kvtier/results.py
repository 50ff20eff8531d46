"""The public result types of `KVStore` (and, later, of the sidecar client).

Token counts, not block counts: an engine thinks in tokens. Every count is a multiple of
`block_tokens`, because only whole blocks are cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, NamedTuple, Protocol

import torch

from kvtier.errors import InvalidArgumentError, LeaseError, shown


class LookupResult(NamedTuple):
    """How many leading tokens are cached, split by the fastest tier holding each block.
    `gpu_tokens + host_tokens + disk_tokens + remote_tokens == num_tokens`; the tiers come in
    that order along the prefix (whatever is on the GPU is a prefix of what is cached).
    `remote_tokens`: past the local prefix, what a remote tier (`tiers.remote`) holds in a row
    now; a `prefetch` or `load` brings it in, if it is still there then."""

    num_tokens: int
    gpu_tokens: int
    host_tokens: int
    disk_tokens: int
    remote_tokens: int = 0


class StoreResult(NamedTuple):
    """`stored_tokens` tokens were newly cached; `cached_tokens` of the sequence are cached now
    (the prefix that was already there plus the new blocks). `dropped_tokens` could not be
    placed in any tier (everything evictable was leased, or the disk could not keep up) and
    were not stored. `pending_tokens` are being written to disk (they extend a prefix that
    lives only there) and become visible to `lookup` once durable; one that fails is counted
    in the mover's failures, never reported cached."""

    cached_tokens: int
    stored_tokens: int
    dropped_tokens: int
    pending_tokens: int = 0


class Reservation(NamedTuple):
    """Slots reserved for the new blocks of a sequence (`KVStore.reserve`): block i of the
    `num_tokens` new tokens (after the `cached_tokens` already cached) goes into slot `slots[i]`
    of tier `tier`'s pool, written whole before `commit` (a slot left unwritten holds a canary,
    and the commit is refused). `reservation_id` is random (63 bits, never 0); 0 with no slots:
    nothing could be reserved. `expires_at` is on the store's clock; past it the commit fails
    and the slots are quarantined, never published. `dropped_tokens`: the whole blocks' tokens
    past `num_tokens` that had no room (a tier short of it reserves the first blocks): the
    commit counts them dropped, so its `cached + dropped + pending` is the sequence's whole
    blocks, as a store's."""

    reservation_id: int
    tenant: str
    cached_tokens: int
    num_tokens: int
    tier: str
    slots: tuple[int, ...]
    expires_at: float
    dropped_tokens: int = 0


class LoadResult(NamedTuple):
    """The KV of the cached prefix: `kv` is `[num_layers, 2, tokens, num_kv_heads, head_dim]`
    (K at index 0, V at index 1; layout "blocks": pages `[blocks, num_layers, 2, block_tokens,
    num_kv_heads, head_dim]`) of the tokens from the load's `start` to `num_tokens`: a new
    tensor, or the part of the caller's `out` that the load wrote."""

    num_tokens: int
    kv: torch.Tensor


class LeaseState(str, enum.Enum):
    """Where a lease is in its life. PENDING -> READY -> RELEASED (or EXPIRED); a pending lease
    may also end CANCELLED, EXPIRED or FAILED (a copy it waited on failed verification)."""

    PENDING = "pending"
    READY = "ready"
    RELEASED = "released"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    FAILED = "failed"


class _Progress(Protocol):
    """What a lease reads of a copy it waits on (a `PrefetchFlight`, `transfer/flights.py`)."""

    layers_done: int


class Lease:
    """A read lock on a prefix held on the `gpu` tier until released or `expires_at` (the
    store's clock). `block_table[i]` is the gpu slot of block i; once the lease is READY, and
    while it lives, those slots hold exactly those blocks.

    A prefetch returns its lease at once, PENDING while the copies that bring the prefix up are
    in flight (its block table already names their destination slots). Wait for it:

        lease.wait(timeout)            from a thread: True when READY, False on timeout
        await lease                    from asyncio: the lease, once READY
        lease.wait_layer(l, timeout)   layer l of every block is in place (layer-by-layer use)

    Each raises `LeaseError` (naming the state and why) if the lease ended without becoming
    ready: cancelled, expired, failed, or released. A second prefetch of a prefix in flight
    joins the copies already running instead of starting its own. `layers_ready` is the number
    of leading layers whose data is complete in every slot of the block table; it reaches
    `num_layers` when the lease is READY. Cancel a pending lease with `store.cancel(lease)`
    (or `lease.cancel()`); releasing works in any live state.
    """

    def __init__(
        self,
        lease_id: int,
        tenant: str,
        num_tokens: int,
        block_table: tuple[int, ...],
        expires_at: float,
        *,
        num_layers: int = 0,
        pending: bool = False,
        canceller: Callable[[Lease], None] | None = None,
    ) -> None:
        self.lease_id = lease_id
        self.tenant = tenant
        self.num_tokens = num_tokens
        self.block_table = block_table
        self.expires_at = expires_at
        self.num_layers = num_layers
        self._state = LeaseState.PENDING if pending else LeaseState.READY
        self._reason = ""
        self._flights: list[_Progress] = []  # what a pending lease waits on
        self._layer_groups: Callable[[int], int] | None = None  # groups done -> layers ready
        self._layers = 0 if pending else num_layers
        self._cond = threading.Condition()
        self._async: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._canceller = canceller
        self.created = time.monotonic()
        self.ready_after_s: float | None = None if pending else 0.0

    # ---- reading ---------------------------------------------------------------------------

    @property
    def state(self) -> LeaseState:
        return self._state

    @property
    def reason(self) -> str:
        """Why the lease ended without becoming ready ('' otherwise)."""
        return self._reason

    def ready(self) -> bool:
        return self._state is LeaseState.READY

    @property
    def layers_ready(self) -> int:
        return self._layers

    # ---- waiting ---------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Block until READY (True) or `timeout` seconds passed (False); `LeaseError` if the
        lease ended without becoming ready. `timeout`: None (no limit) or a number of seconds
        >= 0 (`seconds_to_wait`), else `InvalidArgumentError`, before waiting."""
        seconds = seconds_to_wait(timeout)
        with self._cond:
            self._cond.wait_for(lambda: self._state is not LeaseState.PENDING, seconds)
            return self._outcome()

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer `layer` of every block is in place (True) or `timeout` passed
        (as `wait`'s)."""
        if type(layer) is not int or not 0 <= layer < max(self.num_layers, 1):
            raise InvalidArgumentError(
                f"layer: got {shown(layer)}, expected an int in [0, {self.num_layers})"
            )
        seconds = seconds_to_wait(timeout)
        with self._cond:
            self._cond.wait_for(
                lambda: self._layers > layer or self._state is not LeaseState.PENDING, seconds
            )
            if self._layers > layer and self._state in (LeaseState.PENDING, LeaseState.READY):
                return True
            return self._outcome()

    def __await__(self) -> Generator[Any, None, Lease]:
        return self.wait_async().__await__()

    async def wait_async(self) -> Lease:
        """`await lease` as a coroutine (for `asyncio.wait_for` and tasks): the lease once
        READY; `LeaseError` if it ended without becoming ready."""
        future: asyncio.Future[None] | None = None
        with self._cond:
            if self._state is LeaseState.PENDING:
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._async.append((loop, future))
        if future is not None:
            await future
        with self._cond:
            self._outcome()
        return self

    def _outcome(self) -> bool:
        """True if READY, False if PENDING; `LeaseError` for every ended state."""
        if self._state is LeaseState.READY:
            return True
        if self._state is LeaseState.PENDING:
            return False
        why = f": {self._reason}" if self._reason else ""
        raise LeaseError(f"lease {self.lease_id} is {self._state.value}{why}")

    def made_by(self, canceller: Callable[[Lease], None]) -> bool:
        """Whether this lease cancels through `canceller`: given a store's `cancel`, whether
        that store made it (bound methods are equal only on the same store), so that a reader
        of one store's pages (`PagedAttention`) tells another store's lease apart."""
        return self._canceller is not None and self._canceller == canceller

    def cancel(self) -> None:
        """Cancel through the store that made this lease (`KVStore.cancel`)."""
        if self._canceller is None:
            raise LeaseError(f"lease {self.lease_id}: not made by a store, nothing to cancel")
        self._canceller(self)

    def __repr__(self) -> str:
        return (
            f"Lease(id={self.lease_id}, tenant={self.tenant!r}, tokens={self.num_tokens}, "
            f"{self._state.value}, layers_ready={self._layers}/{self.num_layers})"
        )


class LeaseOwner:
    """The owner's side of a `Lease`: whoever made it (the store's lease book,
    `transfer/leasing.py`, or a client mirroring a server's lease) moves it through its states
    here; holders of the lease only read and wait. Every call is thread-safe (the lease's own
    condition); none takes a lock of the store."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def wait_on(self, flight: _Progress, layer_groups: Callable[[int], int]) -> None:
        """Depend on `flight` (before the lease is handed out, under the store's lock);
        `layer_groups(g)` is the number of leading layers complete once g groups are."""
        lease = self.lease
        lease._flights.append(flight)
        lease._layer_groups = layer_groups

    def progress(self) -> None:
        """A flight finished a layer group: recompute `layers_ready` and wake waiters."""
        lease, flights = self.lease, self.lease._flights  # read once: `resolve` empties it
        if lease._layer_groups is None or not flights:
            return
        groups = min(flight.layers_done for flight in flights)
        with lease._cond:
            if lease._state is LeaseState.PENDING:
                lease._layers = max(lease._layers, lease._layer_groups(groups))
                lease._cond.notify_all()

    def resolve(self, state: LeaseState, reason: str = "") -> None:
        """Move to `state` and wake every waiter (threads and event loops)."""
        lease = self.lease
        with lease._cond:
            if lease._state is LeaseState.PENDING and state is LeaseState.READY:
                lease._layers = lease.num_layers
                lease.ready_after_s = time.monotonic() - lease.created
            lease._state, lease._reason = state, reason
            lease._flights = []
            waiters, lease._async = lease._async, []
            lease._cond.notify_all()
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(_wake, future)


def seconds_to_wait(timeout: object) -> float | None:
    """A `Lease.wait` timeout as `threading.Condition` takes it: None stays None (no limit); a
    real number of seconds (not a bool: an int, a float, a NumPy scalar, a 0-d tensor), below 0
    taken as 0 (as threading does: `deadline - now` once past it) and infinity and anything past
    `threading.TIMEOUT_MAX` cut to that; else (NaN, a string) `InvalidArgumentError` naming it.
    (A NaN waited without limit, a string or a huge int raised TypeError or OverflowError from
    inside the wait.)"""
    if timeout is None:
        return None
    if not isinstance(timeout, bool) and hasattr(timeout, "__float__"):
        try:
            seconds = float(timeout)
        except (TypeError, ValueError, RuntimeError):  # a tensor of several values, say
            seconds = math.nan
        except OverflowError:  # an int past the largest float: no limit, as infinity
            seconds = math.inf
        if not math.isnan(seconds):
            return min(max(seconds, 0.0), threading.TIMEOUT_MAX)
    raise InvalidArgumentError(
        f"timeout: got {shown(timeout)}, expected a number of seconds, or None to wait "
        "without limit"
    )


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # the awaiting task may have been cancelled
        future.set_result(None)
