"""`Owing`: what a `Client` (`blocking.py`) owes the server, and the thread that sends it;
`AsyncOwing`, its twin for an `AsyncClient` (a task of the event loop rather than a thread).

Two kinds of debt (`releases.py` holds them): the releases of shared-memory loads' leases, and
the give-backs, by request token, of what prefetches and reserves whose replies were lost may
have been granted. The flusher thread (started with the first debt) sends each as it falls due;
a prefetch or reserve gives back its tenant's tokens before it is sent (`send_requests`), and
`close(deadline)` sends the rest until `deadline`: it waits for a flush under way until then
(no longer), and starts no send past it; a send under way ends within its own call's bound (the
client's `timeout_s`, the whole call: `connections.py`), so `close` ends by `deadline` plus at
most one call's `timeout_s` (`AsyncOwing.close` by `deadline`: its sends are cancelled there).

Contract:
- `give_back(kind, token, tenant, deadline)` owes a token; once closed (nothing would send it)
  it is sent at once on a connection of its own (`alone`), so a reply that came after `close()`
  leaves nothing held; that send has what is left of the call's `deadline` (monotonic: the
  request's start plus the client's `timeout_s`, which bounds the whole call), and at least
  `GRACE_S`: a call whose reply was lost to its own timeout still gives its grant back (a
  reachable server answers in milliseconds), and a call never outlasts its `timeout_s` by more
  than `GRACE_S` (a stalled server's ttl ends the grant). `keeping(kind, token, tenant,
  deadline)` wraps the reading of a granted reply: a failure gives the grant back, and so does
  a reply that came after `close()` (then `ClosedError`).
- `AsyncOwing.stop()`: closed from now, its timer and flushes cancelled (each owes again what
  it had not sent), for `aclose()` cancelled or failed midway: what is owed is left to
  `close_alone`. `AsyncOwing.close_alone(deadline)`: `close` where the client's connections
  cannot be used, from another event loop than the client's (`loops.py`: that loop's flushes
  and timer are left untouched) or after a `close` that did not end (its flushes, cancelled,
  waited for first): what is owed is sent on connections of the running loop's own (`alone`)
  until `deadline`.
- `settle(granted, tenant, copy)`: a shared-memory load's lease, its copy done: whether the
  lease held its slots until then (`held.py`), its release owed or sent; a copy not proven
  held is zeroed, whatever ends the release (a `LeaseError`, a dead server, a cancel).
- The flusher holds its `Owing` weakly between waits of at most a second: a client dropped
  without `close()` is collected and its thread ends (the server's ttl ends what it owed).
- Sending: a `KVTierError` (a lease already ended, a transport failure) is passed over; the
  server's ttl ends what could not be given back. Thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import torch

from kvtier.client.held import LeaseFrom
from kvtier.client.releases import GIVE_BACK_PATHS, OwedReleases, Request
from kvtier.errors import ClosedError, KVTierError, LeaseError
from kvtier.results import Lease

Post = Callable[[str, dict[str, Any], str], Any]
"""`Client._post`: (path, body, tenant) -> reply body."""
Alone = Callable[[str, dict[str, Any], str, float], Any]
"""A POST on a connection of its own: (path, body, tenant, timeout_s) -> reply body."""

GRACE_S = 0.25
"""The least time a give-back after `close()` has, whatever is left of its call's (module doc)."""


def _grace(deadline: float) -> float:
    """A give-back's `timeout_s` after `close()`: what is left until `deadline`, at least
    `GRACE_S`."""
    return max(deadline - time.monotonic(), GRACE_S)


def _flush_loop(ref: weakref.ref[Owing], wake: threading.Condition, owed: OwedReleases) -> None:
    while True:
        with wake:
            while (wait := owed.next_due_in()) != 0.0:
                live = ref()
                if live is None or live.closed:
                    return
                del live
                wake.wait(1.0 if wait is None else min(wait, 1.0))
        live = ref()
        if live is None or live.closed:
            return
        live.send_releases(owed.take_due())
        live.send_requests(owed.take_requests())
        del live


class Owing:
    def __init__(self, post: Post, alone: Alone) -> None:
        """`post`: the client's own request; `alone`: one on a connection of its own, for a
        give-back after `close()`."""
        self.owed = OwedReleases()
        self.closed = False
        self._post, self._alone = post, alone
        self._wake = threading.Condition()
        self._flusher: threading.Thread | None = None

    def owe(self, lease: Lease, tenant: str) -> None:
        self.owed.add(lease, tenant)
        self.poke()

    def owe_again(self, tenant: str, ids: list[int]) -> None:
        """Ids a failed request carried: owed again, due at once."""
        self.owed.give_back(tenant, ids)
        self.poke()

    def poke(self) -> None:
        """Wake the flusher (started with the first debt)."""
        with self._wake:
            if self._flusher is None and not self.closed:
                self._flusher = threading.Thread(
                    target=_flush_loop,
                    args=(weakref.ref(self), self._wake, self.owed),
                    name="kvtier-client-releases",
                    daemon=True,
                )
                self._flusher.start()
            self._wake.notify()

    def give_back(self, kind: str, token: str, tenant: str, deadline: float) -> None:
        """Owe `token`'s give-back; closed, send it alone by `deadline`, or in `GRACE_S` once
        that is spent (module doc)."""
        with self._wake:
            closed = self.closed
            if not closed:
                self.owed.add_request(kind, token, tenant)
        if not closed:
            self.poke()
            return
        with contextlib.suppress(KVTierError):
            self._alone(GIVE_BACK_PATHS[kind], {"request": token}, tenant, _grace(deadline))

    @contextlib.contextmanager
    def keeping(self, kind: str, token: str, tenant: str, deadline: float) -> Iterator[None]:
        """Around reading a granted reply: a failure gives the grant back; so does a reply that
        came after `close()` (then `ClosedError`); by `deadline` (`give_back`)."""
        try:
            yield
        except BaseException:
            self.give_back(kind, token, tenant, deadline)
            raise
        if self.closed:
            self.give_back(kind, token, tenant, deadline)
            raise ClosedError(f"the client closed while its {kind} was asked: given back")

    def settle(self, granted: LeaseFrom, tenant: str, copy: torch.Tensor) -> bool:
        """A load's lease, its `copy` out of the mapped pool done: whether the lease held its
        slots until now (`held.py`). Surely so by time: its release owed, True. Else released
        now: True once answered, False for a `LeaseError` (it ended first: the copy may be
        another prompt's). Another failure of that release owes it again, and propagates.
        Unless True, `copy` is zeroed first: no byte of a copy not proven held is left in the
        caller's `out` (before, a release cut off by a dead server or a cancel left there
        another tenant's KV, read after the lease ended)."""
        if granted.held_now():
            self.owe(granted.lease, tenant)
            return True
        try:
            self._post("/v1/release", {"lease_id": granted.lease.lease_id}, tenant)
        except LeaseError:
            copy.zero_()
            return False
        except BaseException:
            copy.zero_()
            self.owe(granted.lease, tenant)
            raise
        return True

    def send_releases(self, due: list[tuple[int, str]], deadline: float = math.inf) -> None:
        for lease_id, tenant in due:
            if time.monotonic() >= deadline:
                return  # `close(timeout_s)`: the rest end at the server's ttl
            # a LeaseError: released by a failed request that carried it; a transport error:
            # the server is gone, or will end the lease at its ttl
            with contextlib.suppress(KVTierError):
                self._post("/v1/release", {"lease_id": lease_id}, tenant)

    def send_requests(self, owed: list[Request], deadline: float = math.inf) -> None:
        """Give back, by token, what lost replies may have been granted (the server answers
        `{}` for a token it granted nothing under)."""
        for kind, token, tenant in owed:
            if time.monotonic() >= deadline:
                return
            with contextlib.suppress(KVTierError):
                self._post(GIVE_BACK_PATHS[kind], {"request": token}, tenant)

    def close(self, deadline: float) -> None:
        """Closed from now (a give-back is sent alone); the flusher ended (waited for until
        `deadline`: a send under way ends within its call's bound); what is owed sent until
        `deadline`."""
        with self._wake:
            self.closed = True
            self._wake.notify()
            flusher = self._flusher
        if flusher is not None:
            flusher.join(max(0.0, deadline - time.monotonic()))
        self.send_requests(self.owed.take_requests(), deadline)
        self.send_releases(self.owed.take_due(math.inf), deadline)


AsyncPost = Callable[[str, dict[str, Any], str], Awaitable[Any]]
"""`AsyncClient._post`: (path, body, tenant) -> reply body."""
AsyncAlone = Callable[[str, dict[str, Any], str, float], Awaitable[Any]]
"""`Alone`, as a coroutine."""


class AsyncOwing:
    """`Owing` for an `AsyncClient`: a flush is a task the event loop starts when the oldest
    debt falls due (one timer at a time), not a thread; the rest is `Owing`'s contract."""

    def __init__(self, post: AsyncPost, alone: AsyncAlone) -> None:
        self.owed = OwedReleases()
        self.closed = False
        self._post, self._alone = post, alone
        self._timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()  # running flushes, kept referenced

    def owe(self, lease: Lease, tenant: str) -> None:
        self.owed.add(lease, tenant)
        self.schedule()

    def owe_again(self, tenant: str, ids: list[int]) -> None:
        self.owed.give_back(tenant, ids)
        self.schedule()

    def schedule(self) -> None:
        """A flush when the oldest debt is due (one timer at a time)."""
        wait = self.owed.next_due_in()
        if wait is None or self._timer is not None or self.closed:
            return
        self._timer = asyncio.get_running_loop().call_later(wait, self._start)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _start(self) -> None:
        self._timer = None
        task = asyncio.get_running_loop().create_task(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self, deadline: float = math.inf, everything: bool = False) -> None:
        await self.send_requests(self.owed.take_requests(), deadline)
        due = self.owed.take_due(math.inf if everything else None)
        for i, (lease_id, tenant) in enumerate(due):
            if time.monotonic() >= deadline:
                break
            try:  # as `Owing.send_releases`: a LeaseError or a transport error ends nothing
                with contextlib.suppress(KVTierError, httpx.HTTPError):
                    await self._post("/v1/release", {"lease_id": lease_id}, tenant)
            except BaseException:  # cancelled: the rest, this one included, is owed again
                for again, who in due[i:]:
                    self.owed.give_back(who, [again])
                raise
        self.schedule()  # what was owed meanwhile, or given back

    async def send_requests(self, owed: list[Request], deadline: float = math.inf) -> None:
        """Give back what each of `owed`'s lost replies may have been granted. A task cancelled
        meanwhile owes again the tokens not known to be given back (the one in flight too: a
        give-back of a token the server took already is a no-op), so that the next call or
        `close()` sends them: the caller took them from `owed` (`take_requests`)."""
        for i, (kind, token, tenant) in enumerate(owed):
            if time.monotonic() >= deadline:
                return
            try:
                with contextlib.suppress(KVTierError, httpx.HTTPError):
                    await self._post(GIVE_BACK_PATHS[kind], {"request": token}, tenant)
            except BaseException:
                for again in owed[i:]:
                    self.owed.add_request(*again)
                raise

    async def give_back(self, kind: str, token: str, tenant: str, deadline: float) -> None:
        """`Owing.give_back`."""
        if not self.closed:
            self.owed.add_request(kind, token, tenant)
            self.schedule()
            return
        await self._send_alone(GIVE_BACK_PATHS[kind], {"request": token}, tenant, _grace(deadline))

    async def _send_alone(
        self, path: str, body: dict[str, Any], tenant: str, timeout_s: float
    ) -> None:
        """`body` sent alone within `timeout_s`, or not at all unless it is positive (the
        server's ttl ends what it would have); a failure passed over (`Owing`'s sending)."""
        if timeout_s > 0:
            with contextlib.suppress(KVTierError, httpx.HTTPError):
                await self._alone(path, body, tenant, timeout_s)

    @contextlib.asynccontextmanager
    async def keeping(
        self, kind: str, token: str, tenant: str, deadline: float
    ) -> AsyncIterator[None]:
        """`Owing.keeping`, after `aclose()`."""
        try:
            yield
        except BaseException:
            await self.give_back(kind, token, tenant, deadline)
            raise
        if self.closed:
            await self.give_back(kind, token, tenant, deadline)
            raise ClosedError(f"the client closed while its {kind} was asked: given back")

    async def settle(self, granted: LeaseFrom, tenant: str, copy: torch.Tensor) -> bool:
        """`Owing.settle`."""
        if granted.held_now():
            self.owe(granted.lease, tenant)
            return True
        try:
            await self._post("/v1/release", {"lease_id": granted.lease.lease_id}, tenant)
        except LeaseError:
            copy.zero_()
            return False
        except BaseException:
            copy.zero_()
            self.owe(granted.lease, tenant)
            raise
        return True

    async def close(self, deadline: float) -> None:
        """Closed from now; the flushes under way and then what is owed sent until `deadline`
        (monotonic), no later: a send under way then is cancelled (its debt left to the
        server's ttl)."""
        self.closed = True
        self._cancel()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(loop.time() + deadline - time.monotonic()):
                if self._flushes:
                    await asyncio.gather(*self._flushes, return_exceptions=True)
                await self.flush(deadline, everything=True)
        for task in list(self._flushes):  # past `deadline`: no flush outlives `close`
            task.cancel()
        self._cancel()

    def stop(self) -> None:
        """Closed from now (a give-back is sent alone); the timer and the flushes under way
        cancelled (from the client's event loop): each owes again what it had not sent, left
        to `close_alone`."""
        self.closed = True
        self._cancel()
        for task in list(self._flushes):
            task.cancel()

    async def close_alone(self, deadline: float) -> None:
        """`close` where the client's connections cannot be used: what is owed is given back
        and released on connections of this loop's own (`alone`) until `deadline` (monotonic);
        the rest is left to the server's ttl. The flushes of the running loop (a `close` of it
        cancelled or failed midway) are cancelled and waited for first (each owes again what
        it had not sent); another loop's (the client's, closed or in another thread:
        `loops.py`) are left alone (a closed loop never runs them; a live one's find the
        client closed and send nothing: what they had taken is left to the server's ttl)."""
        self.closed = True
        running = asyncio.get_running_loop()
        if own := [task for task in self._flushes if task.get_loop() is running]:
            for task in own:
                task.cancel()
            await asyncio.gather(*own, return_exceptions=True)
        for kind, token, tenant in self.owed.take_requests():
            left = deadline - time.monotonic()
            await self._send_alone(GIVE_BACK_PATHS[kind], {"request": token}, tenant, left)
        for lease_id, tenant in self.owed.take_due(math.inf):
            left = deadline - time.monotonic()
            await self._send_alone("/v1/release", {"lease_id": lease_id}, tenant, left)
