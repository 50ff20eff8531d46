"""The files of a disk tier: the superblock and the slab files, sized and preallocated.

    <path>/kvtier-disk.json      geometry: slot size, header region, slots per slab, layout
    <path>/slab-00000.kvt        slots 0 .. S-1            (S = slots per slab, ~1 GiB a slab)
    <path>/slab-00001.kvt        slots S .. 2S-1           the last slab may be shorter

The superblock pins the geometry: a directory written with another one refuses to open rather
than be misread. Slabs are `posix_fallocate`d when they are opened, so capacity is bytes
allocated on disk, and a filesystem without room shows up at start (fewer slots, `enospc`)
rather than as a failed write later. Slots per slab depend on the geometry alone, so a change
of capacity moves no slot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.disk.io import SlabFile

SUPERBLOCK = "kvtier-disk.json"
SLAB_TARGET_BYTES = 1 << 30
"""Slabs are about 1 GiB: few enough files to sync per batch, small enough to create fast."""


def check_superblock(path: Path, geometry: dict[str, Any]) -> None:
    """Write the superblock of a new directory; refuse a directory of another geometry."""
    superblock = path / SUPERBLOCK
    if superblock.exists():
        have = json.loads(superblock.read_text())
        if have != geometry:
            raise ConfigError(
                "tiers.disk.path",
                str(path),
                f"a directory of this layout and geometry ({geometry}), found {have}; "
                "use another path or delete this one",
            )
        return
    tmp = superblock.with_suffix(".tmp")
    tmp.write_text(json.dumps(geometry))
    os.replace(tmp, superblock)


def open_slabs(
    path: Path,
    total_slots: int,
    slot_bytes: int,
    slots_per_slab: int,
    direct: bool,
    faults: dict[str, int],
) -> list[SlabFile]:
    """Open (or create and preallocate) the slabs for `total_slots` slots: full slabs of
    `slots_per_slab`, the last one shorter. Where the filesystem runs out of space, a new slab
    is halved until it fits and an existing short one is kept as it is; no slab follows it
    (each refusal counted in `faults["enospc"]`). Existing slabs are never deleted for lack of
    space; slabs beyond the capacity (it shrank since the last start) are."""
    found: list[SlabFile] = []
    remaining = total_slots
    while remaining > 0:
        want = min(slots_per_slab, remaining)
        slab_path = path / f"slab-{len(found):05d}.kvt"
        if slab_path.exists():
            slots = _open_existing(slab_path, want, slot_bytes, faults)
        else:
            slots = _create(slab_path, want, slot_bytes, direct, faults)
        if slots == 0:
            break
        slab = SlabFile(slab_path, slots * slot_bytes, direct=direct, create=False)
        slab.size = slots * slot_bytes  # a longer file (capacity shrank) is cut here
        found.append(slab)
        remaining -= slots
        if slots < want:
            break
    for stale in sorted(path.glob("slab-*.kvt"))[len(found) :]:
        stale.unlink()
    return found


def _open_existing(path: Path, want: int, slot_bytes: int, faults: dict[str, int]) -> int:
    """Slots of an existing slab: `want`, or what it holds when it cannot grow to that."""
    have = path.stat().st_size // slot_bytes
    if have >= want:
        return want
    try:
        _reallocate(path, want * slot_bytes)  # truncated, or capacity grew
        return want
    except OSError:
        faults["enospc"] += 1
        return have


def _create(path: Path, want: int, slot_bytes: int, direct: bool, faults: dict[str, int]) -> int:
    """Create a slab of `want` slots, halving it while the filesystem refuses; its slots."""
    slots = want
    while slots > 0:
        try:
            SlabFile(path, slots * slot_bytes, direct=direct, create=True).close()
            return slots
        except OSError:
            faults["enospc"] += 1
            path.unlink(missing_ok=True)
            slots //= 2
    return 0


def _reallocate(path: Path, size: int) -> None:
    """Give a slab file that was cut short its `size` bytes again, allocated (`du` counts them,
    and a write to a slot past the cut neither fails nor lands outside the file)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
