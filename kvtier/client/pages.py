"""A load or a store over the body path, in as many replies or requests as the server's bounds
need (`LoadPages`, `StorePieces`), and the body of a store (`store_body`) and of a prefetch
(`prefetch_body`).

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
for ever; `truncated` must be a bool. Its end must be a block boundary too, where the layout is
known (`block_tokens`: a server's pages are whole blocks), so a server cannot make a long load
take a request a token (quadratic bytes: the tokens are sent again with each). A server before
this protocol never sends `truncated`: one reply, as before.

Each page is a load of its own on the server, so the prefix may be evicted between two: a later
page then ends before its own start (its KV empty). The load ends where the pages before it
ended (`joined`): the result is the contiguous KV the pages delivered, `num_tokens` exactly its
end, never a count that disagrees with the KV. A page whose KV holds other than the tokens its
`num_tokens` says from its start is a `ReplyError` (`replies.loaded`), whatever the pages around.

A store goes the other way: a request body of more than the server's `max_body_bytes` is
refused (413), so `StorePieces` sends whole blocks that fit it, each piece from where the last
ended (`start`), and adds up their results (its own doc). Its loop ends by itself: each piece
asks for more tokens than the last, and it stops at the first that leaves the prefix short.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.blocks import Tokens, encode_tokens, from_blocks
from kvtier.caller_kv import KVKind, check_memory
from kvtier.client.arguments import ttl_field
from kvtier.errors import ReplyError, shown
from kvtier.results import StoreResult
from kvtier.service import replies, wire
from kvtier.service.replies import Pools


class LoadPages:
    def __init__(self, packed: bytes, start: int, block_tokens: int | None = None) -> None:
        """A load of the tokens `packed` from `start`. `block_tokens`: the served layout's, which
        a truncated reply must end on (None: not known; the client sets it before it `add`s a
        truncated reply, asking the layout then)."""
        self.packed, self.asked = packed, len(packed) // 4
        self.block_tokens = block_tokens
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
            raise ReplyError(f"load.truncated: got {shown(truncated)}, expected a bool")
        if not truncated:
            return
        end = body.get("num_tokens")
        bt = self.block_tokens or 1
        if type(end) is not int or not start < end < self.asked or end % bt:
            blocks = f"a block boundary (of {bt} tokens) " if bt > 1 else "a token "
            raise ReplyError(
                f"load.num_tokens: got {shown(end)} in a truncated reply from {start}, expected "
                f"{blocks}past {start} and before the {self.asked} asked"
            )
        self._next = end


def joined(parts: list[tuple[int, int, torch.Tensor]]) -> tuple[int, torch.Tensor]:
    """The pages of one load, `(start, num_tokens, kv)` each in order (checked by
    `replies.loaded`: `kv` holds tokens start..num_tokens, none past a prefix that ends before
    `start`), joined: `(num_tokens, kv)` of the contiguous prefix they delivered. The first
    page's `num_tokens` may be below its start (the prefix is shorter than `start`: no KV); a
    later page's that is (the prefix evicted since the page before) ends the load at its start,
    which is where the page before ended (module doc)."""
    num_tokens, kvs = parts[0][1], [parts[0][2]]
    for start, end, kv in parts[1:]:
        assert start == num_tokens, "each page asks from where the one before ended (`add`)"
        if end < start:
            break  # evicted between the pages: what came before is all that was delivered
        num_tokens = end
        kvs.append(kv)
    return num_tokens, kvs[0] if len(kvs) == 1 else torch.cat(kvs, dim=2)


class StorePieces:
    """A store through the body in as many requests as the server's `max_body_bytes` needs
    (its `/v1/pools` reply says; unsaid, one request as before): whole blocks from `start`,
    each piece's KV and tokens within the limit, each stored from where the last ended
    (`start`), so a piece is stored only once those before it are. A piece that leaves the
    prefix short of its end (no room, a disk insert still pending) ends the store: what was not
    sent is counted dropped.

        pieces = StorePieces(tokens, kv, start, kind, served)
        while (body := pieces.next()) is not None:
            pieces.add(post("/v1/store", body))
        pieces.result                    the pieces' results, as one
    """

    def __init__(
        self, tokens: Tokens, kv: torch.Tensor, start: int, kind: KVKind, served: Pools | None
    ) -> None:
        assert served is not None, "the served pools are asked first (`Client.layout`)"
        check_memory(kv, "kv")  # no byte of a "meta" or sparse tensor could be sent
        self.tokens, self.kv, self.kind = tokens, kv, kind
        self.bt = bt = served.layout.block_tokens
        self.start, self.asked = start, len(encode_tokens(tokens)) // 4
        per_block = served.layout.block_bytes + 4 * bt  # its KV, and its tokens in every piece
        room = (served.max_body_bytes or 0) - 4096 - 4 * self.asked  # and the other fields
        blocks = room // per_block if served.max_body_bytes else self.asked
        self.step = max(1, blocks) * bt
        self.sent = 0  # the tokens of the piece last asked for
        self.result = StoreResult(0, 0, 0, 0)
        self._next: int | None = start
        self._end = start

    def next(self) -> dict[str, Any] | None:
        """The next piece's body, or None: the store is complete."""
        first = self._next
        if first is None:
            return None
        end = min(self.asked, first + self.step)
        if end < self.asked:  # whole blocks from `start`: the last piece takes the rest
            end -= (end - self.start) % self.bt
        lo, hi = first - self.start, end - self.start
        part = (
            self.kv[lo // self.bt : hi // self.bt]
            if self.kind == "blocks"
            else self.kv[:, :, lo:hi]
        )
        self.sent, self._end = end, end
        return store_body(self.tokens[:end], part, first, self.kind, self.bt)

    def add(self, body: dict[str, Any]) -> None:
        """The reply to the piece `next` gave (checked: `stored`)."""
        result = stored(body, self.sent)
        _, kept, dropped, pending = self.result
        end = self._end
        done = result.cached_tokens + result.pending_tokens >= end - end % self.bt
        self._next = end if end < self.asked and done else None
        untried = self.asked - end if self._next is None and end < self.asked else 0
        self.result = StoreResult(
            result.cached_tokens, kept + result.stored_tokens,
            dropped + result.dropped_tokens + untried, pending + result.pending_tokens,
        )  # fmt: skip


def prefetch_body(tokens: Tokens, ttl_s: float | None, wait: bool, as_load: bool) -> dict[str, Any]:
    """A `/v1/prefetch` body (packed tokens). `as_load`: the lease is a load's, read through
    the mapped pool and released: the server counts it as a load (a server before the field
    ignores it, as every unknown field, and counts a prefetch)."""
    body: dict[str, Any] = {"tokens": encode_tokens(tokens)}
    if (ttl := ttl_field(ttl_s)) is not None:  # checked before anything is sent
        body["ttl_s"] = ttl
    if not wait:
        body["wait_s"] = 0.0
    if as_load:
        body["as_load"] = True
    return body


def store_body(
    tokens: Tokens, kv: torch.Tensor, start: int, kind: KVKind, block_tokens: int
) -> dict[str, Any]:
    """A `/v1/store` body: the KV travels layer-major; pages give their full blocks only, and
    the tokens past them are left out (a partly filled page is never stored)."""
    packed = encode_tokens(tokens)
    if kind == "blocks":
        full = (len(packed) // 4 - start) // block_tokens
        packed = packed[: (start + full * block_tokens) * 4]
        kv = from_blocks(kv[:full])
    return {"tokens": packed, **wire.kv_to_wire(kv), "start": start}


def stored(body: dict[str, Any], sent: int) -> StoreResult:
    """A store or commit reply for a sequence of `sent` tokens: what it reports cached, dropped
    and pending adds up to no more than them (`ReplyError` otherwise)."""
    result = replies.stored(body)
    cached, _, dropped, pending = result
    counts = {f"store.{name}": count for name, count in result._asdict().items()}
    counts["store: cached + dropped + pending"] = cached + dropped + pending
    for field, count in counts.items():
        if count > sent:
            raise ReplyError(f"{field}: got {count}, expected at most the {sent} tokens sent")
    return result
