"""POSIX shared-memory segments of the sidecar's pools: naming, creation, mapping, sweeping.

A segment is a file of /dev/shm named after its owner process:

    <base>-<pid>-<8 hex>-<tier>          e.g. kvtier-4242-9f0c1ab2-host

`base` is short (letters, digits, `_`), `pid` the creating process, the hex part random (two
stores of one process differ), `tier` is `gpu` or `host`. Nothing else is ever a name of ours:
`NAME` is the only pattern accepted, so a name has no `/`, no `..`, and a bounded length.

Contract:
- `create_shared` makes a new segment (O_EXCL, mode 0600, exactly `nbytes`, its pages
  reserved: no SIGBUS later when /dev/shm runs short) and holds an exclusive `flock` on it for
  as long as the mapping lives (the lock is the open file's, which the mapping keeps: it ends
  with the mapping, or with the process however it dies); the creator unlinks it when its pool
  closes (`SlotPool.close`).
- `map_shared` maps an existing segment only if it is exactly what its creator made: a name
  matching `NAME` (else `InvalidArgumentError`), a regular file (not a symlink: O_NOFOLLOW),
  owned by this process's user, mode 0600, one link, exactly the size of the expected tensor.
  A segment that is missing or fails a check raises `OSError` (`SegmentMismatch` for a check)
  and nothing is mapped; nothing is ever written outside the mapping.
- `sweep_stale` removes the segments that a killed owner left behind: names matching `NAME`
  with base `kvtier`, regular files of this user, whose lock it can take (no process holds
  the segment's mapping), and whose owner pid is not alive or is alive but started after the
  segment was last changed (the pid was reused). It never removes a segment whose owner is
  alive: the lock tells, whatever pid namespace the owner is in (a server per container,
  sharing /dev/shm, sees no other's pid); the pid check keeps a segment of an older kvtier,
  which took no lock, while its pid is alive here.

The race of a new segment: the sweeper may take the lock of a segment created a moment ago,
before its creator locked it. The creator then finds, once it holds the lock, that the name no
longer links to its file (swept), and creates it again.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.errors import InvalidArgumentError

SHM_DIR = Path("/dev/shm")
SERVE_BASE = "kvtier"
"""The base of the segments of `kvtier serve`: the only base `sweep_stale` touches."""

NAME = re.compile(
    r"(?P<base>[A-Za-z0-9_]{1,32})-(?P<pid>[1-9][0-9]{0,9})-[0-9a-f]{8}-(?P<tier>gpu|host)"
)
_CLOCK_SLACK_S = 2.0
"""Process start times are known to about a second (boot time in whole seconds)."""


class SegmentMismatch(OSError):
    """A segment exists under the expected name but is not the file its creator made."""


def segment_prefix(base: str) -> str:
    """`<base>-<pid>-<8 hex>`: the names of this process's new pools, before `-<tier>`."""
    name = f"{base}-{os.getpid()}-{secrets.token_hex(4)}"
    if NAME.fullmatch(f"{name}-host") is None:
        raise InvalidArgumentError(
            f"shared memory base {base!r}: expected 1 to 32 letters, digits or '_'"
        )
    return name


def check_name(name: object) -> str:
    """`name` if it is a segment name of ours (`NAME`), else `InvalidArgumentError`."""
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise InvalidArgumentError(
            f"shared memory name {name!r}: expected <base>-<pid>-<8 hex>-<gpu|host>"
        )
    return name


def create_shared(name: str, nbytes: int) -> mmap.mmap:
    """A new shared mapping of `nbytes` at /dev/shm/`name` (mode 0600; it must not exist).

    Its pages are reserved here (`posix_fallocate`): a /dev/shm with less room (docker gives a
    container 64 MiB unless `--shm-size` says more), or one that others fill later, would
    otherwise kill the process with SIGBUS when it first writes a page past the room. Too
    little room is an `OSError` (ENOSPC) naming what is free, and no segment is left. (A
    segment unlinked while a client maps it keeps its pages until the client unmaps it: a
    server restarted while its clients idle needs room for its pools twice.)"""
    path = SHM_DIR / check_name(name)
    fd = _create_locked(path)
    try:
        os.fchmod(fd, 0o600)  # exactly, whatever the umask
        os.ftruncate(fd, nbytes)
        if nbytes:
            _reserve(fd, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _create_locked(path: Path) -> int:
    """A new file at `path` (O_EXCL), its open file holding an exclusive `flock`, and still
    linked at `path` once locked (else a sweeper took it in between: made again)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        fd = os.open(path, flags, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a sweeper holds it for an instant at most
        mine = os.fstat(fd)
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # swept before it was locked: the name is free again


def _reserve(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        room = os.statvfs(SHM_DIR)
        free = room.f_bavail * room.f_frsize
        raise OSError(
            errno.ENOSPC,
            f"{SHM_DIR} has {free} bytes free for a pool of {nbytes} in shared memory: enlarge "
            "it (docker: --shm-size), lower the capacity, or set service.shared_memory: false "
            "(the pools of a server stopped or killed before keep their room, unlinked, while "
            "a client still maps them: until its next call, or its exit)",
        ) from None


def map_shared(name: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Map another process's segment read/write as a tensor of `shape` and `dtype`, after the
    checks of the module contract (`InvalidArgumentError` for the name, `OSError` otherwise)."""
    check_name(name)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check_segment(name, os.fstat(fd), nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(tuple(shape))


def segment_id(name: str) -> tuple[int, int] | None:
    """`(st_dev, st_ino)` of the file now linked as segment `name`, or None if there is none:
    what tells a mapping of the segment from one of a later segment of the same name."""
    try:
        st = os.stat(SHM_DIR / check_name(name), follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _check_segment(name: str, st: os.stat_result, nbytes: int) -> None:
    found = {
        "a regular file": stat.S_ISREG(st.st_mode),
        f"owned by uid {os.geteuid()} (found {st.st_uid})": st.st_uid == os.geteuid(),
        f"mode 0600 (found {stat.S_IMODE(st.st_mode):04o})": stat.S_IMODE(st.st_mode) == 0o600,
        f"one link (found {st.st_nlink})": st.st_nlink == 1,
        f"{nbytes} bytes (found {st.st_size})": st.st_size == nbytes,
    }
    failed = [what for what, ok in found.items() if not ok]
    if failed:
        raise SegmentMismatch(f"shared memory {name!r}: expected {', '.join(failed)}")


def sweep_stale(directory: Path = SHM_DIR) -> list[str]:
    """Remove the stale segments of `kvtier serve` in `directory` (module contract); return
    their names, sorted."""
    swept = []
    boot = _boot_time()
    for entry in os.scandir(directory):
        match = NAME.fullmatch(entry.name)
        if match is None or match["base"] != SERVE_BASE:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # its owner closed it meanwhile
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _owner_alive(int(match["pid"]), min(st.st_mtime, st.st_ctime), boot):
            continue
        if _unlink_unlocked(entry.path, st):
            swept.append(entry.name)
    return sorted(swept)


def _unlink_unlocked(path: str, st: os.stat_result) -> bool:
    """Unlink the file `st` describes at `path` if no process holds its lock (its owner's
    mapping); whether it was unlinked. The lock is held across the unlink, so that a creator
    that locks it after finds it gone (`_create_locked`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone meanwhile, or not ours to open
    try:
        if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != (st.st_dev, st.st_ino):
            return False  # another file under the name now
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives, maybe in another pid namespace
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def _owner_alive(pid: int, changed_at: float, boot: float | None) -> bool:
    """Whether process `pid` exists and may have made a segment last changed at `changed_at`:
    one that started after that is another process under a reused pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's: compare start times all the same
    started = _start_time(pid, boot)
    return started is None or started <= changed_at + _CLOCK_SLACK_S


def _start_time(pid: int, boot: float | None) -> float | None:
    """When process `pid` started (epoch seconds), or None if /proc does not say."""
    if boot is None:
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    # field 22 of stat(5) is starttime in clock ticks since boot; fields[0] is field 3
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _boot_time() -> float | None:
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("btime "):
            return float(line.split()[1])
    return None
