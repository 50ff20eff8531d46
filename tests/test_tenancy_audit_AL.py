"""Audit AL (tenancy, keys and admission): what requests hold in memory at once is shared fairly
between tenants under contention (`kvtier/service/budget.py`, `service/admission.py`).

A tenant may hold up to its share of `service.max_inflight_bytes`, `max(total // tenants,
max_body_bytes)`, so that its largest call fits. With five tenants and more on the defaults
(4 GiB, 1 GiB bodies) that share is above the tenant's fair part `total // tenants`, and tenants
that kept the budget full with small calls took each byte given back before another tenant's
waiting call could gather the room it needed: that call waited to its deadline and was refused
503 `busy`, however often it tried. Now, while a call waits for room within its fair part, no
other tenant is granted a new call's bytes past its own fair part.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.config import parse_config
from kvtier.service.admission import Service
from kvtier.service.budget import Budget, Hold
from kvtier.service.wire import WireError
from kvtier.store import KVStore

KIB = 1 << 10


def _service(tenants: int, max_body: int, inflight: int) -> Service:
    """The sidecar's state for a config of `tenants` tenants (no store is built)."""
    config = parse_config(
        {
            "model": {"name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
                      "dtype": "float16"},
            "block_tokens": 4,
            "tiers": {"gpu": {"capacity": 64 * 4096, "device": "cpu"}},
            "service": {"max_body_bytes": max_body, "max_inflight_bytes": inflight},
            "tenants": {f"t{i}": {} for i in range(tenants)},
        }
    )  # fmt: skip

    def no_store() -> KVStore:
        raise AssertionError("no store in these tests")

    return Service(config, no_store)


async def _churn(holds: list[Hold], waiting: asyncio.Future[None], piece: int) -> int:
    """Give back and take again `piece` bytes of each of `holds` in turn (a tenant whose small
    calls keep coming) until `waiting` is done; how many takes were refused busy."""
    refused, i = 0, 0
    stop = time.monotonic() + 2.5
    while not waiting.done() and time.monotonic() < stop:
        hold = holds[i % len(holds)]
        hold.release()
        try:
            await hold.take(piece, time.monotonic() + 0.02)
        except WireError as exc:
            assert (exc.status, exc.kind) == (503, "busy")
            refused += 1
        await asyncio.sleep(0.001)
        i += 1
    return refused


def test_a_call_within_its_fair_part_gets_room_from_tenants_past_theirs() -> None:
    """Five tenants, 100 KiB in flight, bodies up to 60 KiB: shares of 60 KiB, fair parts of
    20 KiB. t0 holds its 60 KiB in twelve calls of 5 KiB and t1 40 KiB: the budget is full.
    t2's call of 10 KiB waits; t0 keeps giving back 5 KiB and taking it again. Before, t0 took
    every piece back (t2 never saw 10 KiB free) and t2 was refused 503 busy at its deadline;
    now t0, past its fair part, waits while t2 does, and t2 gets its room."""
    service = _service(5, 60 * KIB, 100 * KIB)
    budget = service.budget
    assert (budget.total, budget.share) == (100 * KIB, 60 * KIB)  # fair parts: 20 KiB

    async def scenario() -> None:
        t0 = [budget.hold("t0") for _ in range(12)]
        for hold in t0:
            await hold.take(5 * KIB, time.monotonic() + 1)
        t1 = budget.hold("t1")
        await t1.take(40 * KIB, time.monotonic() + 1)
        assert budget.held == budget.total
        t2 = budget.hold("t2")
        waiting = asyncio.ensure_future(t2.take(10 * KIB, time.monotonic() + 2.0))
        await asyncio.sleep(0)
        refused = await _churn(t0, waiting, 5 * KIB)
        await waiting  # granted, not refused busy
        assert budget.by_tenant["t2"] == 10 * KIB and refused >= 1
        assert budget.by_tenant["t0"] <= 50 * KIB  # it gave back what t2 needed
        budget.check()
        for hold in (*t0, t1, t2):
            hold.release()
        assert budget.held == 0 and not budget._waiting
        budget.check()

    asyncio.run(scenario())


def test_a_tenant_within_its_fair_part_is_not_held_back() -> None:
    """The rule holds back only calls past their tenant's fair part: while t2's fair call waits
    (15 do not fit the 10 free), t3's call of 10, within its fair part, is granted at once, and
    t0's, past its own, waits; t2 goes first when room frees, then t0."""
    budget = Budget(total=100, share=60, fair=20)

    async def scenario() -> None:
        t0, t1 = budget.hold("t0"), budget.hold("t1")
        await t0.take(50, time.monotonic() + 1)
        await t1.take(40, time.monotonic() + 1)
        t2 = budget.hold("t2")
        waiting = asyncio.ensure_future(t2.take(15, time.monotonic() + 5))
        await asyncio.sleep(0)
        t3 = budget.hold("t3")
        await t3.take(5, time.monotonic() + 1)  # within its fair part: not held back
        more = budget.hold("t0")
        held_back = asyncio.ensure_future(more.take(5, time.monotonic() + 5))
        await asyncio.sleep(0.01)
        assert not waiting.done() and not held_back.done() and budget.held == 95
        t1.shrink(20)  # 25 free: t2's 15 first, then t0's 5 (t2 no longer waits)
        await asyncio.wait_for(asyncio.gather(waiting, held_back), 1)
        assert budget.by_tenant == {"t0": 55, "t1": 20, "t2": 15, "t3": 5}
        for hold in (t0, t1, t2, t3, more):
            hold.release()
        assert budget.held == 0 and not budget._waiting
        budget.check()

    asyncio.run(scenario())


def test_calls_held_back_go_once_the_fair_waiter_leaves() -> None:
    """t0 (past its fair part) waits behind t2's fair call; t2's call reaches its deadline and
    leaves: t0's call is granted then, not left waiting for a give-back that may never come.
    A call that holds bytes already (a load's reply after its body) is never held back."""
    budget = Budget(total=100, share=60, fair=20)

    async def scenario() -> None:
        t0, t1 = budget.hold("t0"), budget.hold("t1")
        await t0.take(30, time.monotonic() + 1)
        await t1.take(60, time.monotonic() + 1)
        t2 = budget.hold("t2")
        fair = asyncio.ensure_future(t2.take(20, time.monotonic() + 0.5))  # 10 free: waits
        await asyncio.sleep(0)
        more = budget.hold("t0")
        held_back = asyncio.ensure_future(more.take(5, time.monotonic() + 5))
        await asyncio.sleep(0.02)
        assert not held_back.done()  # t0 past its fair part while t2 waits within its own
        await t0.take(5, time.monotonic() + 1)  # t0's own call holds bytes: not held back
        with pytest.raises(WireError):
            await fair
        await asyncio.wait_for(held_back, 2)
        assert budget.by_tenant == {"t0": 40, "t1": 60} and not budget._waiting
        for hold in (t0, t1, more):
            hold.release()
        budget.check()

    asyncio.run(scenario())


@pytest.mark.parametrize("fair", [None, 3 * 10_000], ids=["fair is share", "fair below share"])
def test_a_grant_with_ten_thousand_calls_queued_is_one_pass(fair: int | None) -> None:
    """A full budget with 10,000 small calls of x queued (with fairness on, held back behind
    z's call waiting within its fair part): queueing them costs no scan of the waiters each,
    and a release grants them in one pass (z's first). Before (review 2 of the change), each
    grant started the scan again and each call past its fair part scanned every waiter:
    seconds of the event loop's time, every tenant's calls stalled meanwhile."""
    n = 10_000

    async def scenario() -> tuple[float, float]:
        budget = Budget(10 * n, 6 * n, fair)
        big, other = budget.hold("x"), budget.hold("y")
        await big.take(4 * n, time.monotonic() + 5)
        await other.take(6 * n - 1, time.monotonic() + 5)  # the budget full, but 1 byte
        z = asyncio.ensure_future(budget.hold("z").take(2, time.monotonic() + 60))
        await asyncio.sleep(0)  # z waits: 2 bytes do not fit the 1 free
        started = time.perf_counter()
        calls = [asyncio.ensure_future(budget.hold("x").take(1, time.monotonic() + 60))
                 for _ in range(n)]  # fmt: skip
        await asyncio.sleep(0)
        queued = time.perf_counter() - started
        # z and x's calls wait; x's first took the 1 byte free, but where fairness held it back
        assert budget.figures(None)["waits"] == n + (0 if fair is None else 1)
        budget.check()
        started = time.perf_counter()
        big.release()
        other.release()
        released = time.perf_counter() - started
        await asyncio.gather(z, *calls)
        assert budget.held == n + 2 and budget.figures(None)["busy"] == 0
        budget.check()
        return queued, released

    queued, released = asyncio.run(scenario())
    assert queued < 2.0 and released < 0.5, (queued, released)


def test_calls_past_fair_parts_between_fair_ones_and_cancelled_cost_no_scan_each() -> None:
    """20,000 calls of A (at its share) and C (within its fair part) in turn, then all
    cancelled (their clients hung up): each arrival, and each fair waiter's leaving, keeps the
    set of tenants with a fair waiter up to date without a scan of the waiters (review 4: a fair
    arrival dropped the set, and the next call of A scanned them all: 9 s for 20,000)."""

    async def scenario() -> tuple[float, float]:
        budget, deadline = Budget(10_000_000, 6_000_000, 2_000_000), time.monotonic() + 600
        await budget.hold("A").take(6_000_000, deadline)
        await budget.hold("B").take(4_000_000, deadline)
        started = time.perf_counter()
        calls = [asyncio.ensure_future(budget.hold("AC"[i % 2]).take(100, deadline))
                 for i in range(20_000)]  # fmt: skip
        await asyncio.sleep(0)
        queued, started = time.perf_counter() - started, time.perf_counter()
        budget.check()
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        budget.check()
        return queued, time.perf_counter() - started

    queued, cancelled = asyncio.run(scenario())
    assert queued < 2.0 and cancelled < 2.0, (queued, cancelled)
