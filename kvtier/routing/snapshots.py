"""`Asker`: a publisher's snapshot (`Subscriber.add(snapshot=...)`, e.g. a sidecar's
`GET /v1/blocks`) asked from a thread of its own, and waited for a set time at most.

The subscriber's one thread hears every publisher: a snapshot that hangs (a sidecar stopped,
a server that takes the connection and never answers) held it for the client's whole timeout
(120 s by default), and every other pod's messages waited behind it (past the SUB's queue,
they were lost). Now the thread waits `timeout_s` at most; the call runs on, and until it ends
the publisher is not asked again (no thread piles up behind a hung one). An answer that came
late is thrown away, never taken at a later ask: by then the subscriber has applied newer
messages, and a state older than them would score blocks the pod has removed since (or, from a
restarted pod's past life, swallow its new life's first messages); once the late call has
ended, the next ask makes a new call. An answer is checked as the client checks one
(`replies.blocks`), whatever gave it. The caller rations the asks (`allowance.Ration`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvtier.service import replies

Snapshot = Callable[[], dict[str, Any]]  # {block_size, topics: [{topic, seq, events}]}


class _Call:
    """One call of a snapshot, on a daemon thread (a hung one must not keep the process up)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.done = threading.Event()
        self.answer: dict[str, Any] | None = None
        self._snapshot = snapshot
        threading.Thread(target=self._run, name="kvtier-snapshot", daemon=True).start()

    def _run(self) -> None:
        try:
            self.answer = replies.blocks(self._snapshot())
        except Exception:  # a server down, a reply of another shape: no snapshot this time
            self.answer = None
        self.done.set()


class Asker:
    """Asks `snapshot` (module doc); used from one thread."""

    def __init__(self, snapshot: Snapshot, timeout_s: float) -> None:
        self.snapshot, self.timeout_s = snapshot, timeout_s
        self._call: _Call | None = None

    def ask(self) -> dict[str, Any] | None:
        """A new call's checked answer within `timeout_s`; None when it failed or did not
        answer in time, and while the last call that did not still runs (not asked again)."""
        if self._call is not None and not self._call.done.is_set():
            return None
        call = self._call = _Call(self.snapshot)
        return call.answer if call.done.wait(self.timeout_s) else None
