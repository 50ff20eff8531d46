"""`EventLoopOf`: the event loop an `AsyncClient` belongs to, and whether it is closed.

An `AsyncClient`'s connections (httpx's pool, the lane's streams) and the timer of its owed
releases are bound to the event loop they were made in. Used from another loop (a second
`asyncio.run`, a loop in another thread), a call wrote its request on the first loop's
transport, or failed on it with a raw `RuntimeError('Event loop is closed')`, and `aclose()`
raised the same and left the client open.

Contract:
- `check()` first refuses a call of a forked child, as `Calls.check_process` does (the more
  telling error).
- The client belongs to the loop of its first call (`check()` takes it). A call from any other
  loop is a `ClosedError` that names the misuse, raised before anything is sent (no
  connection of the first loop touched, nothing owed given up); make one client per loop.
- Once `close()` is called, every `check()` is a `ClosedError`: the client is closed, whatever
  its parts (httpx's client, the lane) say.
- `own()`: whether the running loop is the client's (or none is yet); `ended()`: whether the
  client's loop is closed or gone (a call of it still under way will never end).
"""

from __future__ import annotations

import asyncio
import weakref

from kvtier.client.calls import Calls
from kvtier.errors import ClosedError


class EventLoopOf:
    """The event loop of a client's first call (module doc)."""

    def __init__(self, calls: Calls) -> None:
        """`calls`: the client's, whose process is checked first."""
        self._calls = calls
        self._loop: weakref.ref[asyncio.AbstractEventLoop] | None = None
        self.closed = False

    def check(self) -> None:
        """`ClosedError` for a closed client, or a call from another loop than the client's
        (module doc), or in a forked child; the first call's loop taken as the client's."""
        self._calls.check_process()
        if self.closed:
            raise ClosedError("the client is closed: no request is sent")
        running = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = weakref.ref(running)
            return
        if self._loop() is not running:
            raise ClosedError(
                "this AsyncClient belongs to the event loop of its first call "
                f"({self._describe()}), and a call from another event loop cannot use its "
                "connections: no request is sent; make one AsyncClient per event loop "
                "(per asyncio.run)"
            )

    def own(self) -> bool:
        """Whether the running loop is the client's, or the client has none yet."""
        return self._loop is None or self._loop() is asyncio.get_running_loop()

    def ended(self) -> bool:
        """Whether the client's loop is closed or collected (False before its first call)."""
        if self._loop is None:
            return False
        loop = self._loop()
        return loop is None or loop.is_closed()

    def close(self) -> None:
        """Closed: every `check()` from now is a `ClosedError`."""
        self.closed = True

    def _describe(self) -> str:
        loop = None if self._loop is None else self._loop()
        if loop is None:
            return "gone"
        return f"{type(loop).__name__} at {id(loop):#x}, {'closed' if loop.is_closed() else 'open'}"
