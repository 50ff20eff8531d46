"""`Calls`: the calls of a client under way that take or owe a lease or a reservation (load,
store, prefetch, reserve), so that `close()` waits for them before it releases what is owed
and closes the connections.

Why: such a call can come to owe a release after `close()` sent the last ones. A shared-memory
load owes its lease once its copy is done, and a prefetch or reserve that carried owed ids gives
them back when it fails (`releases.py`): closed, nothing sent them, and each lease stayed held
to the server's ttl (a client that 8 threads were loading through left 3-5 leases at each
close). A load still copying when `close()` unmapped the pools also failed untyped.

Contract:
- `call()` (a context manager) admits a call, or raises `ClosedError` once `close` has begun,
  before anything is sent. A call made inside an admitted one (a load's prefetch, a store's
  reserve) is part of it, and admitted (per thread, and per asyncio task: a ContextVar).
- `close(timeout_s)` (threads) / `aclose(timeout_s)` (the event loop): admit no more, then wait
  until none is under way, or `timeout_s` passed (what still runs then ends as before, its
  lease to the server's ttl); whether none was left. Thread-safe.
- A client is its maker process's: its connections, lane and owed releases are shared with a
  forked child, whose requests and replies would cross the parent's on the same sockets (a
  child's load answered with the parent's prompt's KV). `check_process()` raises `ClosedError`
  in any other process; `call()`, `close` and `aclose` check it first, and the clients check
  it at every request (`arguments.KeyTenant.due`, a GET, a wait on a lease), before a socket
  is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
import time
from collections.abc import Iterator

from kvtier.errors import ClosedError
from kvtier.home import generation

POLL_S = 0.005
"""How often `aclose` looks whether the calls under way have ended."""


class Calls:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._closing = False
        self._pid, self._generation = os.getpid(), generation()  # the maker's (module doc)

    def check_process(self) -> None:
        """`ClosedError` unless this is the process that made the client (module doc)."""
        if generation() != self._generation:  # a fork since: no system call per check
            raise ClosedError(
                f"this client was made in process {self._pid}, and process {os.getpid()} (a "
                "fork) cannot use its connections: no request is sent; make one client per process"
            )

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        self.check_process()
        inside = _INSIDE.get()
        if self in inside:
            yield  # part of a call already admitted
            return
        with self._cond:
            if self._closing:
                raise ClosedError("the client is closed: no request is sent")
            self._running += 1
        token = _INSIDE.set((*inside, self))
        try:
            yield
        finally:
            _INSIDE.reset(token)
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def close(self, timeout_s: float) -> bool:
        self.check_process()
        own = self._own()
        with self._cond:
            self._closing = True
            return self._cond.wait_for(lambda: self._running <= own, timeout_s)

    async def aclose(self, timeout_s: float) -> bool:
        self.check_process()
        own, deadline = self._own(), time.monotonic() + timeout_s
        with self._cond:
            self._closing = True
        while True:
            with self._cond:
                if self._running <= own:
                    return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)

    def _own(self) -> int:
        """1 when closed from inside one of its own calls (it waits for the others only)."""
        return 1 if self in _INSIDE.get() else 0


_INSIDE: contextvars.ContextVar[tuple[Calls, ...]] = contextvars.ContextVar(
    "kvtier_client_calls", default=()
)
"""The clients whose admitted call the current thread or task is in."""
