"""The files of a disk tier: the superblock and the slab files, sized and preallocated.

    <path>/kvtier-disk.json      geometry: slot size, header region, slots per slab, layout
    <path>/slab-00000.kvt        slots 0 .. S-1            (S = slots per slab, ~1 GiB a slab)
    <path>/slab-00001.kvt        slots S .. 2S-1           the last slab may be shorter

The superblock pins the geometry: a directory written with another one refuses to open rather
than be misread. Its bytes are untrusted like any on disk: it is read without following a link,
at most `SUPERBLOCK_MAX_BYTES`, and must be a JSON object of exactly the geometry's keys with
values of their types and ranges; anything else is a `DamagedDiskError` naming the file and
what is wrong. It is written whole (`private_files.write_atomically`: a fresh 0600 temporary
file, never a planted one, synced and renamed over it). A slab path that is not a regular file
(a link, a directory) is a `DamagedDiskError` too, never followed or written through, and so is
an existing slab the tier cannot open read-write (a read-only copy restored from a backup) or
that has another name (a hard link: writing it would write the other file too, `own_slab`).
Slabs and an existing superblock are made 0600 on their descriptor (a restored 0644 copy let
any local user read every tenant's KV). A slab (stale ones too) or superblock another user
owns is a `DamagedDiskError` naming its owner, never read, written or deleted: it stops the
start (and `kvtier check`) rather than being retired (it may hold KV of its owner's choosing; a
slab of this store's chowned by mistake is chowned back, not lost). Checked by `lstat` before
an open that follows no link: the directory is this user's and 0700 (`lock.py`) by then.

A slab is a file named exactly `slab_path` gives (`slab-00000.kvt`, five digits or more, as
`f"{n:05d}"` writes them); any other name in the directory, however like one (`slab-00000
(copy).kvt`, `slab-1.kvt`), is not a slab: it is never read, written, counted or deleted
(`slab_files`). Sorting names instead put such a copy before the slab it copied, so that the
stale-slab sweep deleted the real one.

Slabs are `posix_fallocate`d when they are opened, so capacity is bytes allocated on disk, and
a filesystem without room shows up at start rather than as a failed write later. Before anything
is allocated, `check_room` refuses a capacity whose new slabs would leave the filesystem less
than its reserve (`reserve_bytes`: 5 % of it, at most 1 GiB), so a big capacity never fills a
disk that other processes share; should the room go between the check and the allocation
(another process writing), the slabs that no longer fit are cut short (fewer slots, `enospc`).
Slots per slab depend on the geometry alone, so a change of capacity moves no slot.

A capacity that shrank frees the disk before the tier serves: a longer slab is cut (`ftruncate`,
`fsync`), the slabs past the last deleted (the directory synced). Copies past the capacity were
kept, unseen by a `clear` or `reset`, and came back stale when the capacity grew. A crash before
the cut is durable leaves only copies no store served since (nothing cleared).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.blocks import DTYPES, KVLayout
from kvtier.errors import ConfigError
from kvtier.private_files import file_kind, make_private, read_regular, write_atomically
from kvtier.quant import QuantSpec
from kvtier.tiers.disk.geometry import LATER_RULES, differences, quant_disagreement
from kvtier.tiers.disk.io import ALIGN, SlabFile

SUPERBLOCK = "kvtier-disk.json"
SUPERBLOCK_MAX_BYTES = 4096
SLAB_TARGET_BYTES = 1 << 30
"""Slabs are about 1 GiB: few enough files to sync per batch, small enough to create fast."""


class DamagedDiskError(ConfigError):
    """A disk tier directory whose superblock or slab files are not what the tier wrote: the
    message names the file and what is wrong. Nothing in the directory was changed."""


def _is_int(low: int, high: int, step: int = 1) -> Callable[[object], bool]:
    return lambda v: type(v) is int and low <= v <= high and v % step == 0


GEOMETRY_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "format": (lambda v: type(v) is int and v == 1, "1"),
    "slot_bytes": (_is_int(2 * ALIGN, 1 << 36, ALIGN), f"a multiple of {ALIGN} up to 2**36"),
    "header_region": (_is_int(ALIGN, 1 << 36, ALIGN), f"a multiple of {ALIGN} up to 2**36"),
    "slots_per_slab": (_is_int(1, 1 << 32), "an integer in [1, 2**32]"),
    "layout": (
        lambda v: isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v),
        "32 lowercase hex digits",
    ),
    "itemsize": (lambda v: v in (1, 2, 4, 8) and type(v) is int, "1, 2, 4 or 8"),
}
OPTIONAL_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "quant": (
        lambda v: quant_layout(v) is not None,
        "the codec id, block_shape and dtype of a quantized tier",
    ),
    **LATER_RULES,
}
"""Keys a superblock has only sometimes: `quant`, a quantized tier's `{codec, block_shape,
dtype}` (`kvtier check` decodes its copies by it), and the later keys (`geometry.py`)."""


def quant_layout(value: object) -> KVLayout | None:
    """The layout (shape and dtype only) a superblock's `quant` entry names, or None if it is
    not one a tier writes."""
    if not isinstance(value, dict) or set(value) != {"codec", "block_shape", "dtype"}:
        return None
    shape, dtype, codec = value["block_shape"], value["dtype"], value["codec"]
    if not (isinstance(codec, str) and QuantSpec.from_id(codec) is not None):
        return None
    if not (isinstance(shape, list) and len(shape) == 5 and shape[1] == 2):
        return None
    if not all(type(n) is int and 1 <= n <= 1 << 20 for n in shape):
        return None
    if not (isinstance(dtype, str) and dtype in DTYPES):  # a list or an object is not hashable
        return None
    layers, _, tokens, heads, dim = shape
    try:
        return KVLayout("kvtier-check", layers, heads, dim, dtype, tokens)
    except ConfigError:
        return None


def read_superblock(path: Path, field: str) -> dict[str, Any] | None:
    """The validated geometry in `path`'s superblock; None when there is none."""
    superblock = path / SUPERBLOCK
    if not os.path.lexists(superblock):
        return None
    _check_owner(superblock, os.lstat(superblock), field)
    try:
        text = read_regular(superblock, field, SUPERBLOCK_MAX_BYTES)
    except ConfigError as exc:
        raise DamagedDiskError(field, str(superblock), exc.expected) from None
    try:
        geometry = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DamagedDiskError(field, str(superblock), _expected(f"not JSON: {exc}")) from None
    if (
        not isinstance(geometry, dict)
        or set(GEOMETRY_RULES) - set(geometry)
        or set(geometry) - (set(GEOMETRY_RULES) | set(OPTIONAL_RULES))
    ):
        found = f"keys {sorted(map(str, geometry))}" if isinstance(geometry, dict) else "no object"
        raise DamagedDiskError(field, str(superblock), _expected(f"found {found}"))
    for key, (ok, expected) in (GEOMETRY_RULES | OPTIONAL_RULES).items():
        if key in geometry and not ok(geometry[key]):
            shown = repr(geometry[key])
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            problem = f"{key} is {shown}, expected {expected}"
            raise DamagedDiskError(field, str(superblock), _expected(problem))
    wrong = quant_disagreement(geometry)  # `kvtier check` decodes by `quant`
    if geometry["header_region"] >= geometry["slot_bytes"]:
        wrong = "header_region is not less than slot_bytes"
    if wrong is not None:
        raise DamagedDiskError(field, str(superblock), _expected(wrong))
    return geometry


def _expected(problem: str) -> str:
    problem = problem if len(problem) <= 200 else problem[:197] + "..."
    return (
        f"a superblock: a JSON object of {', '.join(GEOMETRY_RULES)} as this tier writes it "
        f"({problem}); restore it, or move the directory away to start empty"
    )


def check_superblock(path: Path, geometry: dict[str, Any]) -> bool:
    """Write the superblock of a new directory; refuse a directory of another geometry, or
    one whose superblock is damaged (`DamagedDiskError`). Whether the directory was new: it
    had neither a superblock nor any slab file (nor a link named like one) before."""
    have = read_superblock(path, "tiers.disk.path")
    if have is None:
        new = not slab_files(path)
        write_atomically(path / SUPERBLOCK, json.dumps(geometry).encode())
        return new
    if changed := differences(have, geometry):
        raise ConfigError(
            "tiers.disk.path",
            str(path),
            f"a directory of this layout and geometry; its superblock differs in "
            f"{'; '.join(changed)}; use another path or delete this one",
        )
    try:
        make_private(path / SUPERBLOCK, "tiers.disk.path")
    except ConfigError as exc:
        raise DamagedDiskError(exc.field, exc.value, exc.expected) from None
    return False


_SLAB_NAME = re.compile(r"slab-([0-9]{5,})\.kvt")


def slab_path(path: Path, number: int) -> Path:
    """The file of slab `number` in the tier directory `path`."""
    return path / f"slab-{number:05d}.kvt"


def slab_files(path: Path) -> dict[int, Path]:
    """The slabs in `path` by number, links and other non-files among them (each caller
    refuses those): only names exactly as `slab_path` gives them (the module doc)."""
    found: dict[int, Path] = {}
    for candidate in path.glob("slab-*.kvt"):
        match = _SLAB_NAME.fullmatch(candidate.name)
        if match is not None and candidate == slab_path(path, int(match[1])):
            found[int(match[1])] = candidate
    return dict(sorted(found.items()))


RESERVE_SHARE = 0.05
RESERVE_MAX = 1 << 30


def reserve_bytes(filesystem_bytes: int) -> int:
    """What a disk tier leaves free on a filesystem of `filesystem_bytes`."""
    return min(RESERVE_MAX, int(filesystem_bytes * RESERVE_SHARE))


def free_bytes(path: Path) -> tuple[int, int]:
    """(bytes an unprivileged process may still allocate, the filesystem's size) at `path`."""
    found = os.statvfs(path)
    return found.f_bavail * found.f_frsize, found.f_blocks * found.f_frsize


def check_room(path: Path, capacity_bytes: int, field: str) -> None:
    """Refuse (`ConfigError` naming `field`, the free bytes and the capacity asked) a capacity
    whose slabs, beyond those already allocated in `path`, would leave the filesystem under its
    reserve."""
    held = 0
    for slab in slab_files(path).values():
        if regular_file(slab, "tiers.disk.path"):
            held += os.stat(slab, follow_symlinks=False).st_blocks * 512
    free, size = free_bytes(path)
    spare = free - reserve_bytes(size)
    if capacity_bytes - held > max(0, spare):  # asking no more than it holds: never refused
        raise ConfigError(
            field,
            capacity_bytes,
            f"at most {max(0, spare + held)} bytes: the filesystem of {path} has {free} bytes "
            f"free, {held} more are this tier's already, and {reserve_bytes(size)} stay free "
            "for other processes",
        )


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
    (each refusal counted in `faults["enospc"]`). A slab longer than its slots is cut to
    them, durably (`_opened`). Slabs past the last one opened are deleted, durably:
    those beyond the capacity (it shrank since the last start), and, where an earlier slab was
    short (truncated) and could not grow back for lack of space, the slabs after it, whose
    copies are lost with them (slots are numbered slab by slab, so none may follow a hole;
    their space goes to the short one next time). An existing slab it cannot open read-write
    (or another user's, `regular_file`) is a `DamagedDiskError` (those opened before are closed)."""
    found: list[SlabFile] = []
    remaining = total_slots
    try:
        while remaining > 0:
            want = min(slots_per_slab, remaining)
            slots = _open_slab(slab_path(path, len(found)), want, slot_bytes, direct, faults)
            if slots == 0:
                break
            found.append(_opened(slab_path(path, len(found)), slots * slot_bytes, direct))
            remaining -= slots
            if slots < want:
                break
        stale = [n for n in slab_files(path) if n >= len(found)]
        for number in reversed(stale):  # the last first: a crash leaves no hole
            doomed = slab_path(path, number)
            if doomed.is_symlink() or regular_file(doomed, "tiers.disk.path"):
                doomed.unlink()
        if stale:
            sync_directory(path)  # gone for good before the tier serves (see `_opened`)
    except BaseException:
        for slab in found:
            slab.close()
        raise
    return found


def _open_slab(path: Path, want: int, slot_bytes: int, direct: bool, faults: dict[str, int]) -> int:
    """The slots slab `path` holds once opened or created: `want`, or fewer (out of space)."""
    if own_slab(path, "tiers.disk.path"):
        return _open_existing(path, want, slot_bytes, faults)
    return _create(path, want, slot_bytes, direct, faults)


def _opened(path: Path, size: int, direct: bool) -> SlabFile:
    """Slab `path` opened read-write as `size` bytes; `DamagedDiskError` when it cannot be
    opened (a read-only copy). A longer file (the capacity shrank, or bytes were appended) is
    cut to `size`, durably, before the tier serves: copies past the capacity were invisible to
    a `clear` or `reset`, and came back as stale KV once the capacity grew again."""
    try:
        slab = SlabFile(path, size, direct=direct, create=False)
    except OSError as exc:
        raise _unopenable(path, exc) from None
    try:
        if slab.size != size:
            slab.cut(size)
    except BaseException as exc:
        slab.close()
        if not isinstance(exc, OSError):
            raise
        expected = f"a slab file it can cut to {size} bytes and sync ({exc.strerror})"
        raise DamagedDiskError("tiers.disk.path", str(path), expected) from None
    return slab


def sync_directory(path: Path) -> None:
    """Make the entries of directory `path` durable (`fsync` on it): an unlink survives a crash."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        expected = f"a directory it can sync ({exc.strerror})"
        raise DamagedDiskError("tiers.disk.path", str(path), expected) from None


def _unopenable(path: Path, exc: OSError) -> DamagedDiskError:
    expected = f"a slab file it can open read-write ({exc.strerror})"
    return DamagedDiskError("tiers.disk.path", str(path), expected)


def own_slab(path: Path, field: str) -> bool:
    """`regular_file`, and a file of one name: a slab hard-linked elsewhere (a backup made or
    restored with `cp -al`) is a `DamagedDiskError`, since every write to it would change the
    file behind its other name too."""
    if not regular_file(path, field):
        return False
    links = os.lstat(path).st_nlink
    if links != 1:
        expected = f"a slab file of one link, found {links} (copy it rather than link it)"
        raise DamagedDiskError(field, str(path), expected)
    return True


def regular_file(path: Path, field: str) -> bool:
    """Whether `path` exists; `DamagedDiskError` when it is anything but a regular file (a
    link is never followed) this process's user owns (the module)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode):
        found = file_kind(info.st_mode)
        raise DamagedDiskError(field, str(path), f"a regular slab file, found {found}")
    _check_owner(path, info, field)
    return True


def _check_owner(path: Path, info: os.stat_result, field: str) -> None:
    if info.st_uid != os.geteuid():  # never read, written or deleted (the module)
        uid = os.geteuid()
        expected = f"a file owned by this process's user, uid {uid} (chown it if this store "
        expected += "wrote it, else delete it)"
        raise DamagedDiskError(field, f"{path} (owner uid {info.st_uid})", expected)


def _open_existing(path: Path, want: int, slot_bytes: int, faults: dict[str, int]) -> int:
    """Slots of an existing slab: `want`, or what it holds when it cannot grow to that. One
    long enough but not wholly allocated (holes: restored by a sparse copy, `rsync -S`, or
    `fallocate --dig-holes`) is allocated too: it was kept as it was, so on a filling disk
    every write to a hole failed with ENOSPC, silently, while the tier reported its slots."""
    info = os.stat(path, follow_symlinks=False)
    have, size = info.st_size // slot_bytes, want * slot_bytes
    if have >= want and info.st_blocks * 512 >= size:
        return want
    try:  # truncated, capacity grew, or holes: all `size` bytes allocated (`du` counts them,
        # and a write to a slot past a cut neither fails nor lands outside the file)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        return want
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):  # not for lack of room
            raise _unopenable(path, exc) from None
        faults["enospc"] += 1
        return min(have, want)


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
