"""The disk tier's `last_write_error` (status `tiers.disk.last_write_error`) is kept as the
status' other error texts are: cut to `text.ERROR_CHARS` characters, control characters escaped.

An OSError's text carries a file name and whatever the OS or a FUSE daemon said; before, it was
kept whole, so a status page, `kvtier status` or a log line showed an unbounded string with
raw escape sequences in it.
"""

from __future__ import annotations

import errno

from kvtier.text import ERROR_CHARS
from kvtier.tiers.disk.slab_set import WriteBackoff


def test_a_refused_write_keeps_a_bounded_escaped_error() -> None:
    backoff = WriteBackoff(clock=lambda: 100.0)
    name = "/mnt/kv/\x1b]0;owned\x07" + "x" * 5000
    backoff.refused(OSError(errno.ENOSPC, "No space left on device", name))
    text = backoff.last_error
    assert text is not None and text.startswith("OSError: [Errno 28] No space left on device")
    assert "\x1b" not in text and "\x07" not in text and "\\x1b]0;owned\\x07" in text
    assert len(text) <= ERROR_CHARS + 40 and text.endswith("characters in all)")
    assert backoff.delay_s > 0


def test_a_short_error_is_kept_whole() -> None:
    backoff = WriteBackoff(clock=lambda: 100.0)
    backoff.refused(OSError(errno.EROFS, "Read-only file system"))
    assert backoff.last_error == "OSError: [Errno 30] Read-only file system"
