"""`HostPool`: the `host` tier, a `SlotPool` in CPU memory, pinned when CUDA is present.

Contract:
- `HostPool.create(layout, capacity_bytes, pinned)` resolves `tiers.host.pinned` once: `"auto"`
  pins when CUDA is available (so host<->device copies can run asynchronously on their own
  streams), `False` never pins, `True` pins and is a `ConfigError` on a machine without CUDA.
  Anything else is a `ConfigError`. Nothing is allocated when the value is refused.
- The buffer is always on the CPU; the pool's name is always `"host"`.
- With `shared_name` the buffer lives in POSIX shared memory (`SlotPool`), so that a sidecar's
  client maps it (DESIGN.md, engine contract); the slot bookkeeping does not change.
- `NoHostPool` stands in for the host tier of a store configured without one (`tiers.host:
  null`): a pool of no slots, so that every room check for host says no and nothing is ever
  copied there, while the tier indices stay (gpu 0, host 1: `tiers/base.py`). Status, metrics
  and the sidecar's pools leave it out (`CacheState.present`).
"""

from __future__ import annotations

import torch

from kvtier.blocks import KVLayout
from kvtier.errors import ConfigError
from kvtier.tiers.pool import SlotPool

_FIELD = "tiers.host.pinned"


def resolve_pinned(value: str | bool) -> bool:
    """Whether a configured `tiers.host.pinned` pins memory on this machine, or `ConfigError`."""
    cuda = torch.cuda.is_available()
    if value == "auto":
        return cuda
    if value is False:
        return False
    if value is True:
        if not cuda:
            raise ConfigError(_FIELD, value, "'auto' or false on a machine without CUDA")
        return True
    raise ConfigError(_FIELD, value, "'auto', true or false")


class HostPool(SlotPool):
    """The `host` tier: slots in (optionally pinned) CPU memory."""

    @classmethod
    def create(
        cls,
        layout: KVLayout,
        capacity_bytes: int,
        pinned: str | bool = "auto",
        shared_name: str | None = None,
    ) -> HostPool:
        """A `host` pool of `capacity_bytes // layout.block_bytes` slots in CPU memory (in
        POSIX shared memory under `shared_name`, when given)."""
        pin = resolve_pinned(pinned)
        return cls.with_capacity(
            "host", layout, capacity_bytes, torch.device("cpu"), pin, shared_name
        )


class NoHostPool(HostPool):
    """The host tier of a store without one (module doc): no slots, no memory."""

    MIN_SLOTS = 0

    @classmethod
    def absent(cls, layout: KVLayout) -> NoHostPool:
        return cls("host", layout, 0, torch.device("cpu"))

    def _allocate_buffer(self) -> torch.Tensor:
        return torch.empty((0, *self.slot_shape), dtype=self.slot_dtype)
