"""The `tiers` section: where blocks live, fastest first (DESIGN.md, "Configuration").

Contract:
- gpu and host always exist, with defaults; disk exists only when configured, and then its
  `capacity` is required.
- A memory tier's capacity is a size or a fraction of free memory, resolved by the tier that
  owns it (`Capacity.resolve`), never here; the disk tier's is a size.
- `0 < low_watermark <= high_watermark <= 1` on gpu and host: demotion starts above the high
  one and stops at the low one.
- That a capacity in bytes holds at least one block depends on the model, so the root
  (`root.py`) checks it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, get_args

from pydantic import model_validator

from kvtier.config.fields import (
    DiskCapacity,
    Fraction01,
    InvalidValue,
    MemoryCapacity,
    Name,
    Section,
    one_of,
    rule,
)
from kvtier.sizes import Capacity

Compression = Literal["none", "lz4"]
FsyncMode = Literal["batch", "none"]
Pinned = Literal["auto", True, False]

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class _MemoryTierConfig(Section):
    """A tier in memory: demotion starts above `high_watermark` and stops at `low_watermark`."""

    capacity: MemoryCapacity
    high_watermark: Fraction01
    low_watermark: Fraction01

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> _MemoryTierConfig:
        if self.low_watermark > self.high_watermark:
            expected = f"at most high_watermark ({self.high_watermark}): 0 < low <= high <= 1"
            raise InvalidValue(self.low_watermark, expected, key="low_watermark")
        return self


class GpuTierConfig(_MemoryTierConfig):
    """The fastest tier. A fraction capacity is of the device's free memory."""

    capacity: MemoryCapacity = Capacity(nbytes=256 * 2**20)
    high_watermark: Fraction01 = 0.95
    low_watermark: Fraction01 = 0.85
    device: Annotated[
        str,
        rule(
            lambda v: isinstance(v, str) and bool(_DEVICE.fullmatch(v)),
            "one of auto, cpu, cuda, cuda:N",
        ),
    ] = "auto"


class HostTierConfig(_MemoryTierConfig):
    """Host RAM. A fraction capacity is of MemAvailable; `pinned: auto` pins when CUDA is up."""

    capacity: MemoryCapacity = Capacity(nbytes=2**30)
    high_watermark: Fraction01 = 0.95  # with a disk tier: write LRU leaves down above this
    low_watermark: Fraction01 = 0.85
    pinned: Annotated[Pinned, one_of(get_args(Pinned))] = "auto"


class DiskTierConfig(Section):
    """Files under `path`; validated here, built by the disk tier."""

    capacity: DiskCapacity
    path: Name = "./kvtier-data"
    compression: Annotated[Compression, one_of(get_args(Compression))] = "none"
    fsync: Annotated[FsyncMode, one_of(get_args(FsyncMode))] = "batch"


class TiersConfig(Section):
    """gpu and host always exist; disk only when configured."""

    gpu: GpuTierConfig = GpuTierConfig()
    host: HostTierConfig = HostTierConfig()
    disk: DiskTierConfig | None = None
