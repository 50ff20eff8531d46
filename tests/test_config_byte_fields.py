"""Byte-count fields (`service.max_body_bytes`, `service.max_inflight_bytes`,
`events.buffer_bytes`, `events.max_message_bytes`) take a size as every capacity does
(`'2GiB'`), or a whole number of bytes: before, `max_body_bytes: 2GiB` was refused."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.config import parse_config
from kvtier.errors import ConfigError

EVENTS = {"endpoint": "tcp://127.0.0.1:5557"}


@pytest.mark.parametrize(
    ("section", "field", "text", "nbytes"),
    [
        ("service", "max_body_bytes", "2GiB", 2 << 30),
        ("service", "max_body_bytes", "1.5MiB", 3 << 19),
        ("service", "max_body_bytes", 1048576, 1 << 20),  # (at least a block: 360 KiB here)
        ("service", "max_body_bytes", "1048576", 1 << 20),
        ("service", "max_inflight_bytes", "16GiB", 16 << 30),
        ("events", "buffer_bytes", "128MiB", 128 << 20),
        ("events", "max_message_bytes", "1MB", 10**6),
    ],
)
def test_a_byte_field_takes_a_size_and_keeps_its_bytes(
    section: str, field: str, text: object, nbytes: int
) -> None:
    data: dict[str, Any] = {section: {field: text}}
    if section == "events":
        data["events"].update(EVENTS)
    config = parse_config(data)
    assert getattr(getattr(config, section), field) == nbytes
    assert config.to_dict()[section][field] == nbytes  # written back as its bytes
    assert parse_config(config.to_dict()) == config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_body_bytes", "2GiBx"),
        ("max_body_bytes", True),
        ("max_body_bytes", 2.5),
        ("max_body_bytes", "512"),  # under its 1KiB floor
        ("max_body_bytes", "2PiB"),  # over its 1PiB ceiling
        ("max_body_bytes", ["1GiB"]),
        ("max_body_bytes", "-1GiB"),
    ],
)
def test_a_bad_byte_field_is_refused_naming_it_and_its_range(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"service": {field: value}})
    assert info.value.field == f"service.{field}" and info.value.value == value
    assert "a size like '8MiB' or a whole number of bytes, in [1KiB, 1PiB]" in info.value.expected


def test_inflight_under_the_body_limit_names_both_as_sizes() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"service": {"max_body_bytes": "2GiB", "max_inflight_bytes": "1GiB"}})
    assert info.value.field == "service.max_inflight_bytes"
    assert "at least max_body_bytes (2GiB, 2147483648 bytes)" in info.value.expected
