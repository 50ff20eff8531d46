"""Config scenarios: the shipped files load, sizes parse exactly, and every bad file is refused
with a `ConfigError` that names the field and the bad value."""

from __future__ import annotations

import pickle
from pathlib import Path
from textwrap import dedent

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvtier.config import (
    Capacity,
    DiskTierConfig,
    GpuTierConfig,
    HiddenLine,
    HiddenText,
    KVTierConfig,
    PolicyConfig,
    TiersConfig,
    default_config,
    format_size,
    load_config,
    parse_config,
    parse_size,
)
from kvtier.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path: Path) -> None:
    config = load_config(path)
    assert parse_config(config.to_dict()) == config
    assert parse_config(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config


def test_shipped_configs_are_all_there() -> None:
    assert {p.name for p in CONFIGS.glob("*.yaml")} >= {
        "default.yaml",
        "llama-3.1-8b-1gpu.yaml",
        "llama-3.1-70b-tp8.yaml",
        "qwen2.5-0.5b-laptop.yaml",
    }


def test_default_file_is_the_embedded_default() -> None:
    config = default_config()
    assert load_config(CONFIGS / "default.yaml") == config
    assert config.model.name == "SmolLM2-135M-Instruct"
    assert config.tiers.gpu.capacity.resolve(0) == 256 * MiB
    assert config.tiers.host is not None
    assert config.tiers.host.capacity.resolve(0) == GiB
    assert config.tier_names == ("gpu", "host", "disk")
    assert config.tiers.disk is not None
    assert config.tiers.disk.capacity.nbytes == 2 * GiB
    assert config.tiers.disk.path == "./kvtier-data"
    # the schema's default is the same config without the disk tier: a config that leaves out
    # tiers.disk gets no files written
    schema = KVTierConfig()
    assert schema.tier_names == ("gpu", "host")
    assert schema.model_copy(update={"tiers": config.tiers}) == config
    assert config.policy.write == "write_through"
    assert set(config.tenants) == {"default"}
    assert config.layout.block_bytes == 30 * 2 * 16 * 3 * 64 * 2


def test_llama_8b_layout_has_2mib_blocks_and_three_tiers() -> None:
    config = load_config(CONFIGS / "llama-3.1-8b-1gpu.yaml")
    layout = config.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (32, 8, 128)
    assert (layout.dtype_name, layout.block_tokens) == ("bfloat16", 16)
    assert layout.block_bytes == 2097152
    assert config.tier_names == ("gpu", "host", "disk")
    assert config.tiers.host is not None and config.tiers.host.pinned is True


def test_llama_70b_shard_has_one_kv_head_and_a_fractional_gpu_tier() -> None:
    config = load_config(CONFIGS / "llama-3.1-70b-tp8.yaml")
    assert config.model.num_kv_heads == 1
    assert (config.layout.tp_rank, config.layout.tp_size) == (0, 8)  # the vLLM connector's check
    assert config.layout.block_bytes == 80 * 2 * 16 * 1 * 128 * 2 == 640 * 1024
    assert config.tiers.gpu.capacity == Capacity(fraction=0.25)
    assert config.tiers.gpu.capacity.resolve(80 * GiB) == 20 * GiB


def test_laptop_config_is_cpu_only() -> None:
    config = load_config(CONFIGS / "qwen2.5-0.5b-laptop.yaml")
    assert config.tiers.gpu.device == "cpu"
    assert config.tiers.host is not None and config.tiers.host.pinned is False


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("1.5GiB", 1610612736),
        ("8GiB", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("64KiB", 65536),
        ("1TiB", 2**40),
        ("8GB", 8000000000),
        ("500MB", 500000000),
        ("1TB", 10**12),
        ("4096", 4096),
        ("100B", 100),
        (" 2 GiB ", 2 * GiB),
        (12345, 12345),
    ],
)
def test_sizes_parse_exactly(text: str | int, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["0GiB", "-1GiB", "8 gigs", "8XB", "1.5", "0.1B", "", "GiB"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


def test_format_size_for_people() -> None:
    assert format_size(268435456) == "256MiB"
    assert format_size(1610612736) == "1.5GiB"
    assert format_size(2 * 2**40) == "2TiB"
    assert format_size(1000) == "1000B"
    assert format_size(123456789) == "117.74MiB"
    assert format_size(0) == "0B"


def test_capacity_resolves_sizes_exactly_and_fractions_of_free_memory() -> None:
    assert Capacity.parse("8GiB").resolve(free_bytes=1) == 8 * GiB
    assert Capacity.parse(0.3).resolve(free_bytes=1000) == 300
    assert Capacity.parse(1.0).resolve(free_bytes=12345) == 12345
    assert Capacity.parse(4096) == Capacity(nbytes=4096)
    assert str(Capacity.parse("1.5GiB")) == "1.5GiB"
    assert str(Capacity.parse("8GB")) == "8GB"
    assert str(Capacity.parse(0.3)) == "0.3 of free memory"
    assert Capacity.parse("8GB").to_config() == "8GB"
    assert Capacity.parse(0.3).to_config() == 0.3


@given(st.integers(min_value=1, max_value=2**60))
def test_capacity_text_reads_back_exactly(nbytes: int) -> None:
    text = Capacity(nbytes=nbytes).to_config()
    assert isinstance(text, str)
    assert parse_size(text) == nbytes


def test_to_dict_is_plain_and_round_trips_sizes_and_fractions() -> None:
    config = parse_config(
        {
            "tiers": {
                "gpu": {"capacity": 0.5},
                "host": {"capacity": "1.5GiB"},
                "disk": {"capacity": "8GB"},
            }
        }
    )
    plain = config.to_dict()
    assert plain["tiers"]["gpu"]["capacity"] == 0.5
    assert plain["tiers"]["host"]["capacity"] == "1.5GiB"
    assert plain["tiers"]["disk"] == {
        "capacity": "8GB",
        "path": "./kvtier-data",
        "codec": "none",
        "codec_group": None,
        "codec_keys": "token",
        "fsync": "batch",
    }
    assert parse_config(plain) == config


def test_configs_are_frozen_and_pickle() -> None:
    config = KVTierConfig()
    with pytest.raises(ValueError, match="frozen"):
        config.block_tokens = 32
    with pytest.raises(ValueError, match="frozen"):
        config.tiers.gpu.high_watermark = 0.5
    with pytest.raises(AttributeError):
        config.tiers.gpu.capacity.nbytes = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config


def test_sections_built_in_python_check_the_same_rules() -> None:
    config = KVTierConfig(block_tokens=32, tiers=TiersConfig(gpu=GpuTierConfig(low_watermark=0.5)))
    assert config.layout.block_tokens == 32
    assert config.tiers.gpu.high_watermark == 0.95
    with pytest.raises(ValueError, match="one of write_through, write_back, selective"):
        PolicyConfig(write="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu and host only"):
        DiskTierConfig(capacity=0.5)  # type: ignore[arg-type]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(dedent(text))
    return path


# (name, YAML text, field, value): each file is refused, naming `field` and `value`.
BAD_FILES = [
    (
        "in-flight budget under a body",
        "service: {max_body_bytes: 1048576, max_inflight_bytes: 1048575}",
        "service.max_inflight_bytes",
        1048575,
    ),
    ("bad unit", "tiers: {gpu: {capacity: 8GB!}}", "tiers.gpu.capacity", "8GB!"),
    ("unknown unit", "tiers: {host: {capacity: 8XiB}}", "tiers.host.capacity", "8XiB"),
    ("negative size", "tiers: {gpu: {capacity: -1GiB}}", "tiers.gpu.capacity", "-1GiB"),
    ("zero size", "tiers: {host: {capacity: 0}}", "tiers.host.capacity", 0),
    ("fraction over 1", "tiers: {gpu: {capacity: 1.5}}", "tiers.gpu.capacity", 1.5),
    ("fraction for disk", "tiers: {disk: {capacity: 0.5}}", "tiers.disk.capacity", 0.5),
    ("disk without capacity", "tiers: {disk: {path: /x}}", "tiers.disk.capacity", None),
    ("smaller than a block", "tiers: {gpu: {capacity: 1KiB}}", "tiers.gpu.capacity", "1KiB"),
    (
        "low above high watermark",
        "tiers: {gpu: {high_watermark: 0.8, low_watermark: 0.9}}",
        "tiers.gpu.low_watermark",
        0.9,
    ),
    ("watermark over 1", "tiers: {host: {high_watermark: 1.2}}", "tiers.host.high_watermark", 1.2),
    ("unknown policy.write", "policy: {write: sometimes}", "policy.write", "sometimes"),
    ("selective_hits 0", "policy: {selective_hits: 0}", "policy.selective_hits", 0),
    ("negative lease", "policy: {lease_ttl_s: -1}", "policy.lease_ttl_s", -1),
    ("unknown top-level key", "polcy: {write: write_back}", "polcy", "polcy"),
    ("misspelled nested key", "tiers: {gpu: {capcity: 1GiB}}", "tiers.gpu.capcity", "capcity"),
    ("unknown tier", "tiers: {nvme: {capacity: 1TiB}}", "tiers.nvme", "nvme"),
    ("bad device", "tiers: {gpu: {device: tpu}}", "tiers.gpu.device", "tpu"),
    ("bad pinned", "tiers: {host: {pinned: maybe}}", "tiers.host.pinned", "maybe"),
    (
        "bad codec",
        "tiers: {disk: {capacity: 1TiB, codec: zstd}}",
        "tiers.disk.codec",
        "zstd",
    ),
    ("bad hash", "hashing: {algorithm: md5}", "hashing.algorithm", "md5"),
    (
        "bad dtype",
        "model: {name: m, num_layers: 2, num_kv_heads: 1, head_dim: 8, dtype: int4}",
        "model.dtype",
        "int4",
    ),
    (
        "num_layers 0",
        "model: {name: m, num_layers: 0, num_kv_heads: 1, head_dim: 8, dtype: float16}",
        "model.num_layers",
        0,
    ),
    (
        "num_layers in words",
        "model: {name: m, num_layers: thirty, num_kv_heads: 1, head_dim: 8, dtype: float16}",
        "model.num_layers",
        "thirty",
    ),
    (
        "num_layers as a string of digits",
        "model: {name: m, num_layers: '30', num_kv_heads: 1, head_dim: 8, dtype: float16}",
        "model.num_layers",
        "30",
    ),
    ("model half given", "model: {name: llama}", "model.num_layers", None),
    ("block_tokens too big", "block_tokens: 8192", "block_tokens", 8192),
    ("block_tokens true", "block_tokens: true", "block_tokens", True),
    ("bad tenant id", "tenants: {'bad id!': {}}", "tenants", HiddenText("a key")),  # not shown
    ("no tenants", "tenants: {}", "tenants", {}),
    ("tenant with a key", "tenants: {a: {limits: 1}}", "tenants.a.limits", "limits"),
    ("port 70000", "service: {port: 70000}", "service.port", 70000),
    # text where no field's value goes is not shown, only its kind: it may be a secrets file's
    ("section not a mapping", "policy: write_back", "policy", HiddenText("a string")),
    ("non-mapping top level", "- model\n- tiers\n", "<top level>", HiddenText("a list", 1, 1)),
    ("empty file", "# nothing here\n", "<top level>", None),
    ("repeated key", "block_tokens: 16\nblock_tokens: 32\n", "<yaml>", HiddenLine(2, 1)),
]


@pytest.mark.parametrize(
    ("text", "field", "value"), [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES]
)
def test_bad_files_name_the_field_and_the_value(
    tmp_path: Path, text: str, field: str, value: object
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    error = info.value
    assert error.field == field
    assert field in str(error)
    if value is not None:
        assert error.value == value and type(error.value) is type(value)
        assert repr(value) in str(error)
    assert str(path) in str(error)


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """\
        model: {name: m, num_layers: 2, num_kv_heads: 1, head_dim: 8, dtype: float16}
        tiers:
          gpu: {capacity: [256MiB}
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "<yaml>"
    assert "line 3" in str(info.value)
    assert repr(info.value.value) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.field, info.value.value) == ("<file>", str(path))
    assert info.value.expected == "a readable YAML file (No such file or directory)"
    assert repr(str(path)) in str(info.value)


def test_unknown_key_lists_the_allowed_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "tiers: {gpu: {capcity: 1GiB}}"))
    for key in ("capacity", "high_watermark", "low_watermark", "device"):
        assert key in info.value.expected


def test_watermark_error_names_both_watermarks() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": {"host": {"high_watermark": 0.5, "low_watermark": 0.6}}})
    assert "low_watermark" in str(info.value) and "high_watermark" in str(info.value)
    assert "0.5" in str(info.value) and "0.6" in str(info.value)


def test_parse_config_refuses_non_mappings_and_names_the_source() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(["not", "a", "mapping"], source="request body")
    assert info.value.field == "<top level>"
    assert "request body" in str(info.value)


def test_mover_store_wait_s_defaults_to_a_tenth_of_a_second_and_is_bounded() -> None:
    assert parse_config({}).mover.store_wait_s == 0.1
    for good in (0, 0.0, 2.5, 60):
        assert parse_config({"mover": {"store_wait_s": good}}).mover.store_wait_s == good
    for bad in (-0.1, 61, "1", True, float("nan"), None):
        with pytest.raises(ConfigError) as info:
            parse_config({"mover": {"store_wait_s": bad}})
        assert "store_wait_s" in str(info.value) and "seconds in [0, 60]" in str(info.value)


def test_the_remote_tier_is_off_unless_set_and_checks_each_field() -> None:
    assert parse_config({}).tiers.remote is None
    remote = parse_config({"tiers": {"remote": {"nodes": ["10.0.0.7:6379", "redis-b:7001"]}}})
    assert remote.tiers.remote is not None
    assert remote.tiers.remote.nodes == ("10.0.0.7:6379", "redis-b:7001")
    assert (remote.tiers.remote.key_prefix, remote.tiers.remote.group_blocks) == ("kvtier", 16)
    assert parse_config(remote.to_dict()) == remote
    for bad, field in (
        ({}, "nodes"),
        ({"nodes": []}, "nodes"),
        ({"nodes": ["no-port"]}, "nodes"),
        ({"nodes": ["h:70000"]}, "nodes"),
        ({"nodes": ["h:1"], "key_prefix": "a{tag}"}, "key_prefix"),
        ({"nodes": ["h:1"], "key_prefix": "a:b"}, "key_prefix"),
        ({"nodes": ["h:1"], "group_blocks": 0}, "group_blocks"),
        ({"nodes": ["h:1"], "timeout_s": 0}, "timeout_s"),
        ({"nodes": ["h:1"], "max_pending_bytes": "0.5"}, "max_pending_bytes"),
        ({"nodes": ["h:1"], "username": "a user"}, "username"),
        ({"nodes": ["h:1"], "tls": {}}, "tls.ca_file"),
        ({"nodes": ["h:1"], "tls": {"ca_file": "ca.pem", "cert_file": "c.pem"}}, "tls.key_file"),
        ({"nodes": ["h:1"], "tls": {"ca_file": "ca.pem", "key_file": "c.key"}}, "tls.cert_file"),
        ({"nodes": ["h:1"], "tls": {"ca_file": "c", "check_hostname": 1}}, "tls.check_hostname"),
        ({"nodes": ["h:1"], "username": 7}, "username"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config({"tiers": {"remote": bad}})
        assert info.value.field == f"tiers.remote.{field}", (bad, info.value)


def test_a_cluster_secret_is_never_shown_in_an_error() -> None:
    short = "too-short-secret"[:10]
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": {"remote": {"nodes": ["h:1"], "secret": short}}})
    assert info.value.field == "tiers.remote.secret" and short not in str(info.value)
    assert "a secret of at least 16 characters" in str(info.value)
    secret = "the-cluster-wide-secret-0123"  # valid here; an error elsewhere must not show it
    with pytest.raises(ConfigError) as info:
        parse_config(
            {"tiers": {"remote": {"nodes": ["h:1"], "secret": secret, "key_prefix": secret + "{"}}}
        )
    assert secret not in str(info.value)


def test_a_cluster_password_is_a_secret_never_shown_in_an_error() -> None:
    good = parse_config(
        {"tiers": {"remote": {"nodes": ["h:1"], "username": "kvtier", "password": "env:PW"}}}
    )
    assert good.tiers.remote is not None
    assert (good.tiers.remote.username, good.tiers.remote.password) == ("kvtier", "env:PW")
    for bad in ("short-pw", ["a-list-of-one-password"]):
        with pytest.raises(ConfigError) as info:
            parse_config({"tiers": {"remote": {"nodes": ["h:1"], "password": bad}}})
        assert info.value.field == "tiers.remote.password"
        assert "short-pw" not in str(info.value) and "a-list-of" not in str(info.value)
    password = "the-cluster-password-0123"  # valid; an error elsewhere must not show it
    with pytest.raises(ConfigError) as info:
        remote = {"nodes": ["h:1"], "password": password, "group_blocks": password}
        parse_config({"tiers": {"remote": remote}})
    assert info.value.field == "tiers.remote.group_blocks" and password not in str(info.value)


def test_a_sidecar_names_the_tensor_parallel_shard_it_holds() -> None:
    model = {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"}
    sharded = parse_config({"model": {**model, "tp_rank": 3, "tp_size": 8}})
    assert (sharded.layout.tp_rank, sharded.layout.tp_size) == (3, 8)
    assert sharded.layout.fingerprint != parse_config({"model": model}).layout.fingerprint
    for bad in ({"tp_rank": 8, "tp_size": 8}, {"tp_size": 0}, {"tp_rank": -1}, {"tp_size": "2"}):
        with pytest.raises(ConfigError) as info:
            parse_config({"model": {**model, **bad}})
        assert info.value.field.startswith("model.tp_"), (bad, info.value)


def test_events_are_off_unless_set_and_check_each_field() -> None:
    assert parse_config({}).events is None
    events = parse_config({"events": {"endpoint": "tcp://*:5557", "topic": "kv@pod@m"}}).events
    assert events is not None and (events.endpoint, events.buffer) == ("tcp://*:5557", 10_000)
    assert events.replay_endpoint is None and not events.per_tenant_topic
    assert events.connect == ()
    peers = ["tcp://llm-d-indexer:5557", "tcp://[::1]:5557", "ipc:///run/kv.sock"]
    connected = parse_config({"events": {"endpoint": "tcp://*:5557", "connect": peers}}).events
    assert connected is not None and connected.connect == tuple(peers)
    for bad, field in (
        ({}, "endpoint"),
        ({"endpoint": "http://h:1"}, "endpoint"),
        ({"endpoint": "tcp://h:1", "replay_endpoint": "tcp://h"}, "replay_endpoint"),
        ({"endpoint": "tcp://h:1", "topic": "a topic"}, "topic"),
        ({"endpoint": "tcp://h:1", "per_tenant_topic": 1}, "per_tenant_topic"),
        ({"endpoint": "tcp://h:1", "buffer": 0}, "buffer"),
        ({"endpoint": "tcp://h:1", "connect": "tcp://idx:5557"}, "connect"),  # not a list
        ({"endpoint": "tcp://h:1", "connect": ["tcp://*:5557"]}, "connect"),  # * binds only
        ({"endpoint": "tcp://h:1", "connect": ["tcp://idx"]}, "connect"),
        ({"endpoint": "tcp://h:1", "connect": [5557]}, "connect"),
        ({"endpoint": "tcp://h:1", "connect": ["tcp://idx:65536"]}, "connect"),
        ({"endpoint": "tcp://h:1", "connect": [f"tcp://i:{n}" for n in range(17)]}, "connect"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config({"events": bad})
        assert info.value.field == f"events.{field}", (bad, info.value)


def test_the_in_flight_budget_defaults_to_4_gib_or_four_bodies() -> None:
    assert KVTierConfig().service.inflight_bytes == 4 << 30
    big = parse_config({"service": {"max_body_bytes": 2 << 30}}, "<test>")
    assert big.service.inflight_bytes == 8 << 30
    set_ = parse_config({"service": {"max_inflight_bytes": 1 << 30}}, "<test>")
    assert set_.service.inflight_bytes == 1 << 30
