"""The slots of a client's lane (`client/lane.py`): at most `MOST_CALLS` of its calls on the
lane at once, and the calls past them in line for a slot, first come first served.

Contract (`Slots`, used under `LaneConnections`' lock or on `AsyncLaneConnections`' one loop):
- `queue(deadline)` puts a call at the end of the line; `take(turn, short)` gives it a slot
  where one is free and it is at the head (True), counting it busy until `give(short)`.
- `wait_left(turn, short)`: how long it may wait still: never for a call of `WAITING` (the
  server may hold those for seconds), nor while such calls hold every slot (none frees soon);
  else until `SLOT_WAIT_S` after it came, within its call's deadline. Past it the call takes
  HTTP, unsent.
- `leave(turn)` (a slot taken, or given up) and `give` tell the head of the line (its `wake`),
  so a freed slot goes to the call that waited longest, and a head that gave up passes its
  turn on; `wake_all` tells every call in line (the lane retired, the client closed).
- `wait_turn` / `wait_turn_async`: a call's wait, which also ends where `gone()` says the lane
  is dead or the client closed (before, such calls waited out their bound), and which a task's
  cancel always ends (`asyncio.wait_for` on Python 3.11 returned a result that came with the
  cancel, and the call went on).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial

MOST_CALLS = 64
"""A client's calls on the lane at once (so its connections): a quarter of the server's bound
(`service/lane.py`, 256), which four such clients may share; one more waits for a slot
(`SLOT_WAIT_S`), or takes HTTP."""
SLOT_WAIT_S = 1.0
"""The longest a short call past `MOST_CALLS` waits for a slot of the lane before it takes HTTP
(within its `timeout_s`). Before, it took HTTP at once: a burst of 500 lookups of one
`AsyncClient` spent 0.8-1.0 s, most of them over HTTP, where waiting for the lane's slots takes
some 0.05 s."""
WAITING = frozenset(("/v1/prefetch", "/v1/leases"))
"""Calls the server may hold for seconds (a prefetch's or a lease's wait): one of them never
waits for a slot, and a short call does not wait while these hold every slot (none would free
soon): it takes HTTP at once."""


class Turn:
    """A call's place in the line for a slot: `until` (monotonic) the end of its wait, `wake`
    how to tell it the head of the line may go (set while it waits)."""

    __slots__ = ("until", "wake")

    def __init__(self, until: float) -> None:
        self.until = until
        self.wake: Callable[[], object] = _nothing


def _nothing() -> None:
    return None


class Slots:
    """A client's slots of the lane (`MOST_CALLS`) and the calls in line for one, served in
    their order of arrival (module doc). Not safe from several threads by itself:
    `LaneConnections` holds its lock around each use, `AsyncLaneConnections` runs on one loop."""

    def __init__(self) -> None:
        self.busy = 0  # calls on the lane now
        self.short = 0  # those of them not of `WAITING` (each frees its slot soon)
        self.line: deque[Turn] = deque()

    def queue(self, deadline: float) -> Turn:
        """A new call's turn, at the end of the line, its wait bounded by `SLOT_WAIT_S` and its
        call's `deadline` (monotonic)."""
        turn = Turn(min(time.monotonic() + SLOT_WAIT_S, deadline))
        self.line.append(turn)
        return turn

    def take(self, turn: Turn, short: bool) -> bool:
        """A slot for `turn`, where one is free and no call came before it (True: taken)."""
        if self.busy >= MOST_CALLS or self.line[0] is not turn:
            return False
        self.busy += 1
        self.short += short
        return True

    def wait_left(self, turn: Turn, short: bool) -> float:
        """How long `turn` may still wait for a slot: 0 for a call of `WAITING`, or where calls
        of `WAITING` hold every slot (none would free soon), or past its bound."""
        if not short or (self.busy >= MOST_CALLS and not self.short):
            return 0.0
        return turn.until - time.monotonic()

    def leave(self, turn: Turn) -> None:
        """`turn` out of the line (a slot taken, or HTTP): the next in line is told."""
        if self.line and self.line[0] is turn:
            self.line.popleft()
        else:
            self.line.remove(turn)
        self.wake_head()

    def give(self, short: bool) -> None:
        """A slot back: the head of the line is told."""
        self.busy -= 1
        self.short -= short
        self.wake_head()

    def wake_head(self) -> None:
        if self.line:
            self.line[0].wake()

    def wake_all(self) -> None:
        for turn in self.line:
            turn.wake()


def wait_turn(
    slots: Slots, turn: Turn, short: bool, lock: threading.Lock, gone: Callable[[], bool]
) -> bool:
    """Wait, `lock` held (it guards `slots`), until `turn` takes a slot (True), or it may wait
    no longer, or `gone()` (False: the call takes HTTP)."""
    while not slots.take(turn, short):
        left = slots.wait_left(turn, short)
        if left <= 0 or gone():
            return False
        woken = threading.Condition(lock)
        turn.wake = woken.notify
        woken.wait(left)
    return True


async def wait_turn_async(slots: Slots, turn: Turn, short: bool, gone: Callable[[], bool]) -> bool:
    """`wait_turn` on the running loop (a cancel raises `CancelledError` whenever it comes)."""
    loop = asyncio.get_running_loop()
    while not slots.take(turn, short):
        left = slots.wait_left(turn, short)
        if left <= 0 or gone():
            return False
        woken: asyncio.Future[None] = loop.create_future()
        turn.wake = partial(wake_future, woken)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await woken
    return True


def wake_future(woken: asyncio.Future[None]) -> None:
    """A `Turn.wake` for a call waiting on `woken` (an `AsyncLaneConnections` call)."""
    if not woken.done():
        woken.set_result(None)
