"""The `policy` and `mover` sections: when blocks are copied between tiers, by whom, and how
long the holds on them (leases, reservations) may last.

Contract:
- `policy` is DESIGN.md's "Movement policy" plus the limits on holds: `max_ttl_s >=
  lease_ttl_s`, so that the default ttl is always one a caller may ask for.
- `mover` says whether copies run behind the caller and how they spread over threads and
  layer groups; `background: false` is deterministic.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, get_args

from pydantic import model_validator

from kvtier.config.fields import InvalidValue, Section, int_in, number_in, one_of, rule

WriteMode = Literal["write_through", "write_back", "selective"]


class PolicyConfig(Section):
    """When blocks are copied down (DESIGN.md, "Movement policy") and how long leases live."""

    write: Annotated[WriteMode, one_of(get_args(WriteMode))] = "write_through"
    selective_hits: Annotated[int, int_in(1)] = 2
    disk_admission_hits: Annotated[int, int_in(0)] = 1
    lease_ttl_s: Annotated[float, number_in(0.0, math.inf, "a finite number > 0")] = 60.0
    # an expired reservation's slots stay allocated this long, so that a late writer writes
    # into slots nobody reads (`tenancy.py`); a few lease TTLs
    reservation_quarantine_s: Annotated[float, number_in(0.0, 86400.0, "seconds in (0, 86400]")] = (
        300.0
    )
    # the longest `ttl_s` a prefetch or a reservation may ask for: no one pins a tier for long
    max_ttl_s: Annotated[float, number_in(0.0, 86400.0, "seconds in (0, 86400]")] = 600.0

    @model_validator(mode="after")
    def _default_ttl_allowed(self) -> PolicyConfig:
        if self.max_ttl_s < self.lease_ttl_s:
            expected = f"at least lease_ttl_s ({self.lease_ttl_s}): the default ttl must be allowed"
            raise InvalidValue(self.max_ttl_s, expected, key="max_ttl_s")
        return self


class MoverConfig(Section):
    """How blocks move between tiers (`transfer/mover.py`).

    `background: true` copies on worker threads (CUDA streams for a CUDA gpu tier): prefetches
    return pending leases, watermark demotion and disk writes run behind the caller, and
    `store()` does not wait on a disk that keeps up. `false` runs every copy in the calling
    thread, which is deterministic (tests, replay).

    `store_wait_s`: with a background mover and a disk tier, how long one `store()` may wait
    (without the cache's lock, before it changes anything) while host holds more unwritten
    blocks than its high watermark and the mover is writing them down; past it the store goes
    ahead and what host cannot keep is dropped (`backpressure_drops`); with a background mover,
    also while gpu has room for the store's gpu-bound new blocks only once its demotion flights
    land (`Mover._landing`). 0 never waits. The
    default, 0.1 s, lets a producer that outruns the disk be slowed to the disk's pace (the
    writes of one host watermark's worth of blocks) instead of losing most of what it stores,
    and bounds what a store can add to an engine's step."""

    background: Annotated[bool, one_of((True, False))] = True
    workers_per_path: Annotated[int, int_in(1, 64)] = 1
    layer_groups: Annotated[int, int_in(1, 1024)] = 4
    lift_on_lookup: Annotated[bool, one_of((True, False))] = False
    store_wait_s: Annotated[
        float,
        rule(lambda v: type(v) in (int, float) and 0 <= v <= 60, "seconds in [0, 60]"),
    ] = 0.1
