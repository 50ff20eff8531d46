"""Audit AM: leases on prefixes whose copies are in flight (`transfer/flights.py`,
`transfer/leasing.py`), through a real store whose copies run only when the test steps them.

- A lease that ends (cancelled, released, expired) at the moment a layer-group copy tells it
  of progress: the callback used to read the lease's flights as the lease book emptied them,
  `min()` of nothing raised out of the callback before it counted its copy off, and the flight
  was never published: its pin locked the prefix in every tier and its gpu slots stayed taken
  for good (`drain` never returned True; `close` waited its 30 s). The lease book now forgets
  a lease under the flight's lock, which a callback holds while it tells leases of progress,
  and a callback counts its copy off whatever happens.
- A pending lease ended by `release` (the sidecar's `/v1/release`, which a client's `cancel`
  sends) is CANCELLED and now counted in `mover.leases_cancelled` as `cancel` counts it (the
  counter stayed 0 for every cancel through the sidecar).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from conftest import build_store, hit, kv_for

from kvtier import results
from kvtier.errors import LeaseError
from kvtier.results import LeaseState
from kvtier.store import KVStore
from kvtier.transfer.stepped import SteppedExecutor

Made = list[tuple[KVStore, SteppedExecutor]]


@pytest.fixture
def made() -> Iterator[Made]:
    stores: Made = []
    yield stores
    for store, executor in stores:
        closer = threading.Thread(target=store.close)  # close waits for the queued copies
        closer.start()
        while closer.is_alive():
            executor.run_all()
            closer.join(0.001)


def hosted(made: Made, n_tokens: int) -> tuple[KVStore, SteppedExecutor, list[int]]:
    """A stepped store (two layer groups) holding tokens 0..n_tokens-1 on host only."""
    plain = build_store(gpu_blocks=8, host_blocks=16, layer_groups=2)
    plain.close()  # its config, for a store of the same shape whose copies wait for steps
    executor = SteppedExecutor()
    store = KVStore(plain.config, executor=executor)
    made.append((store, executor))
    tokens = list(range(n_tokens))
    store.store(tokens, kv_for(store, n_tokens))
    assert store.evict("gpu", n_tokens // 4) == n_tokens // 4
    assert store.lookup(tokens) == hit(host=n_tokens)
    return store, executor, tokens


def _line_of(function: Any, text: str) -> int:
    """The line number of the first line of `function`'s source that contains `text`."""
    code = function.__code__
    lines = Path(code.co_filename).read_text().splitlines()
    return next(n for n in range(code.co_firstlineno, len(lines) + 1) if text in lines[n - 1])


def test_a_lease_ending_as_a_copy_tells_it_of_progress_leaves_no_flight_behind(
    made: Made,
) -> None:
    store, executor, tokens = hosted(made, 16)
    lease = store.prefetch(tokens, wait=False)
    assert not lease.ready() and executor.queued() == 2
    progress = results.LeaseOwner.progress.__code__
    at = _line_of(results.LeaseOwner.progress, "min(")
    cancellers: list[threading.Thread] = []

    def on_line(frame: FrameType, event: str, arg: object) -> Any:
        if event == "line" and frame.f_lineno == at and not cancellers:
            # another thread ends the lease here, between the check for flights and the
            # min() over them; it may wait for this callback (0.3 s at most here)
            canceller = threading.Thread(target=store.cancel, args=(lease,))
            cancellers.append(canceller)
            canceller.start()
            canceller.join(0.3)
        return on_line

    def on_call(frame: FrameType, event: str, arg: object) -> Any:
        return on_line if frame.f_code is progress else None

    sys.settrace(on_call)
    try:
        ran = executor.step()  # layer group 0 lands and tells the lease
    finally:
        sys.settrace(None)
    assert ran == 1 and cancellers, "the copy never told the lease of progress"
    cancellers[0].join(5)
    assert lease.state is LeaseState.CANCELLED
    executor.run_all()
    assert store.drain(2), "a flight was never published"
    status = store.status()
    assert status["mover"]["in_flight"] == 0
    assert store.lookup(tokens) == hit(gpu=16)  # the copies landed, unleased
    assert status["tiers"]["gpu"]["leased_blocks"] == 0
    assert store.evict("gpu", 4) == 4  # nothing pins them any more
    store.check()


def test_releasing_a_pending_lease_counts_it_cancelled(made: Made) -> None:
    store, executor, tokens = hosted(made, 16)
    pending = store.prefetch(tokens, wait=False)
    store.release(pending)  # what a client's cancel sends: /v1/release
    assert pending.state is LeaseState.CANCELLED
    with pytest.raises(LeaseError, match="cancelled"):
        pending.wait(0)
    other = store.prefetch(tokens[:8], wait=False)
    other.cancel()
    assert store.status()["mover"]["leases_cancelled"] == 2
    executor.run_all()
    assert store.drain(2)
    ready = store.prefetch(tokens)
    store.release(ready)  # a ready lease is released, not cancelled
    assert ready.state is LeaseState.RELEASED
    assert store.status()["mover"]["leases_cancelled"] == 2
    store.check()
