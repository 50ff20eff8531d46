"""Review W's regressions, pinned.

- A FIFO or pipe given as the config (`--config <(envsubst < tmpl)`, a piped `/dev/stdin`) is
  read to its end and loaded; one with no writer, or a stalled one, is a `ConfigError` naming
  the path and the wait (`loading.FIFO_WAIT_S`), never a hang; a directory is a `ConfigError`.
- An unknown key of letters, digits, `_`, `-` and `.` (`host2`, `model.name`) is named in its
  error; one with `=` or over 64 characters is not, nor is such an invalid tenant id.
- With `authenticate`, a node's keys are apart from those of plain values and of the release
  before (`:v1:`, version 2 values): a value there is neither read nor deleted by it, nor does it
  stop the node's own write (SET NX), so a rolling upgrade keeps both sides' caches.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from redis.cluster import RedisCluster
from test_remote_audit import LAYOUT, path

import kvtier.config.loading as loading
from kvtier import load_config, parse_config
from kvtier.errors import ConfigError
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster
from kvtier.tiers.remote.entry import mac_key_of, path_keys
from kvtier.tiers.remote.tier import RemoteTier

CONFIG = Path(__file__).parent.parent / "configs" / "qwen2.5-0.5b-laptop.yaml"
BASE = {
    "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"},
    "block_tokens": 4,
    "tiers": {"gpu": {"capacity": 1 << 20, "device": "cpu"}},
}


def write_later(target: str, data: bytes, hold_s: float = 0.0) -> threading.Thread:
    """A thread that opens `target` for writing, writes `data`, waits `hold_s`, closes."""

    def run() -> None:
        with open(target, "wb") as file:
            file.write(data)
            file.flush()
            time.sleep(hold_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_fifo_and_a_pipe_with_a_writer_load(tmp_path: Path) -> None:
    expected = load_config(CONFIG)
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    writer = write_later(str(fifo), CONFIG.read_bytes())
    assert load_config(fifo) == expected
    writer.join(5)
    read, write = os.pipe()  # what `<(...)` hands over: /dev/fd/N
    try:
        data = CONFIG.read_bytes()

        def feed() -> None:
            os.write(write, data)
            os.close(write)

        writer = threading.Thread(target=feed)
        writer.start()
        assert load_config(f"/dev/fd/{read}") == expected
        writer.join(5)
    finally:
        os.close(read)


def test_a_fifo_without_a_writer_or_stalled_is_refused_within_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loading, "FIFO_WAIT_S", 0.3, raising=False)
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(fifo)
    assert time.monotonic() - started < 3
    assert info.value.value == str(fifo) and "0.3 s" in info.value.expected
    writer = write_later(str(fifo), b"block_tokens: 8\n", hold_s=1.5)  # never closes in time
    with pytest.raises(ConfigError) as info:
        load_config(fifo)
    assert "0.3 s" in info.value.expected
    writer.join(5)


def test_a_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert info.value.value == str(tmp_path) and "a directory" in info.value.expected


def test_a_misspelt_key_with_a_digit_or_a_dot_is_named_a_secret_line_is_not() -> None:
    tiers = {**BASE["tiers"], "host2": {"capacity": "1GiB"}}  # type: ignore[dict-item]
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "tiers": tiers})
    assert (info.value.field, info.value.value) == ("tiers.host2", "host2")
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "model.name": "x"})
    assert info.value.value == "model.name"
    for hidden in ("REDIS_PASSWORD=hunter2", "a" * 65, "x y"):
        with pytest.raises(ConfigError) as info:
            parse_config({**BASE, hidden: 1})
        assert hidden not in str(info.value)


def test_an_invalid_tenant_id_shaped_like_a_secret_is_not_shown() -> None:
    secret = "REDIS_PASSWORD=hunter2hunter2hunter2"
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "tenants": {secret: {}}})
    assert info.value.field == "tenants" and "hunter2" not in str(info.value)


def test_an_authenticated_node_leaves_the_old_releases_keys_alone(redis_nodes: list[str]) -> None:
    cluster = RemoteCluster(ClusterSettings(tuple(redis_nodes)))
    node = RemoteTier(cluster, LAYOUT, "review-w", 4, mac_key=mac_key_of(b"s" * 32))
    seed, ids = path("review-w-mixed", 0, 4)
    old_keys = path_keys("review-w", ids, 0, 4, 4)  # where the release before kept its values
    host, port = redis_nodes[0].split(":")
    raw = RedisCluster(host=host, port=int(port))
    try:
        for key in old_keys:
            raw.set(key, b"KVTR\x02\x00 an old node's authenticated value")
        assert node.probe(seed, ids, 0) == 0
        out = list(torch.zeros(4, *LAYOUT.block_shape, dtype=LAYOUT.dtype))
        assert node.read(seed, ids, 0, out) == [False] * 4
        assert node.stats()["verify_failures"] == 0
        data = list(torch.randn(4, *LAYOUT.block_shape).to(LAYOUT.dtype))
        assert node.write(seed, ids, 0, data) == [True] * 4  # not skipped by SET NX
        assert node.read(seed, ids, 0, out) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(out, data, strict=True))
        assert [raw.get(key)[:5] for key in old_keys] == [b"KVTR\x02"] * 4  # type: ignore[index]
    finally:
        raw.close()
        cluster.close()
