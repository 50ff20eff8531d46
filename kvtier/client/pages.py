"""A load over the body path, in as many replies as the server sends.

A server answers at most `service.max_body_bytes` of KV a reply (`service/plane.py`: whole
blocks, the reply `truncated` when the prefix may go on past them), so that a long prefix never
sits in its memory whole. The client asks again from where a reply ended until one is not
truncated, and joins the parts (`MappedPools.loaded`).

    pages = LoadPages(packed_tokens, start)
    while (request := pages.next()) is not None:
        pages.add(post("/v1/load", request))
    pages.replies                    [(start, reply body), ...] in order

The server is not trusted with the loop's end: a truncated reply must end past its own start
and within the tokens sent (`ReplyError` otherwise), so a server cannot keep a client asking
for ever; `truncated` must be a bool. A server before this protocol never sends `truncated`:
one reply, as before.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import ReplyError


class LoadPages:
    def __init__(self, packed: bytes, start: int) -> None:
        self.packed, self.asked = packed, len(packed) // 4
        self.replies: list[tuple[int, dict[str, Any]]] = []
        self._next: int | None = start

    def next(self) -> dict[str, Any] | None:
        """The next request's body, or None: the load is complete."""
        start = self._next
        if start is None:
            return None
        return {"tokens": self.packed, **({"start": start} if start else {})}

    def add(self, body: dict[str, Any]) -> None:
        """A reply to the request `next` gave."""
        start, self._next = self._next, None
        assert start is not None, "a reply to a load that was complete"
        self.replies.append((start, body))
        truncated = body.get("truncated", False)
        if type(truncated) is not bool:
            raise ReplyError(f"load.truncated: got {truncated!r:.40}, expected a bool")
        if not truncated:
            return
        end = body.get("num_tokens")
        if type(end) is not int or not start < end < self.asked:
            raise ReplyError(
                f"load.num_tokens: got {end!r:.40} in a truncated reply, expected a token past "
                f"{start} and before the {self.asked} asked"
            )
        self._next = end
