"""Free-memory probes, for capacities configured as a fraction of what is free.

Contract:
- `free_device_bytes(device)` is the memory free on `device` now, in bytes: for CUDA the driver's
  free figure (`torch.cuda.mem_get_info`); for the CPU, which is where the `gpu` tier lives on a
  machine without CUDA, `available_host_bytes()`. Other device types are a `ConfigError`.
- `available_host_bytes()` is the kernel's estimate of memory available without swapping:
  `MemAvailable` from `/proc/meminfo` where it exists, else the free physical pages from
  `os.sysconf`. Neither looks at cgroup limits.
- Both return a non-negative `int` and change nothing; each call reads the figures anew.
"""

from __future__ import annotations

import os

import torch

from kvtier.errors import ConfigError

MEMINFO_PATH = "/proc/meminfo"


def free_device_bytes(device: torch.device | str) -> int:
    """Bytes free on `device` now (see the module docstring for what counts as free)."""
    resolved = torch.device(device)
    if resolved.type == "cpu":
        return available_host_bytes()
    if resolved.type != "cuda":
        raise ConfigError("device", str(device), "a 'cpu' or 'cuda' device")
    free, _total = torch.cuda.mem_get_info(resolved)
    return int(free)


def available_host_bytes() -> int:
    """Bytes of host memory available without swapping: MemAvailable, else free pages."""
    try:
        with open(MEMINFO_PATH, encoding="ascii") as meminfo:
            available = parse_mem_available(meminfo.read())
    except OSError:
        available = None
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_mem_available(meminfo: str) -> int | None:
    """`MemAvailable` in bytes from the text of `/proc/meminfo`, or None if the line is absent."""
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        if key == "MemAvailable":
            amount, _, unit = rest.strip().partition(" ")
            if unit != "kB":  # proc(5) documents kB; anything else we do not guess at
                return None
            return int(amount) * 1024
    return None
