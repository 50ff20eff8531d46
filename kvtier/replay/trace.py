"""Request traces in the Mooncake format, read and validated, and their infinite-cache ceiling.

One JSON object per line, sorted by time (FAST'25 Mooncake traces):

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}

`hash_ids` name the input in blocks of `TRACE_BLOCK_TOKENS` (512) tokens and are chained: an id
names the whole prefix up to its block. Other traces of the format name blocks of other sizes
(Alibaba's Bailian traces 16 tokens, Dynamo's generator any `block_size`): `read_trace(...,
block_tokens=B)` reads those (`kvtier replay --trace-block-tokens B`), and each request keeps
its B (`TraceRequest.block_tokens`). The replay gives id `h` the synthetic tokens

    h * B + 0, h * B + 1, ..., h * B + B - 1               (uint32: h < 2**32 / B)

so two requests share a run of store blocks exactly when they share trace ids, and every id of
a request counts as one full block (the trace hashed its partial last block too).

Ids. Mooncake numbers its ids 0, 1, 2, ... in the order they first appear; other traces of
the format name blocks by hashes (64-bit, or 32-bit as in LMCache's and Dynamo's generators).
`read_trace` takes any id in [0, 2**64) and renumbers a trace's ids in the order they first
appear (`Renumber`): the same requests share the same blocks, a Mooncake trace keeps its ids,
and the synthetic tokens stay below 2**32 for up to 2**32 / B distinct ids (2**23 for 512:
4.3 billion tokens); a trace holds at most `MAX_DISTINCT_IDS` (2**24) whatever its B.
`parse_line`, one line alone, keeps its ids and takes them up to 2**32 / B - 1.

Time. Mooncake's timestamps are integer milliseconds; Bailian's are seconds, as floats:
`read_trace(..., seconds=True)` (`kvtier replay --trace-time-unit s`) takes a number of
seconds (int or finite float) and keeps it as the nearest millisecond.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import stat
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO, cast

import numpy as np

from kvtier.config.loading import FIFO_WAIT_S
from kvtier.errors import InvalidArgumentError, TraceError, shown
from kvtier.private_files import file_kind

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in a Mooncake trace."""

MAX_LINE_BYTES = 2**20
"""The longest line read (a request of ~100k ids); a longer one is refused unread."""

MAX_FIELD = 2**63
"""Every number of a line but a hash id is below it (an int64)."""

ID_LIMIT = 2**64
"""A hash id of a trace is below it (a uint64)."""

MAX_TRACE_BLOCK_TOKENS = 2**16
"""The most tokens an id of a trace may name (`read_trace(..., block_tokens=)`)."""

MAX_REQUEST_TOKENS = 2**20
"""The most tokens a request of a trace is replayed as (its ids times their tokens: 2048 ids of
Mooncake's 512), as `service.max_tokens`' default: the replay holds KV for its longest
request. A longer request is refused, naming its line, before any store is built."""

MAX_DISTINCT_IDS = 2**24
"""The most distinct hash ids a trace holds (Mooncake's 512-token ids reach 2**32 / 512 = 2**23
first): the replay holds the whole trace, and each distinct id costs some 130 bytes while it is
read (`Renumber`'s dict, `Chaining`'s arrays), each reference 8, so a trace of many small ids is
refused before it exhausts memory (2**24 ids: about 2 GiB)."""

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace; `hash_ids` is never empty."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = TRACE_BLOCK_TOKENS  # tokens an id names (module doc)

    @property
    def num_tokens(self) -> int:
        """The tokens a replay sends: every id as a full block."""
        return len(self.hash_ids) * self.block_tokens

    def tokens(self) -> np.ndarray[tuple[int], np.dtype[np.uint32]]:
        """The synthetic token ids of this request (see the module docstring)."""
        ids = np.asarray(self.hash_ids, dtype=np.uint32)[:, None] * self.block_tokens
        offsets = np.arange(self.block_tokens, dtype=np.uint32)
        return (ids + offsets).reshape(-1)


@dataclass(frozen=True)
class Ceiling:
    """Block references of a trace and how many of them any cache could serve.

    `prefix_hits` counts, per request, the leading ids seen in earlier requests (what a prefix
    cache with infinite capacity serves); `seen_hits` counts every id seen before. With
    chained ids the two are equal; a difference means the trace breaks the chaining."""

    requests: int
    references: int
    unique_blocks: int
    prefix_hits: int
    seen_hits: int
    block_tokens: int = TRACE_BLOCK_TOKENS  # the trace's tokens an id

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.references if self.references else 0.0

    @property
    def prefix_tokens(self) -> int:
        """The tokens a prefix cache of infinite capacity serves."""
        return self.prefix_hits * self.block_tokens


def _int_field(record: dict[str, object], name: str, error: _LineError) -> int:
    value = record[name]
    if type(value) is not int or not 0 <= value < MAX_FIELD:
        raise error(f"{name}: got {shown(value)}, expected an integer in [0, 2**63)")
    return value


def _seconds_field(record: dict[str, object], error: _LineError) -> int:
    """The timestamp as seconds (module doc), in milliseconds."""
    value = record["timestamp"]
    if not (type(value) in (int, float) and 0 <= cast(float, value) < MAX_FIELD // 1000):
        raise error(
            f"timestamp: got {shown(value)}, expected seconds, a number in [0, 2**63 / 1000) "
            "(--trace-time-unit s)"
        )
    return round(cast(float, value) * 1000)  # NaN failed the range above


class _Malformed(ValueError):
    """JSON that no trace line holds, found while decoding (`_json_object`)."""


def _json_object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    record = dict(pairs)
    if len(record) < len(pairs):
        seen: set[str] = set()  # linear: a line of many keys is refused as fast as it is read
        for name, _ in pairs:
            if name in seen:
                raise _Malformed(f"key {name!r} given twice, expected each key once")
            seen.add(name)
    return record


class _LineError:
    def __init__(self, path: str, line: int) -> None:
        self.path, self.line = path, line

    def __call__(self, problem: str) -> TraceError:
        return TraceError(self.path, self.line, problem)


def parse_line(
    text: str, path: str = "<trace>", line: int = 1, block_tokens: int = TRACE_BLOCK_TOKENS
) -> TraceRequest:
    """One trace line as a request, its ids as given; `TraceError` naming `path:line` if it is
    not valid or an id's tokens pass 2**32 (a whole trace renumbers them: `read_trace`)."""
    request = _parse(text, _LineError(path, line), trace_block_tokens(block_tokens), False)
    most = 2**32 // block_tokens - 1
    for position, value in enumerate(request.hash_ids):
        if value > most:
            raise TraceError(path, line, f"hash_ids[{position}]: got {shown(value)}, expected an "
                             f"int in [0, {most}] (a line alone is not renumbered)")  # fmt: skip
    return request


def trace_block_tokens(value: object, name: str = "trace block_tokens") -> int:
    """`value` as a trace's tokens an id; `InvalidArgumentError` naming `name` unless an int
    in [1, 2**16]."""
    if type(value) is not int or not 1 <= value <= MAX_TRACE_BLOCK_TOKENS:
        raise InvalidArgumentError(
            f"{name}: got {shown(value)}, expected an int in [1, {MAX_TRACE_BLOCK_TOKENS}]"
        )
    return value


class Renumber:
    """A trace's hash ids renumbered 0, 1, 2, ... in the order they first appear (module doc),
    at most `MAX_DISTINCT_IDS` of them (and 2**32 / B: their synthetic tokens are uint32).

    Every request it returns holds the ids' shared int objects (an id that keeps its number is
    its first line's int): a trace of repeated ids costs a pointer per reference, not an int."""

    def __init__(self, block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        self.numbers: dict[int, int] = {}
        self.block_tokens = block_tokens
        self.most = min(2**32 // block_tokens, MAX_DISTINCT_IDS)

    def __call__(self, request: TraceRequest, error: _LineError) -> TraceRequest:
        numbers = self.numbers
        # the new number is `h` itself when they are equal, so that the dict holds one int
        ids = tuple([numbers.setdefault(h, h if h == len(numbers) else len(numbers))
                     for h in request.hash_ids])  # fmt: skip
        if len(numbers) > self.most:
            raise error(
                f"hash_ids: more than {self.most} distinct ids in the trace, expected at most "
                f"that many (each is {self.block_tokens} synthetic tokens below 2**32, and the "
                f"trace is held in memory: at most {MAX_DISTINCT_IDS} distinct ids)"
            )
        return dataclasses.replace(request, hash_ids=ids)


class Chaining:
    """The check that a trace's ids are chained (module doc): an id always follows the same id
    (none: first in its request), so it names one prefix. The simulations need it (`simulate.py`),
    and `read_trace` checks it line by line, on the ids as `Renumber` numbered them: numbers
    0, 1, 2, ... in the order they first appear, so that what it keeps of an id is three
    array slots (24 bytes), not a dict entry."""

    def __init__(self) -> None:
        self.parents = array("q")  # by number: the number before it (-1: first in its request)
        self.lines = array("q")  # by number: the line it first came on
        self.originals = array("Q")  # by number: the id as the trace gave it, for messages

    def check(self, numbers: Sequence[int], ids: Sequence[int], error: _LineError) -> None:
        """`TraceError` (`error`'s line) at the first of `numbers` (`ids` as `Renumber` numbered
        them) after another id than before; the message names the ids as given."""
        parents = self.parents
        previous = -1
        for position, number in enumerate(numbers):
            if number == len(parents):  # its first appearance: numbers come in order
                parents.append(previous)
                self.lines.append(error.line)
                self.originals.append(ids[position])
            elif parents[number] != previous:
                parent = parents[number]
                after = (
                    "first in its request" if parent < 0 else f"after id {self.originals[parent]}"
                )
                here = "first" if previous < 0 else f"after id {ids[position - 1]}"
                raise error(
                    f"hash_ids[{position}]: id {ids[position]} comes {here} here, but came "
                    f"{after} on line {self.lines[number]}; expected chained ids (an id names "
                    "its whole prefix)"
                )
            previous = number


def _parse(text: str, error: _LineError, block_tokens: int, seconds: bool) -> TraceRequest:
    """One line as a request with its ids as given, each below `ID_LIMIT`, each of
    `block_tokens` tokens; its timestamp in `seconds` (module doc) or milliseconds."""
    try:
        record = json.loads(text, object_pairs_hook=_json_object)
    except json.JSONDecodeError as exc:
        raise error(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # `_Malformed`, or an int of more digits than Python converts
        raise error(f"not a request: {exc}") from None
    except RecursionError:
        raise error("not a request: JSON nested too deeply, expected a flat object") from None
    if not isinstance(record, dict):
        raise error(f"got {type(record).__name__}, expected a JSON object")
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        raise error(f"missing {', '.join(missing)}; expected keys {', '.join(_FIELDS)}")
    input_length, output_length = (_int_field(record, name, error) for name in _FIELDS[1:3])
    if seconds:
        timestamp = _seconds_field(record, error)
    elif type(record["timestamp"]) is float:
        raise error(
            f"timestamp: got {shown(record['timestamp'])}, expected integer milliseconds "
            "(seconds: --trace-time-unit s)"
        )
    else:
        timestamp = _int_field(record, "timestamp", error)
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise error(f"hash_ids: got {shown(ids)}, expected a non-empty list of ints")
    for position, value in enumerate(ids):
        if type(value) is not int or not 0 <= value < ID_LIMIT:
            raise error(f"hash_ids[{position}]: got {shown(value)}, expected an int in [0, 2**64)")
    expected = -(-input_length // block_tokens)  # ceil, in ints: no float to overflow
    if len(ids) != expected:
        hint = ""
        if block_tokens == TRACE_BLOCK_TOKENS:
            hint = " (ids of blocks of another size: --trace-block-tokens)"
        raise error(
            f"hash_ids: got {len(ids)} ids for input_length {input_length}, expected "
            f"ceil({input_length} / {block_tokens}) = {expected}{hint}"
        )
    if len(ids) * block_tokens > MAX_REQUEST_TOKENS:
        raise error(
            f"hash_ids: got {len(ids)} ids of {block_tokens} tokens, expected a request of at "
            f"most {MAX_REQUEST_TOKENS} tokens ({MAX_REQUEST_TOKENS // block_tokens} ids)"
        )
    return TraceRequest(timestamp, input_length, output_length, tuple(ids), block_tokens)


def read_trace(
    path: str | os.PathLike[str],
    limit: int | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    seconds: bool = False,
) -> list[TraceRequest]:
    """The first `limit` requests (all when None) of the trace at `path`, whose ids name
    `block_tokens` tokens each, their ids renumbered, their timestamps in `seconds` or
    milliseconds (module doc). Raises `TraceError` naming the file when it is not a regular
    file (a FIFO is refused, not waited for), or the first bad line: unreadable, longer than
    `MAX_LINE_BYTES`, not UTF-8, not a request (one of more than `MAX_REQUEST_TOKENS` tokens
    among them), with an id after another id than before (`Chaining`), or earlier than the
    line before."""
    source = os.fspath(path)
    requests: list[TraceRequest] = []
    renumber = Renumber(trace_block_tokens(block_tokens))
    chaining = Chaining()
    try:
        with _open_regular(source) as file:
            lines = iter(lambda: file.readline(MAX_LINE_BYTES + 1), b"")
            for number, line in enumerate(lines, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                text = _decode(line, source, number)
                if not text.strip():
                    continue
                error = _LineError(source, number)
                request = _parse(text, error, block_tokens, seconds)
                if requests and request.timestamp_ms < requests[-1].timestamp_ms:
                    raise TraceError(
                        source,
                        number,
                        f"timestamp: got {shown(request.timestamp_ms)}, expected >= "
                        f"{requests[-1].timestamp_ms} (the lines are sorted by time)",
                    )
                numbered = renumber(request, error)
                chaining.check(numbered.hash_ids, request.hash_ids, error)
                requests.append(numbered)
    except OSError as exc:
        raise TraceError(source, 0, f"cannot be read ({exc})") from exc
    if not requests:
        raise TraceError(source, 0, "holds no request, expected one JSON object per line")
    return requests


def _open_regular(source: str) -> BinaryIO:
    """`source` opened for reading if it is a regular file (a link to one followed) or a FIFO
    or pipe (`<(zcat trace.gz)`, `/dev/stdin`) whose first bytes (or end) come within
    `FIFO_WAIT_S`; else `TraceError` naming what it is, or the wait. Opened with O_NONBLOCK, so
    that a FIFO with no writer is refused after that wait rather than waited for forever."""
    fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(FIFO_WAIT_S * 1000):
            os.close(fd)
            raise TraceError(
                source, 0, f"cannot be read: a FIFO that sent nothing in {FIFO_WAIT_S:g} s"
            )
    elif not stat.S_ISREG(mode):
        os.close(fd)
        raise TraceError(
            source, 0, f"cannot be read: {file_kind(mode)}, expected a regular file or a pipe"
        )
    os.set_blocking(fd, True)
    return open(fd, "rb")


def _decode(line: bytes, source: str, number: int) -> str:
    """Line `number` of the trace as text; `TraceError` if it is too long or not UTF-8."""
    if len(line) > MAX_LINE_BYTES:
        raise TraceError(source, number, f"longer than {MAX_LINE_BYTES} bytes, expected one "
                         "request per line")  # fmt: skip
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(source, number, f"not UTF-8 ({exc.reason} at byte {exc.start})") from None


def ceiling(requests: Sequence[TraceRequest]) -> Ceiling:
    """The infinite-cache ceiling of `requests`, replayed in order."""
    seen: set[int] = set()
    references = prefix_hits = seen_hits = 0
    for request in requests:
        ids = request.hash_ids
        references += len(ids)
        leading = 0
        while leading < len(ids) and ids[leading] in seen:
            leading += 1
        prefix_hits += leading
        seen_hits += sum(1 for h in ids if h in seen)
        seen.update(ids)
    block_tokens = requests[0].block_tokens if requests else TRACE_BLOCK_TOKENS
    return Ceiling(len(requests), references, len(seen), prefix_hits, seen_hits, block_tokens)
