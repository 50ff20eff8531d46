"""Raw I/O of the disk tier: aligned buffers, preallocated slab files (its I/O threads:
`io_pool.py`).

Why `os.preadv`/`os.pwritev` on a thread pool, not aiofiles: aiofiles wraps Python's buffered
file objects and runs each call on a thread of its own. That rules out O_DIRECT (a buffered
file object copies through its own buffer, and the data also goes through the page cache),
rules out writing a header and a payload that live in different buffers with one `pwritev`, and
costs a thread hop per call on top of an event-loop hop. Measured on this machine's ext4 on a
virtual disk (`benchmarks/bench_disk.py`, 1 GiB in 2 MiB chunks, 4 threads, median of 3):
O_DIRECT `pwritev` + one fdatasync about 4.3 GB/s, buffered `pwritev` + fdatasync about
0.8 GB/s (0.4-3 GB/s from run to run), cold O_DIRECT `preadv` about 1.4 GB/s.
`preadv`/`pwritev` are positional (no shared file offset, so many threads can use one
descriptor) and release the GIL for the whole system call, so a handful of plain threads keeps
several I/Os in flight in the device queue; `IOPool` (`io_pool.py`) is that handful. An
asyncio caller awaits `loop.run_in_executor` on it.

O_DIRECT rules (Linux): the file offset, the length of every buffer and the address of every
buffer must be multiples of the logical block size of the device. `ALIGN = 4096` covers every
block size in practice (512 and 4096). `aligned_buffer` returns page-aligned memory from an
anonymous mmap; `bytes` objects and most Python allocations are not aligned and make the
kernel answer EINVAL. `SlabFile` checks offsets and lengths and refuses a wrong one as the
kernel would, with an `OSError` (`StorageError`, EINVAL) that fails that I/O alone (never an
`AssertionError`, which used to end a whole store or persist); addresses are the caller's duty
(use `aligned_buffer`).

Fallback: some filesystems refuse O_DIRECT at `open` (EINVAL, older tmpfs) or accept it and
fail the first I/O. `probe_direct(directory)` tries a real aligned write and read in a
temporary file once; when it says False, the tier opens its slabs without O_DIRECT and the
same code runs through the page cache, with durability still given by `SlabFile.sync`
(fdatasync). O_DIRECT alone never makes a write durable: the device may still hold it in a
volatile cache, so the tier calls `sync` in both modes before a copy becomes visible.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from kvtier.errors import ClosedError, StorageError
from kvtier.tiers.disk.group_sync import GroupSync

ALIGN = 4096

# Linux caps the iovec count of one call (UIO_MAXIOV); longer lists go in several calls.
_IOV_MAX = 1024


def align_up(nbytes: int, align: int = ALIGN) -> int:
    """The smallest multiple of `align` that is >= `nbytes`."""
    return -(-nbytes // align) * align


def aligned_buffer(nbytes: int) -> memoryview:
    """A writable, zero-filled buffer of `align_up(nbytes)` bytes whose address is a multiple of
    `ALIGN` (an anonymous mmap, so page-aligned). It is freed when the last view of it goes.

    The mapping is private: Python's default for an anonymous mmap is MAP_SHARED, which a
    forked child (`kvtier replay --jobs`, a test's worker) would share with its parent, so two
    processes' reads through a staging buffer inherited from their parent overwrote each
    other (found as checksum failures, `corrupt_reads`)."""
    assert nbytes > 0, f"aligned_buffer of {nbytes} bytes"
    return memoryview(mmap.mmap(-1, align_up(nbytes), flags=mmap.MAP_PRIVATE))


_staging = threading.local()


def staging_buffer(nbytes: int) -> memoryview:
    """An aligned buffer of at least `nbytes` bytes, reused by the calling thread: for I/O jobs
    whose data is not aligned, without the page faults of a fresh mapping per job. Valid until
    the same thread asks again."""
    size = align_up(nbytes)
    buffer: memoryview | None = getattr(_staging, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = aligned_buffer(size)
        _staging.buffer = buffer
    return buffer[:size]


def probe_direct(directory: Path) -> bool:
    """Whether files in `directory` can be opened with O_DIRECT and written and read back with
    aligned buffers. Creates, tries and deletes one temporary file of `ALIGN` bytes; any
    `OSError` (EINVAL, ENOTSUP, a missing directory, ...) or a platform without O_DIRECT is
    False."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return False
    path = Path(directory) / f".kvtier-probe-direct-{uuid.uuid4().hex}"
    out = aligned_buffer(ALIGN)
    out[:8] = b"kvtier\x00\x01"
    back = aligned_buffer(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flag, 0o600)
    except OSError:
        return False
    try:
        written = os.pwritev(fd, [out], 0)
        read = os.preadv(fd, [back], 0)
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return written == read == ALIGN and back == out


def _bytes_view(buffer: memoryview | bytes) -> memoryview:
    """`buffer` as a flat view of unsigned bytes, so that slicing counts bytes."""
    return memoryview(buffer).cast("B")


class SlabFile:
    """One preallocated file of fixed-size slots.

    The file descriptor is shared by every thread: `write` and `read_into` are positional
    (`pwritev`/`preadv`), so concurrent calls on disjoint ranges are safe without a lock.
    Calling `close` while another thread is inside `write` or `read_into` is the caller's bug.
    """

    path: Path
    size: int
    direct: bool

    def __init__(self, path: Path, size: int, *, direct: bool, create: bool) -> None:
        """Open `path` read-write, with O_DIRECT when `direct`.

        The path is never followed if it is a symbolic link (ELOOP). With `create`, the file
        must not exist (`FileExistsError` otherwise); it is created with mode 0o600 (set with
        `fchmod`, whatever the umask) and `size` bytes are allocated at once with
        `posix_fallocate`, so that `du` counts them and a full disk fails here (OSError
        ENOSPC) rather than on a later write. A file that fails to allocate is removed again.
        Without `create`, the file must exist, be a regular file (checked on the open
        descriptor, so a FIFO or device put in place of a file checked before is refused with
        an `OSError`, never written through), is made 0600 on that descriptor if its mode
        was anything else (it holds tenants' KV), and keeps its current size, which `.size`
        reports (`size` is ignored)."""
        flags = os.O_RDWR | os.O_NOFOLLOW
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        if direct:
            flags |= os.O_DIRECT
        self.path = Path(path)
        self.direct = direct
        self._fd: int | None = None
        self._syncs = GroupSync()
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileExistsError:
            raise
        except OSError:
            # O_CREAT|O_DIRECT on a filesystem that refuses O_DIRECT can fail after creating
            # the file; with O_EXCL, any file there now is ours.
            if create:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            raise
        if create:
            try:
                os.fchmod(fd, 0o600)
                os.posix_fallocate(fd, 0, size)
            except BaseException:
                os.close(fd)
                self.path.unlink(missing_ok=True)
                raise
            self.size = size
        else:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file", str(self.path))
            if stat.S_IMODE(info.st_mode) != 0o600:  # a copy restored by another tool: 0644
                try:
                    os.fchmod(fd, 0o600)
                except BaseException:
                    os.close(fd)
                    raise
            self.size = info.st_size
        self._fd = fd

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ClosedError(f"slab file {self.path} is closed")
        return self._fd

    def write(self, offset: int, buffers: Sequence[memoryview | bytes]) -> None:
        """Write `buffers` back to back at `offset` (`pwritev`, repeated after a short write).

        When `direct`, `offset` and every buffer's length must be multiples of `ALIGN` and every
        buffer's address too (else the kernel answers EINVAL). The data is not durable until
        `sync` returns. Raises the `OSError` of the system call (ENOSPC, EIO, ...)."""
        fd = self._open_fd()
        views = [_bytes_view(b) for b in buffers]
        total = sum(v.nbytes for v in views)
        if offset < 0 or offset + total > self.size:
            raise self._refused(f"a write of {total} bytes at {offset}: outside the file")
        self._check_direct(offset, views)
        views = [v for v in views if v.nbytes]
        while views:
            done = os.pwritev(fd, views[:_IOV_MAX], offset)
            if done == 0:
                raise OSError(
                    errno.EIO, f"pwritev wrote nothing at offset {offset}", str(self.path)
                )
            offset += done
            while views and done >= views[0].nbytes:
                done -= views[0].nbytes
                views.pop(0)
            if done:
                views[0] = views[0][done:]

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Fill `buffer` from `offset` (`preadv`, repeated after a short read) and return the
        number of bytes read: `len(buffer)` in bytes, or fewer when the file ends first.

        When `direct`, the same alignment rules as `write` apply. Raises the `OSError` of the
        system call (EIO, ...)."""
        fd = self._open_fd()
        view = _bytes_view(buffer)
        self._check_direct(offset, [view])
        got = 0
        while got < view.nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
            # An O_DIRECT read that stops off the block grid has hit the end of the file; a
            # further call would start at an unaligned offset and fail with EINVAL.
            if self.direct and got % ALIGN:
                break
        return got

    def readv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill `buffers` in order from `offset` with one `preadv` (a short read is finished
        buffer by buffer from where it stopped); the bytes read. Alignment as for `write`."""
        fd = self._open_fd()
        views = [_bytes_view(b) for b in buffers]
        self._check_direct(offset, views)
        got = os.preadv(fd, views, offset)
        if got == sum(v.nbytes for v in views):
            return got
        total = 0
        for view in views:  # a short read: finish the buffer it stopped in, then the rest
            if got >= view.nbytes:
                got, total = got - view.nbytes, total + view.nbytes
                continue
            if self.direct and got % ALIGN:
                return total + got  # an O_DIRECT read stopped off the grid: end of file
            filled = got + self.read_into(offset + total + got, view[got:])
            total, got = total + filled, 0
            if filled < view.nbytes:
                break
        return total

    def _check_direct(self, offset: int, views: Sequence[memoryview]) -> None:
        """With O_DIRECT, refuse (`StorageError`, an `OSError` EINVAL that fails this I/O as
        the kernel would, never an `AssertionError` that ends the caller's call) an offset,
        or a buffer length, that is not a multiple of `ALIGN`."""
        if not self.direct:
            return
        if offset % ALIGN or any(v.nbytes % ALIGN for v in views):
            lengths = [v.nbytes for v in views]
            raise self._refused(
                f"O_DIRECT I/O at offset {offset} of buffers {lengths}: expected offset and "
                f"lengths that are multiples of {ALIGN}"
            )

    def _refused(self, what: str) -> StorageError:
        return StorageError(errno.EINVAL, what, str(self.path))

    def cut(self, size: int) -> None:
        """Cut the file to `size` bytes (`ftruncate`) and make the cut durable (`fsync`) before
        returning: what lay past `size` is gone from the disk, and no crash or power loss after
        this call brings it back. `.size` becomes `size`."""
        fd = self._open_fd()
        os.ftruncate(fd, size)
        os.fsync(fd)
        self.size = size

    def sync(self) -> None:
        """Make every `write` completed before the call durable (`fdatasync`): data and the
        metadata needed to read it back, such as the conversion of preallocated extents.
        Raises the sync's error when it failed. Concurrent callers share syncs (`GroupSync`):
        several threads committing batches into one slab flush the device's cache once."""
        self._syncs.run(self._fdatasync)

    def _fdatasync(self) -> None:
        os.fdatasync(self._open_fd())

    def is_at_path(self) -> bool:
        """Whether the open file still has a name and `path` still names something: False once
        it was deleted, or replaced (a rename over it), or moved away with nothing in its place,
        while open, or when closed. Inode numbers are not compared: an overlay filesystem may
        report other ones through `stat` than through `fstat` of one file."""
        fd = self._fd
        if fd is None:
            return False
        try:
            return os.fstat(fd).st_nlink > 0 and os.path.lexists(self.path)
        except OSError:  # closed meanwhile
            return False

    def close(self) -> None:
        """Close the descriptor; closing twice is allowed. Unsynced writes are not made
        durable by closing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> SlabFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._fd is None else f"fd={self._fd}"
        return f"SlabFile({str(self.path)!r}, size={self.size}, direct={self.direct}, {state})"
