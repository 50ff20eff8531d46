"""One process per disk tier directory: an exclusive lock held for the tier's whole life.

    <path>/kvtier.lock     flock(LOCK_EX) by the process that has the tier open; holds its pid

Two stores writing one directory would overwrite each other's slots and each recover a mix
(a real run kept 71 of 622 acknowledged blocks). So `DirectoryLock(path, field)` takes
`flock(LOCK_EX | LOCK_NB)` on the lock file before anything in the directory is read or
written, and refuses with a `ConfigError` naming the holder's pid when another process (or
another open tier in this one) has it. The pid is written into the file after locking, for that
message only: the lock itself is the kernel's, so it goes with its holder, however it ends
(`close`, exit, SIGKILL), and a stale pid in the file means nothing. The file is opened without
following a link and created 0600.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from kvtier.errors import ConfigError

LOCK_FILE = "kvtier.lock"


class DirectoryLock:
    """The exclusive lock on a disk tier directory, taken on construction (see the module)."""

    def __init__(self, directory: Path, field: str) -> None:
        self.path = directory / LOCK_FILE
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            raise ConfigError(
                field, str(self.path), f"a lock file it can open ({exc.strerror})"
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(field, str(self.path), "a regular lock file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                written = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                holder = written if written.isdigit() else "unknown"
                raise ConfigError(
                    field,
                    str(directory),
                    f"a directory no other kvtier process has open: pid {holder} holds "
                    f"{self.path}; stop it, or give this store another path",
                ) from None
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the lock up (closing the file does); releasing twice is allowed."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None
