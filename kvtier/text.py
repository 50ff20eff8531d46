"""Text that came from outside kvtier (a cluster node's error, a server's reply, a status
field), made safe to keep and to print: `printable`.

Contract:
- Every control character is shown escaped, as Python writes it (`\\x1b`, `\\u202e`): C0
  (newline and tab included: a field is one line), DEL, C1, and the Unicode format, line and
  paragraph separators and surrogates (bidi overrides among them). A terminal that prints the
  result sees no escape sequence, no new line, no carriage return.
- With `limit`, the result is at most `limit` characters plus a marker saying how long the text
  was; the work done is bounded by `limit`, not by the size of the text.
"""

from __future__ import annotations

import unicodedata

ERROR_CHARS = 512
"""What a status `last_error` field keeps of an error's text, at most (`printable`'s limit): an
exception's message, a node's error line, has no bound of its own."""

HIDDEN = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))
"""The Unicode categories shown escaped: controls, format characters, line and paragraph
separators, surrogates."""


def _escaped(char: str) -> str:
    if unicodedata.category(char) not in HIDDEN:
        return char
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: object, limit: int | None = None) -> str:
    """`str(text)` with its control characters escaped (module doc); with `limit`, cut to
    `limit` characters (never inside an escape) and `… (cut: N characters in all)` added when
    it was longer."""
    raw = str(text)
    if limit is None:
        return "".join(_escaped(char) for char in raw)
    pieces: list[str] = []
    size = 0
    for char in raw[:limit]:
        piece = _escaped(char)
        if size + len(piece) > limit:
            break
        pieces.append(piece)
        size += len(piece)
    if len(pieces) == len(raw):
        return "".join(pieces)
    return f"{''.join(pieces)}… (cut: {len(raw)} characters in all)"
