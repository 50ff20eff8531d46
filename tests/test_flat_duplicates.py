"""A request body that gives a field twice is refused (400), in JSON and msgpack, small or
walked: both decoders took the last, so a proxy or filter that read the first `tokens` or
`lease_id` passed a request that acted on another (audit BQ)."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]
import pytest

from kvtier.service.flat import SMALL, Malformed, loads_json, loads_msgpack


@pytest.mark.parametrize(
    "body",
    [
        b'{"tokens": [5000, 1], "tokens": [1, 2, 3, 4]}',
        b'{"lease_id": 1, "lease_id": 2}',
    ],
)
def test_a_json_field_given_twice_is_refused_naming_it(body: bytes) -> None:
    name = body.split(b'"')[1].decode()
    with pytest.raises(Malformed, match=f"{name}: given twice"):
        loads_json(body, 100)


@pytest.mark.parametrize("tokens", [4, SMALL])  # decoded whole; walked field by field
def test_a_msgpack_field_given_twice_is_refused_naming_it(tokens: int) -> None:
    first = msgpack.packb(list(range(tokens)))
    body = b"\x83\xa6tokens" + first + b"\xa5start\x00\xa6tokens" + msgpack.packb([1, 2])
    assert (len(body) > SMALL) == (tokens == SMALL)
    with pytest.raises(Malformed, match="tokens: given twice"):
        loads_msgpack(body, SMALL)


def test_fields_given_once_are_taken_as_before() -> None:
    assert loads_json(b'{"tokens": [1, 2], "start": 0}', 10) == {"tokens": [1, 2], "start": 0}
    packed = msgpack.packb({"tokens": list(range(SMALL)), "start": 4})
    assert loads_msgpack(packed, SMALL)["start"] == 4
    assert loads_msgpack(msgpack.packb({"lease_id": 3}), 10) == {"lease_id": 3}
