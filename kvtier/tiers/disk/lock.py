"""One process per disk tier directory: an exclusive lock held for the tier's whole life.

    <path>/kvtier.lock     flock(LOCK_EX) by the process that has the tier open; holds its pid

Two stores writing one directory would overwrite each other's slots and each recover a mix
(a real run kept 71 of 622 acknowledged blocks). So `DirectoryLock(path, field)` takes
`flock(LOCK_EX | LOCK_NB)` on the lock file before anything in the directory is read or
written, and refuses with a `ConfigError` naming the holder's pid when another process (or
another open tier in this one) has it. The pid is written into the file after locking, for that
message only: the lock itself is the kernel's, so it goes with its holder, however it ends
(`close`, exit, SIGKILL), and a stale pid in the file means nothing; a pid that cannot be
written (a full filesystem: the tier then meets its capacity check, which names the free bytes)
leaves the file empty, and the holder "unknown" in that message.

The directory itself is locked too (`flock` on a descriptor of it, after the file): a lock file
deleted while its holder runs (an operator clearing a "stale lock" at 3 a.m.) is created anew
by the next process, whose `flock` on the new file then succeeds, so a second server (or a
`kvtier check --fix`) used to open the directory beside the running one and overwrite its
slots. The directory cannot be unlinked while it holds files, and a directory moved away and
made anew holds none of the running store's slabs. A filesystem that refuses `flock` on a
directory (not EWOULDBLOCK: some network filesystems) keeps the file's lock alone. The file is
opened without
following a link and created 0600. It is checked on the open descriptor before anything is
written into it: a lock file that is not a regular file, that has another name too (a hard
link: truncating it and writing the pid would overwrite the file behind the other name), or
that another user owns, is a `ConfigError` naming it.

Before the lock file is opened, the directory must be this process's user's (`private_directory`,
checked on a descriptor of it, so a path that is a link is judged by the directory it leads to):
one another user owns is a `ConfigError` naming it, its owner's uid and this user's, whatever its
mode. Its owner could otherwise swap a slab for one holding KV of its choosing, which the store
would serve after a restart; nothing is created or read in such a directory. An own directory
is made 0700 on that descriptor: kvtier's files there are its tenants' KV (one that cannot be,
on a read-only filesystem or in /proc, is a `ConfigError` naming it and why). Once it is, no other
user (root aside) can add, replace or rename an entry in it, which is what lets `slabs.py` check
each slab's owner by path before opening it without following a link.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.private_files import owner_expected

LOCK_FILE = "kvtier.lock"


class DirectoryLock:
    """The exclusive lock on a disk tier directory, taken on construction (see the module)."""

    def __init__(self, directory: Path, field: str) -> None:
        self.path = directory / LOCK_FILE
        private_directory(directory, field)  # before anything is created in it
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            raise ConfigError(
                field, str(self.path), f"a lock file it can open ({exc.strerror})"
            ) from None
        self._directory_fd: int | None = None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(field, str(self.path), "a regular lock file")
            if info.st_nlink != 1:  # the pid written below would land in the other file too
                raise ConfigError(
                    field,
                    str(self.path),
                    f"a lock file of one link, found {info.st_nlink} links (delete it: the "
                    "store creates a new one)",
                )
            if info.st_uid != os.geteuid():
                raise ConfigError(
                    field,
                    f"{self.path} (owner uid {info.st_uid})",
                    owner_expected("a lock file", "delete it: the store creates a new one"),
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _held(directory, field, fd) from None
            self._directory_fd = _lock_directory(directory, field, fd)
            os.fchmod(fd, 0o600)
            try:  # the pid is for the message above only: a full disk leaves the file empty
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass
        except BaseException:
            os.close(fd)
            if self._directory_fd is not None:
                os.close(self._directory_fd)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the locks up (closing the directory, then the file, does: in the order a
        newcomer takes them the other way round, so that one who got the file finds the
        directory free); releasing twice is allowed."""
        directory_fd, self._directory_fd = self._directory_fd, None
        if directory_fd is not None:
            os.close(directory_fd)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _held(directory: Path, field: str, lock_fd: int) -> ConfigError:
    """The refusal of a directory another process holds, naming the pid its lock file holds
    ("unknown" when it holds none: a lock file deleted and made anew since)."""
    written = os.pread(lock_fd, 32, 0).decode("ascii", "replace").strip()
    holder = written if written.isdigit() else "unknown"
    return ConfigError(
        field,
        str(directory),
        f"a directory no other kvtier process has open: pid {holder} holds "
        f"{directory / LOCK_FILE}; stop it, or give this store another path",
    )


def _lock_directory(directory: Path, field: str, lock_fd: int) -> int | None:
    """`flock` the directory itself (the module: a lock file deleted under its holder); the
    descriptor that holds the lock, or None where the filesystem refuses to lock a directory.
    Another process's lock is a `ConfigError` as for the file's."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ConfigError(field, str(directory), f"a directory ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _held(directory, field, lock_fd) from None
    except OSError:  # no flock on directories here: the lock file's alone
        os.close(fd)
        return None
    return fd


def private_directory(directory: Path, field: str) -> None:
    """Check that this process's user owns the tier directory, and make it 0700 (`fchmod` on a
    descriptor of it, never by path). One another user owns is a `ConfigError` naming it, its
    mode and owner, whatever its mode: that user could swap the slabs in it (the module)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ConfigError(field, str(directory), f"a directory ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise ConfigError(
                field,
                f"{directory} (mode {stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid})",
                owner_expected(
                    "a directory",
                    f"`chown -R {os.geteuid()}` it if its slabs are this store's, else use "
                    "another path: its owner could swap them for KV of its choosing",
                ),
            )
        if info.st_mode & 0o077:
            try:
                os.fchmod(fd, stat.S_IMODE(info.st_mode) & 0o700 | 0o700)
            except OSError as exc:  # a read-only filesystem, /proc: nothing was changed
                raise ConfigError(
                    field,
                    f"{directory} (mode {stat.S_IMODE(info.st_mode):04o})",
                    f"a directory it can make private, chmod 700 ({exc.strerror}): make it "
                    "so, or use another path",
                ) from None
    finally:
        os.close(fd)
