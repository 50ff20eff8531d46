"""Request bodies cost memory bounded by what a request needs (`kvtier/service/flat.py`).

Measured before the bounded decoder, on `kvtier serve` with the default config: a 19 MiB
msgpack body `{"tokens": [[], [], ...]}` (a thousand arrays of 20,000 empty arrays) raised the
server's peak RSS from 258 to 1,659 MiB and took 4.5 s to refuse; the default
`service.max_body_bytes` of 1 GiB let one request of some 300 MiB take a 24 GiB machine. Here:

- hostile bodies of 8 MiB (nested empty arrays, deep stacks of arrays of ints, arrays of short
  strings, JSON brackets) are refused 400 / 413, naming the field, by a real `kvtier serve`
  whose peak RSS grows by less than 64 MiB, and the store is whole after;
- `flat.loads_msgpack` gives what `msgpack.unpackb` gives for every flat map (hypothesis), and
  for any bytes either a flat map or `Malformed`, never another exception;
- its Python allocations (tracemalloc) stay within 16 bytes a body byte and 1 MiB on the same
  hostile shapes, where `msgpack.unpackb` takes over 50 a byte on the first.
"""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from service_server import (
    ADMIN_KEY,
    Server,
    kv_of,
    peak_rss_mib,
    running,
    tokens_of,
    write_config,
)

from kvtier.client import Client
from kvtier.client.connections import Reply
from kvtier.client.transport import reply_body
from kvtier.errors import ReplyError
from kvtier.service import flat, wire

MSGPACK = {"content-type": "application/msgpack"}
JSON = {"content-type": "application/json"}
MIB = 1 << 20


def nested_empty_arrays(size: int) -> bytes:
    """`{"tokens": [[], [], ...]}`: one byte of body a list."""
    count = size - 16
    return b"\x81\xa6tokens\xdd" + struct.pack(">I", count) + b"\x90" * count


def deep_arrays_of_ints(size: int) -> bytes:
    """`{"tokens": [1, 2, ..., [1, 2, ..., [...`: arrays never completed, each of 3-byte ints
    (36-byte objects), as deep as msgpack allows."""
    depth = 1000
    per = (size // depth - 5) // 3
    ints = b"\xcd\x01\x00" * per
    level = b"\xdd" + struct.pack(">I", per + 1) + ints
    return b"\x81\xa6tokens" + level * (depth - 1) + b"\xdd" + struct.pack(">I", per) + ints


def short_strings(size: int) -> bytes:
    """`{"tokens": ["ab", "ab", ...]}`: a 51-byte str a 3-byte element."""
    count = (size - 16) // 3
    return b"\x81\xa6tokens\xdd" + struct.pack(">I", count) + b"\xa2ab" * count


def json_brackets(size: int) -> bytes:
    return b'{"tokens": [' + b"[]," * ((size - 20) // 3) + b"[]]}"


HOSTILE: dict[str, Callable[[int], bytes]] = {
    "nested empty arrays": nested_empty_arrays,
    "deep arrays of ints": deep_arrays_of_ints,
    "short strings": short_strings,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("bodies"))) as server:
        yield server


def test_hostile_bodies_are_refused_in_bounded_memory(server: Server) -> None:
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
    tokens = tokens_of(500, 64)
    with Client(server.url, api_key=ADMIN_KEY) as client:
        client.store(tokens, kv_of(64, seed=5))
    before = peak_rss_mib(server.process.pid)
    bodies = [(make(8 * MIB), MSGPACK) for make in HOSTILE.values()]
    bodies.append((json_brackets(8 * MIB), JSON))
    for body, headers in bodies:
        for path in ("/v1/lookup", "/v1/store", "/v1/load"):
            response = server.post(path, content=body, headers={**headers, **auth})
            refusal = response.json() if headers is JSON else msgpack.unpackb(response.content)
            grown = peak_rss_mib(server.process.pid) - before
            assert grown < 64, f"peak RSS grew by {grown:.0f} MiB for bodies of 8 MiB"
            assert response.status_code in (400, 413), refusal
            if path == "/v1/load" and headers is JSON:  # refused before its body is read
                assert "application/msgpack" in refusal["detail"], refusal
                continue
            assert refusal["error"] in ("malformed_body", "too_many_tokens"), refusal
            assert "tokens" in refusal["detail"] or "'['" in refusal["detail"], refusal
    with Client(server.url, api_key=ADMIN_KEY) as client:
        assert client.lookup(tokens).num_tokens == 64
        loaded = client.load(tokens)
        assert loaded.num_tokens == 64 and bool((loaded.kv == kv_of(64, seed=5)).all())
    assert server.admin("/v1/admin/check").status_code == 200


def test_a_lane_frame_is_decoded_in_bounded_memory() -> None:
    """The lane's envelope is a flat array: a nested one is refused as the body is."""
    for size in (1024, 2 * flat.SMALL):  # decoded whole, then checked; walked
        envelope = b"\x94" + nested_empty_arrays(size) + b"\xc0\xc0\xc4\x00"
        with pytest.raises(flat.Malformed, match="entry 0"):
            flat.loads_msgpack(envelope, 4, top=list)
    good = msgpack.packb(["/v1/lookup", None, "t", b"\x01\x02"], use_bin_type=True)
    assert flat.loads_msgpack(good, 4, top=list) == ["/v1/lookup", None, "t", b"\x01\x02"]


@pytest.mark.parametrize("make", list(HOSTILE.values()), ids=list(HOSTILE))
def test_the_decoders_allocations_stay_bounded(make: Callable[[int], bytes]) -> None:
    body = make(4 * MIB)
    peak = _peak(lambda: flat.loads_msgpack(body, 1 << 20))
    assert peak < 16 * len(body) + MIB, f"{peak / MIB:.1f} MiB for a {len(body) / MIB} MiB body"


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
def test_the_bound_fails_a_general_decoder() -> None:
    """The figure above is one `msgpack.unpackb` does not meet: the test can fail."""
    body = nested_empty_arrays(4 * MIB)
    assert _peak(lambda: msgpack.unpackb(body)) > 50 * len(body)


def test_a_legitimate_list_of_tokens_decodes_as_before() -> None:
    tokens = list(range(100_000, 100_000 + (1 << 20)))
    body = msgpack.packb({"tokens": tokens, "start": 16, "release": [1, 2]}, use_bin_type=True)
    assert flat.loads_msgpack(body, 1 << 20) == {"tokens": tokens, "start": 16, "release": [1, 2]}
    with pytest.raises(flat.TooMany) as refused:
        flat.loads_msgpack(body, (1 << 20) - 1)
    assert refused.value.field == "tokens"


SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=40) | st.binary(max_size=200)
)  # fmt: skip
ARRAY_ITEMS = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
)
FLAT = st.dictionaries(
    st.text(max_size=20), SCALARS | st.lists(ARRAY_ITEMS, max_size=50), max_size=flat.MAX_FIELDS
)


@settings(max_examples=300, deadline=None)
@given(FLAT)
def test_every_flat_map_decodes_as_msgpack_decodes_it(value: dict[str, Any]) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    assert flat.loads_msgpack(body, 64) == msgpack.unpackb(body, raw=False)


@settings(max_examples=500, deadline=None)
@given(FLAT, st.data())
def test_damaged_bodies_decode_or_are_malformed(value: dict[str, Any], data: st.DataObject) -> None:
    body = bytearray(msgpack.packb(value, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body)))
        if data.draw(st.booleans()) and at < len(body):
            body[at] = data.draw(st.integers(0, 255))
        else:
            body[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        decoded = flat.loads_msgpack(bytes(body), 64)
    except flat.Malformed:
        return
    assert isinstance(decoded, dict) and len(decoded) <= flat.MAX_FIELDS
    for field in decoded.values():
        assert not isinstance(field, dict)
        assert not isinstance(field, list) or not any(isinstance(v, list | dict) for v in field)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"tokens": [1, [2]]}', "tokens: expected"),
        (b'{"tokens": {"a": 1}}', "tokens: expected"),
        (b"[1, 2]", "expected a map"),
        (b'{"a": "' + b'"' * 600 + b'"}', "quotes"),
        (b"[" * 20, r"'\['"),
        (b"{not json", "not valid JSON"),
    ],
)
def test_json_bodies_are_flat_maps(body: bytes, match: str) -> None:
    with pytest.raises(flat.Malformed, match=match):
        flat.loads_json(body, 64)


def test_a_json_body_longer_than_any_request_needs_is_refused_unread(server: Server) -> None:
    body = b'{"tokens": [' + b"1, " * (6 << 20) + b"1]}"  # 18 MiB: over 16 a token and 64 KiB
    response = server.post(
        "/v1/lookup", content=body, headers={**JSON, "authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert response.status_code == 413, response.text
    assert "JSON" in response.json()["detail"]


def _peak(call: Callable[[], Any], *expected: type[Exception]) -> int:
    tracemalloc.start()
    try:
        with contextlib.suppress(flat.Malformed, ValueError, *expected):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_a_kv_is_read_in_place_where_aligned_and_copied_where_not(offset: int) -> None:
    """`kv_from_wire` of a body's bytes: a view of them when each element sits where its type
    wants it, a copy otherwise; the same values either way."""
    kv = kv_of(8, seed=2).to(torch.float32)
    body = bytearray(offset) + bytearray(kv.view(torch.uint8).numpy().tobytes())
    data = {"kv": memoryview(body)[offset:], "dtype": "float32", "shape": list(kv.shape)}
    start = torch.frombuffer(body, dtype=torch.uint8).data_ptr() + offset
    got = wire.kv_from_wire(data)
    assert torch.equal(got, kv) and got.data_ptr() % 4 == 0
    assert (got.data_ptr() == start) == (start % 4 == 0)


# ---- replies (the clients' side) ------------------------------------------------------------

DOCS = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(DOCS, st.booleans())
def test_every_reply_decodes_as_msgpack_decodes_it(doc: Any, large: bool) -> None:
    """Small replies and large ones (a padding byte string past `flat.SMALL`: walked)."""
    value = {"doc": doc, "pad": b"\x00" * (flat.SMALL + 1 if large else 0)}
    body = msgpack.packb(value, use_bin_type=True)
    assert flat.loads_reply(body, "application/msgpack") == msgpack.unpackb(body, raw=False)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite
@pytest.mark.parametrize("size", [4 * MIB, 64 * MIB])
@pytest.mark.parametrize("make", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_reply_is_a_reply_error_in_bounded_memory(
    make: Callable[[int], bytes], size: int
) -> None:
    body = make(size)
    reply = Reply(200, "application/msgpack", body, "/v1/lookup")
    peak = _peak(lambda: reply_body(reply), ReplyError)
    bound = 64 * flat.MAX_REPLY_ITEMS + 2 * len(body)  # 60-odd bytes an item, whatever the size
    assert peak < bound, f"{peak / MIB:.1f} MiB for a {len(body) / MIB} MiB reply"


def test_a_reply_nested_past_its_depth_or_with_a_json_flood_is_refused() -> None:
    deep = msgpack.packb({"a": [[[[[[[[[[1]]]]]]]]]], "pad": b"\x00" * flat.SMALL})
    with pytest.raises(flat.TooMany, match="levels"):
        flat.loads_reply(deep, "application/msgpack")
    with pytest.raises(flat.Malformed, match="JSON"):
        flat.loads_reply(json_brackets(8 * MIB), "application/json")
    status = {"tiers": {"gpu": {"blocks": 3, "names": ["a", "b"]}}, "pad": b"\x01" * flat.SMALL}
    body = msgpack.packb(status, use_bin_type=True)
    assert flat.loads_reply(body, "application/msgpack") == status  # a large nested reply
