"""Files and directories that only this process's user may change: the server's state directory,
its secret, a disk tier's directory and superblock.

Contract (every path here is untrusted: another user, or a planted link, may have put
something there first):
- `private_dir(path, field)` returns a directory that no group or other user can write: one it
  creates is mode 0700 (its missing parents 0755), whatever the umask; an existing one that
  another user owns (who may write it whatever its mode: delete or swap the server secret), or
  with a group or other write bit, or anything that is not a directory, is refused with a
  `ConfigError` naming the path, its mode and owner. Refusing rather than fixing: a directory others
  could write may already hold their files, so a chmod now would not make it ours.
- `write_atomically(path, data)` replaces `path` with a file of exactly `data`, mode 0600: a
  temporary file beside it is created with O_CREAT|O_EXCL|O_NOFOLLOW (a stale one, or a link
  planted in its place, is unlinked first, never followed), synced, renamed over `path`, and
  the directory synced. A reader sees the old file or the new one, never a part.
- `create_once(path, data)` does the same but never replaces an existing `path` (link(2) of the
  complete temporary file): False when `path` already existed.
- `read_regular(path, field, max_bytes, private=...)` reads a regular file, never following a
  link, of at most `max_bytes`; with `private`, a file that another user owns or that any
  group or other user may read or write is refused. Every refusal is a `ConfigError` naming
  the path and what was found.
- `make_private(path, field)` makes an existing regular file 0600 by `fchmod` on a descriptor
  opened without following a link; one that has another name too (a hard link: the chmod would
  change the file behind it) or that another user owns is a `ConfigError`.
- `owner_expected(what, remedy)` is what a refusal of a file or directory that another user owns
  says is expected (a disk tier's directory and files, `tiers/disk/lock.py` and `slabs.py`):
  owned by this process's user, whose uid it names.
Modes are set with `fchmod`/`chmod` after creation, so the umask never widens or narrows them.
`file_kind(st_mode)` names what was found instead of a file, for such messages.
- `is_path(value)`: whether `value` can name a file at all (a config's path fields are held to
  it, `config/fields.py`); `private_dir` refuses any other with a `ConfigError` naming `field`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from kvtier.errors import ConfigError

DIR_MODE = 0o700
FILE_MODE = 0o600
_PARENT_MODE = 0o755
_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
_GROUP_OTHER_ANY = 0o077


PATH_EXPECTED = "a path: a string, not blank, without a NUL byte or a lone surrogate"


def is_path(value: object) -> bool:
    """Whether `value` is a string the OS can take as a path: not blank, no NUL byte (no system
    call takes one) and nothing the filesystem's encoding cannot write (a lone surrogate, as
    YAML's `"\\ud800"` makes; `\\udc80`-`\\udcff` stand for undecodable bytes and are kept)."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        return False
    try:
        os.fsencode(value)
    except UnicodeError:
        return False
    return True


def private_dir(path: str | os.PathLike[str], field: str) -> Path:
    """`path` as a directory only its owner can write; created 0700 when missing."""
    if not is_path(os.fspath(path)):
        raise ConfigError(field, os.fspath(path), PATH_EXPECTED)
    directory = Path(path)
    missing = []
    for candidate in (directory, *directory.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    for new in reversed(missing):
        try:
            os.mkdir(new, _PARENT_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process: checked below like any other
        except OSError as exc:
            expected = f"a directory it can create ({exc.strerror})"
            raise ConfigError(field, str(new), expected) from None
        os.chmod(new, DIR_MODE if new == directory else _PARENT_MODE)
    try:
        info = os.stat(directory)
    except OSError as exc:
        raise ConfigError(field, str(directory), f"a directory ({exc.strerror})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(field, str(directory), f"a directory, found {file_kind(info.st_mode)}")
    if info.st_uid != os.geteuid():  # its owner may write it, whatever its mode
        shown = f"{directory} (mode {_mode(info.st_mode)}, owner uid {info.st_uid})"
        raise ConfigError(field, shown, owner_expected("a directory", "chown it, or use another"))
    if info.st_mode & _GROUP_OTHER_WRITE:
        raise ConfigError(
            field,
            f"{directory} (mode {_mode(info.st_mode)})",
            "a directory that no group or other user can write (chmod go-w it, or use another)",
        )
    return directory


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` by a 0600 file holding `data` (see the module's contract)."""
    tmp = _write_temporary(path, data)
    os.replace(tmp, path)
    _sync_directory(path.parent)


def create_once(path: Path, data: bytes) -> bool:
    """Create `path` holding `data` unless it exists; True when this call created it. A `path`
    that exists (a file or link of any kind: the caller reads it) writes nothing, so a full or
    read-only filesystem does not stop a server that only has to read what it made before."""
    if os.path.lexists(path):
        return False
    tmp = _write_temporary(path, data, unique=True)  # (`<path>.tmp` of its own: two processes
    try:  # starting at once removed each other's, 8 TP ranks on one state_dir failed a start)
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    _sync_directory(path.parent)
    return True


def read_regular(path: Path, field: str, max_bytes: int, *, private: bool = False) -> bytes:
    """The bytes of the regular file `path` (see the module's contract)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        found = f"nothing it can open ({exc.strerror})"
        if os.path.islink(path):
            found = "a symbolic link" if os.path.exists(path) else "a dangling symbolic link"
        raise ConfigError(field, str(path), f"a regular file, found {found}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(field, str(path), f"a regular file, found {file_kind(info.st_mode)}")
        if private and (info.st_mode & _GROUP_OTHER_ANY or info.st_uid != os.geteuid()):
            raise ConfigError(
                field,
                f"{path} (mode {_mode(info.st_mode)}, owner uid {info.st_uid})",
                f"a file only its owner, uid {os.geteuid()}, can read or write (chmod 600 it)",
            )
        data = b""
        while len(data) <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ConfigError(field, str(path), f"a file of at most {max_bytes} bytes")
    return data


def make_private(path: Path, field: str) -> None:
    """Make the existing regular file `path` 0600 (see the module's contract)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid():
                shown = f"{path} (owner uid {info.st_uid})"
                raise ConfigError(field, shown, owner_expected("a file", "chown it"))
            if info.st_nlink != 1:  # fchmod would change the file behind the other name
                links = f"a file of one link, found {info.st_nlink} (copy it rather than link it)"
                raise ConfigError(field, str(path), links)
            if stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) != FILE_MODE:
                os.fchmod(fd, FILE_MODE)
        finally:
            os.close(fd)
    except OSError as exc:
        expected = f"a file this user can make private, mode 0600 ({exc.strerror})"
        raise ConfigError(field, str(path), expected) from None


def owner_expected(what: str, remedy: str) -> str:
    """The `expected` of a `ConfigError` refusing `what` (a directory, a slab file) that another
    user owns: its owner can change it whenever it likes, whatever its mode (swap a slab for
    one holding KV of its choosing), so no mode makes it this process's."""
    return f"{what} owned by this process's user, uid {os.geteuid()} ({remedy})"


def _write_temporary(path: Path, data: bytes, unique: bool = False) -> Path:
    """`<path>.tmp` (`unique`: `<path>.<random>.tmp`, this call's alone), fresh (never a file
    or link someone left there), 0600, holding `data`, synced."""
    if unique:
        fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
    else:
        tmp = path.with_name(path.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a stale temporary file, or a planted link: removed, not followed
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    return tmp


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mode(mode: int) -> str:
    return f"0{stat.S_IMODE(mode):03o}"


def file_kind(mode: int) -> str:
    """What an `st_mode` is, in words: 'a directory', 'a symbolic link', ..."""
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISREG: "a regular file",
        stat.S_ISLNK: "a symbolic link",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return next((name for test, name in kinds.items() if test(mode)), f"mode {_mode(mode)}")
