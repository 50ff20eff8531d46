"""A codec refused because its payload would be larger than the plain block says what could fit
(`tiers/disk/codec.py`): `codec none` always; a larger `codec_group` (and token keys, for
`codec_keys: channel`) only where the codes alone fit in the block. int8 on a float8 model
cannot fit whatever its group (its codes are the block's size), and was told "a larger
codec_group" even at the largest; channel keys on blocks of one token were refused without a
word on the keys."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier import KVStore, parse_config
from kvtier.errors import ConfigError


def config(dtype: str, codec: str, group: int | None, keys: str, bt: int) -> dict[str, Any]:
    host: dict[str, Any] = {"capacity": 1 << 20, "pinned": False, "codec": codec}
    if group is not None:
        host["codec_group"] = group
    if keys != "token":
        host["codec_keys"] = keys
    return {
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": dtype},
        "block_tokens": bt,
        "tiers": {"gpu": {"capacity": 1 << 20, "device": "cpu"}, "host": host},
    }


@pytest.mark.parametrize(
    ("dtype", "codec", "group", "keys", "bt", "hint"),
    [
        ("float8_e4m3fn", "int8", 128, "token", 16, "(codec none)"),
        ("float8_e4m3fn", "fp8", None, "token", 16, "(codec none)"),
        ("float16", "int8", 1, "token", 16, "(codec none, or a larger codec_group)"),
        ("float16", "int8", None, "channel", 1, "or a larger codec_group, codec_keys token)"),
        ("float16", "int4", None, "channel", 1, "or a larger codec_group, codec_keys token)"),
    ],
)
def test_a_refused_codec_says_what_could_fit(
    dtype: str, codec: str, group: int | None, keys: str, bt: int, hint: str
) -> None:
    with pytest.raises(ConfigError) as info:
        KVStore(parse_config(config(dtype, codec, group, keys, bt))).close()
    assert info.value.field == "tiers.host.codec"
    assert str(info.value.expected).endswith(hint), info.value.expected


def test_int4_on_a_float8_model_fits_and_starts() -> None:
    KVStore(parse_config(config("float8_e4m3fn", "int4", None, "token", 16))).close()
