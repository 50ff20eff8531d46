"""What the data plane's requests may hold in memory at once (`service.max_inflight_bytes`).

A request's body is held while it is read and while the store works on it; a load's reply (its
KV, gathered from the tiers) is held until it is sent. Each is bounded by `max_body_bytes`, but
nothing bounded how many there were: six concurrent loads of a 128 MiB
prefix raised `kvtier serve`'s peak RSS by 770 MiB, so a tenant with a cached prefix and a few
hundred connections could take the machine from everyone. Every body and reply is charged here
first:

    hold = budget.hold(tenant, own)         nothing held yet; `own`: its refusals name only
                                            the tenant's figures (a tenant key's call)
    await hold.take(nbytes, deadline)       waits for room; `WireError` 503 busy past deadline
    hold.shrink(nbytes)                     gives back what the call turned out not to need
    hold.release()                          all of it (idempotent): after the reply is sent

Invariants (`check()`):
- the bytes held by all holds are at most `total`, and a tenant's at most `share`:
  `max(total // tenants, max_body_bytes)`, so with two or more tenants one tenant's calls leave
  the others at least `total - share` (and the largest body, or a load's reply of
  `max_body_bytes`, always fits an idle budget: `total` is at least that, by the config). A
  call holds at most `largest()` in all: a load's reply beside its body must fit in what is
  left of it (`Hold.room`), and a take past it is 413, never a wait that cannot end;
- a call waits without a thread and without its body (`take` comes before the read), up to its
  deadline (`service.body_timeout_s`), then is refused 503 `busy`: it held nothing, read nothing,
  stored nothing.
- when room frees, waiters that fit now are granted in the order they came; one that does not
  fit (its tenant at its share, or too large for what is free) does not hold back those after
  it, so a tenant under its share is not kept waiting behind one at its share.
- fair under contention: while a call of one tenant waits for room within its fair part
  (`fair`: `total // tenants`, its tenant's bytes and its own together), no other tenant is
  granted a new call's bytes past its own fair part; such calls wait too (a call that holds
  bytes already, a load's reply after its body, is not held back: it would only time out). So
  a call within its fair part is granted once the calls granted before it (and the replies of
  loads under way, `more`, each within its tenant's share) give back what they hold, however
  many calls the others keep sending (before, with a `share` above `fair` (a
  `max_body_bytes` above `total // tenants`: five tenants and more on the defaults), tenants
  that kept the budget full with small calls kept another tenant's call waiting until its
  deadline, 503 `busy`, however long it tried). Where `share` is `fair` (the default for up to
  four tenants) no tenant can pass its fair part, and nothing waits for it.
- a refusal tells a tenant (`own`: with auth on, a tenant key's call) only its own held bytes
  and its share, as /v1/status does: never what the other tenants hold, nor the total held.
  The global figures are for the admin key and for a server without auth.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from contextvars import ContextVar
from typing import NamedTuple

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvtier.service.wire import WireError

HOLD: ContextVar[Hold | None] = ContextVar("kvtier_hold", default=None)
"""The hold of the HTTP call being answered (`app.call` sets it): a handler that learns what
it will hold only from the body (a load's reply) takes it there."""


class Budget:
    """Bytes held by requests in flight, in total and per tenant (module doc). Used from the
    event loop only."""

    def __init__(self, total: int, share: int, fair: int | None = None) -> None:
        """`total` bytes for all, at most `share` a tenant, and `fair` (default: `share`) a
        tenant's part that others' waiting calls cannot hold back (module doc)."""
        self.total, self.share = total, share
        self.fair = share if fair is None else min(fair, share)
        self.held = 0
        self.by_tenant: dict[str, int] = {}
        self.waits = self.refused = 0  # calls that waited for room; refused 503 busy
        self._waiting: list[_Waiter] = []
        # fairness (`fair` < `share`): each tenant's waiting calls smallest first (a granted or
        # cancelled one is popped when met), and the tenants with a fair waiter, kept exact
        self._smallest: dict[str, list[tuple[int, int, _Waiter]]] = {}
        self._fair_set: set[str] = set()
        self._arrivals = 0

    def hold(self, tenant: str, own: bool = False) -> Hold:
        """A hold of `tenant`'s; `own`: its refusals name only `tenant`'s figures."""
        return Hold(self, tenant, own)

    def fits(self, tenant: str, nbytes: int) -> bool:
        """Whether `nbytes` more of `tenant`'s stay within the total and its share."""
        mine = self.by_tenant.get(tenant, 0)
        return self.held + nbytes <= self.total and mine + nbytes <= self.share

    def _may_take(self, tenant: str, nbytes: int, more: bool, fair_waiters: set[str]) -> bool:
        """Whether a call of `tenant` (`more`: holding bytes already) is granted `nbytes` now:
        they fit, and they do not take it past its fair part while a tenant of `fair_waiters`
        (`_fair_set`, kept by `_recheck`) other than itself waits (module doc)."""
        if not self.fits(tenant, nbytes):
            return False
        past_fair = self.by_tenant.get(tenant, 0) + nbytes > self.fair
        return more or not past_fair or not fair_waiters - {tenant}

    def _recheck(self, tenant: str) -> None:
        """Whether `tenant` has a fair waiter now: its smallest live waiting call fits within
        its fair part. O(log n) amortized (a call no longer waiting is popped once)."""
        heap = self._smallest.get(tenant)
        while heap and heap[0][2].future.done():
            heapq.heappop(heap)
        if heap and self.by_tenant.get(tenant, 0) + heap[0][0] <= self.fair:
            self._fair_set.add(tenant)
        else:
            self._fair_set.discard(tenant)
            if heap is not None and not heap:
                del self._smallest[tenant]

    def largest(self) -> int:
        """The most one call can ever hold (its bound when the budget is idle)."""
        return min(self.total, self.share)

    async def _take(
        self, tenant: str, nbytes: int, deadline: float, own: bool, more: bool = False
    ) -> None:
        """Hold `nbytes` of `tenant`'s once they fit, waiting up to `deadline` (module doc);
        `more`: the call holds bytes already (never held back for fairness)."""
        if nbytes > self.largest():
            raise WireError(
                413, "body_too_large",
                f"the call needs {nbytes} bytes in flight, more than one call may hold "
                f"({self.largest()}: service.max_inflight_bytes and the tenants' shares)",
            )  # fmt: skip
        if self._may_take(tenant, nbytes, more, self._fair_set):
            held_back = tenant in self._fair_set
            self._grant(tenant, nbytes)
            if held_back and tenant not in self._fair_set:
                self._wake()  # its waiting call passed its fair part: the others may go
            return
        self.waits += 1
        entry = _Waiter(tenant, nbytes, asyncio.get_running_loop().create_future(), more)
        self._waiting.append(entry)
        if self.fair < self.share:
            self._arrivals += 1
            heapq.heappush(self._smallest.setdefault(tenant, []), (nbytes, self._arrivals, entry))
            self._recheck(tenant)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await entry.future
        except BaseException as exc:  # the deadline, or the caller cancelled (hung up)
            if entry.future.done() and not entry.future.cancelled():
                self._give(tenant, nbytes)  # granted as the deadline fell: not taken
            elif entry in self._waiting:
                self._waiting.remove(entry)
                if tenant in self._fair_set:
                    self._recheck(tenant)  # (its future is done: popped when met)
                    if tenant not in self._fair_set:
                        self._wake()  # its last fair waiter gone: calls held back may go
            if not isinstance(exc, TimeoutError):
                raise
            self.refused += 1
            raise WireError(503, "busy", self._busy(tenant, nbytes, own)) from None

    def _busy(self, tenant: str, nbytes: int, own: bool) -> str:
        """A 503 busy's detail: `tenant`'s own figures only when `own` (module doc)."""
        mine = self.by_tenant.get(tenant, 0)
        said = f"{nbytes} bytes in flight did not fit within service.body_timeout_s: "
        if own:
            return said + f"this tenant holds {mine} of its share of {self.share} bytes"
        return said + (
            f"{self.held} of {self.total} held (service.max_inflight_bytes), "
            f"{mine} of {self.share} by this tenant"
        )

    def _grant(self, tenant: str, nbytes: int) -> None:
        self.held += nbytes
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + nbytes
        if tenant in self._fair_set:
            self._recheck(tenant)

    def _give(self, tenant: str, nbytes: int) -> None:
        if not nbytes:
            return
        self.held -= nbytes
        left = self.by_tenant[tenant] - nbytes
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]
        if tenant in self._smallest:
            self._recheck(tenant)
        self._wake()

    def _wake(self) -> None:
        """Grant the waiters that fit now, in the order they came, a pass over them at a time.
        Within a pass the tenants with a fair waiter only leave (a grant adds to its tenant's
        bytes): one that left no longer holds back those passed over, so another pass follows,
        at most one per such tenant (one pass where `fair` is `share`). Linear in the waiters:
        a full budget with 10,000 calls queued, one grant at a time, was seconds of the event
        loop's time."""
        while True:
            before = len(self._fair_set)
            left: list[_Waiter] = []
            for entry in self._waiting:
                waiter, wanted, future, more = entry
                if not future.done() and self._may_take(waiter, wanted, more, self._fair_set):
                    future.set_result(None)  # (done first: `_recheck` pops it)
                    self._grant(waiter, wanted)
                else:  # (done: cancelled, on its way out)
                    left.append(entry)
            self._waiting = left
            if len(self._fair_set) == before:
                return

    def figures(self, tenant: str | None) -> dict[str, int]:
        """`/v1/status`'s `inflight`: global (None), or `tenant`'s own held bytes and share."""
        if tenant is not None:
            return {"held_bytes": self.by_tenant.get(tenant, 0), "limit_bytes": self.share}
        return {"held_bytes": self.held, "limit_bytes": self.total, "share_bytes": self.share,
                "waits": self.waits, "busy": self.refused}  # fmt: skip

    def check(self) -> None:
        assert 0 <= self.held <= self.total, (self.held, self.total)
        assert self.held == sum(self.by_tenant.values()), (self.held, self.by_tenant)
        assert all(0 < n <= self.share for n in self.by_tenant.values()), self.by_tenant
        for tenant, nbytes, future, _ in self._waiting:  # a cancelled one is on its way out
            assert future.cancelled() or not future.done(), (tenant, nbytes)
            assert nbytes <= self.largest(), (tenant, nbytes)
            if self.fair < self.share and not future.done():  # none missing (a cancelled
                fair = self.by_tenant.get(tenant, 0) + nbytes <= self.fair  # one may linger)
                assert not fair or tenant in self._fair_set, (tenant, nbytes, self._fair_set)


class _Waiter(NamedTuple):
    """A call waiting for room: its tenant, its bytes, the future granted them, and whether
    the call holds bytes already (`more`: not held back for fairness)."""

    tenant: str
    nbytes: int
    future: asyncio.Future[None]
    more: bool


class Hold:
    """One call's bytes in the budget; `release` gives them all back (idempotent)."""

    def __init__(self, budget: Budget, tenant: str, own: bool = False) -> None:
        self.budget, self.tenant, self.own, self.nbytes = budget, tenant, own, 0

    async def take(self, nbytes: int, deadline: float) -> None:
        """Hold `nbytes` more (module doc). A call holds at most `largest()` in all: past it
        (a load's reply of `max_body_bytes` beside its body, where a tenant's share is
        `max_body_bytes`: four tenants and more on the defaults) it could never be granted,
        and waited out its deadline on an idle server to be refused 503 `busy`, which a
        client retries; now 413 at once, naming the bound (`room` is what still fits)."""
        if self.nbytes and self.nbytes + nbytes > self.budget.largest():
            raise WireError(
                413, "body_too_large",
                f"the call needs {nbytes} bytes in flight beside the {self.nbytes} it holds, "
                f"more than one call may hold ({self.budget.largest()}: "
                "service.max_inflight_bytes and the tenants' shares)",
            )  # fmt: skip
        await self.budget._take(self.tenant, nbytes, deadline, self.own, self.nbytes > 0)
        self.nbytes += nbytes

    def room(self) -> int:
        """The most this call may still take: what one call may hold, less what it holds (a
        load's reply beside its body: `plane.load` asks no more)."""
        return max(0, self.budget.largest() - self.nbytes)

    def free_now(self) -> int:
        """What this call could take now without a wait: within its tenant's share and the
        total, beside what every call holds (review R2: concurrent loads of one tenant each
        sized their reply to `room`, held their bodies, and waited on each other into 503)."""
        budget = self.budget
        mine = budget.by_tenant.get(self.tenant, 0)
        return max(0, min(self.room(), budget.share - mine, budget.total - budget.held))

    def shrink(self, nbytes: int) -> None:
        """Hold `nbytes` in all from now (no more than held)."""
        give = max(0, self.nbytes - max(0, nbytes))
        self.nbytes -= give
        self.budget._give(self.tenant, give)

    def release(self) -> None:
        self.shrink(0)


class HeldResponse(Response):
    """A reply made of `parts` (a load's KV is one, where the store gathered it: no copy),
    sent in `CHUNK`s, each once the connection took the last (the server's flow control), its
    call's hold shrinking as each part is sent and dropped, all of it given back at the end or
    when the client is gone. Sent as one piece, a reply would sit in the connection's buffer
    after the call returned, outside the budget. A client that takes no chunk for `timeout_s`
    is cut off (`protocol.py`'s `kvtier.abort`): a reader that stopped holds neither the budget
    nor the connection for longer."""

    def __init__(
        self, hold: Hold, parts: list[bytes | memoryview], media_type: str, timeout_s: float
    ) -> None:
        size = sum(len(part) for part in parts)
        super().__init__(b"", media_type=media_type, headers={"content-length": str(size)})
        self.hold, self.parts, self.size, self.timeout_s = hold, parts, size, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            left = self.size
            if not left:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            for i in range(len(self.parts)):
                view = memoryview(self.parts[i])
                for at in range(0, len(view), CHUNK):
                    chunk = bytes(view[at : at + CHUNK])
                    more = left - at - len(chunk) > 0  # the last piece ends the reply
                    async with asyncio.timeout(self.timeout_s):
                        await send({"type": "http.response.body", "body": chunk, "more_body": more})
                left -= len(view)
                view.release()
                self.parts[i] = b""  # freed here, its last reference
                self.hold.shrink(left)
        except TimeoutError:
            abort = scope.get("extensions", {}).get("kvtier.abort")
            if abort is None:  # another protocol: its own error and close
                raise
            abort()
            await asyncio.sleep(0)  # the connection is lost (so the server logs nothing)
        finally:
            self.parts = []
            self.hold.release()


CHUNK = 1 << 20
