"""`GpuPool`: the `gpu` tier, a `SlotPool` in device memory.

Contract:
- `GpuPool.create(layout, capacity_bytes, device)` resolves the configured device once:
  `"auto"` is `cuda:0` when CUDA is available and `cpu` otherwise; `"cpu"`, `"cuda"` (meaning
  `cuda:0`) and `"cuda:N"` are taken as written. A CUDA device that this machine lacks, or any
  other device type, is a `ConfigError` on `tiers.gpu.device`, raised before any memory is taken.
- On a machine without CUDA the `gpu` tier is an ordinary CPU tensor pool (DESIGN.md), so every
  code path above it runs and is tested everywhere.
- The pool's name is always `"gpu"`; capacity rounds down to whole blocks (`with_capacity`).
"""

from __future__ import annotations

import torch

from kvtier.blocks import KVLayout
from kvtier.errors import ConfigError
from kvtier.tiers.pool import SlotPool

_FIELD = "tiers.gpu.device"
_EXPECTED = "'auto', 'cpu', 'cuda' or 'cuda:N'"


def resolve_device(value: str) -> torch.device:
    """The device that a configured `tiers.gpu.device` names on this machine, or `ConfigError`."""
    if value == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConfigError(_FIELD, value, _EXPECTED) from exc
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ConfigError(_FIELD, value, _EXPECTED)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(_FIELD, value, "'auto' or 'cpu' on a machine without CUDA")
    index = 0 if device.index is None else device.index
    if index >= count:
        raise ConfigError(_FIELD, value, f"a CUDA device index below {count}")
    return torch.device("cuda", index)


class GpuPool(SlotPool):
    """The `gpu` tier: slots in CUDA memory, or in CPU memory on a machine without CUDA."""

    @classmethod
    def create(
        cls,
        layout: KVLayout,
        capacity_bytes: int,
        device: str = "auto",
        shared_name: str | None = None,
    ) -> GpuPool:
        """A `gpu` pool of `capacity_bytes // layout.block_bytes` slots on the resolved device;
        `shared_name` places a CPU pool in shared memory (ignored for a CUDA pool, which a
        sidecar exports with a CUDA IPC handle instead)."""
        resolved = resolve_device(device)
        shared = shared_name if resolved.type == "cpu" else None
        return cls.with_capacity("gpu", layout, capacity_bytes, resolved, False, shared)
