"""`save_figure`: a replay's plot written where `--plot` names, atomically.

Contract: the image replaces the file at the path (a link planted there is replaced, not
followed), with the mode a new file gets (0666 less the umask: a plot is shared, not secret);
a write or rename the system refuses is an `InvalidArgumentError` naming `--plot`, and leaves
no temporary file (`checks.check_plot` refuses what it can foresee before the run).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgumentError


def save_figure(figure: Any, path: str) -> None:
    """Replace `path` by `figure` (a matplotlib figure) rendered in the format its suffix
    names, atomically: written to a new temporary file of its own beside it (`O_EXCL`, a random
    name: no other file touched), created with mode 0666 so that the umask gives it a new
    file's mode, and renamed over it, so a link planted at `path` is replaced, not followed. A
    write or rename the system refuses (a sticky directory, another user's file) is an
    `InvalidArgumentError` naming `--plot`, the temporary file removed."""
    image = io.BytesIO()
    figure.savefig(image, format=Path(path).suffix.lstrip(".").lower(), dpi=120)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}")
    made = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        made = True
        with os.fdopen(fd, "wb") as out:
            out.write(image.getvalue())
        os.replace(tmp, target)
        made = False
    except OSError as e:
        raise InvalidArgumentError(
            f"--plot: got {path!r}, expected a file kvtier may write ({e.strerror})"
        ) from None
    finally:
        if made:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
