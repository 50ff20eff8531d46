"""kvtier's SGLang backend against audit AN: SGLang's real host pools and storage config in this
process (the pools on CPU, no controller), real `kvtier serve` processes, restarted at one URL.

- A sidecar restarted behind the URL on another layout (another dtype): the backend's loads and
  stores are refused (the client never casts), but `batch_exists` kept answering hits for the
  pages a server of the new layout holds, so every prefetch cost SGLang host slots and a failed
  load. It now answers 0 (counted in `skipped_calls`) once a load or store found the layout
  changed, until one succeeds again (the sidecar back on the host pool's layout) or `stale_s`
  has passed (a rank that never stores asks again).
- A store the sidecar answered without taking the pages (their prefix gone; no room) was all
  False with no count and no log of the backend's: its stats looked healthy while nothing was
  backed up. Such pages are counted in `stats["pages_not_stored"]` and logged.
- A storage config that says its ranks share their KV (`is_mla_model`, whose keys' scope names
  no rank) over an MHA pool (each rank its own heads) was taken: tensor-parallel rank 1 was
  served rank 0's heads. It is a `ConfigError` naming `is_mla_model` at registration.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_audit_AN.py
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from service_server import Server, free_port, running, start, write_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from test_sglang_audit3 import PAGE, TENANTS, host_pool, storage_config

from kvtier.errors import ConfigError
from kvtier.integrations.sglang import KvtierHiCacheStorage


def backend(url: str, host: Any, **fields: Any) -> KvtierHiCacheStorage:
    """The backend of one SGLang rank (`fields` of its storage config), `host` registered."""
    extra = {"kvtier.url": url, "kvtier.api_key": TENANTS["alice"]["api_keys"][0],
             "interface_v1": 1}  # fmt: skip
    made = KvtierHiCacheStorage(storage_config(url, extra_config=extra, **fields))
    made.register_mem_pool_host(host)
    return made


def filled(host: Any, seed: int) -> Any:
    """`host` with random KV in every slot, a function of `seed`."""
    gen = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen))
    return host


def restarted(config: Path, port: int, state: str, dtype: str = "float16") -> Server:
    """A sidecar of `config`'s but for its model's `dtype`, with a state dir of its own, at
    `port` (the URL the backends were made with)."""
    settings = yaml.safe_load(config.read_text())
    settings["model"]["dtype"] = dtype
    settings["service"]["state_dir"] = str(config.parent / state)
    path = config.with_name(f"{state}.yaml")
    path.write_text(yaml.safe_dump(settings))
    return start(path, port=port)


def test_a_sidecar_restarted_on_another_layout_is_no_hit_until_pages_move_again(
    tmp_path: Path,
) -> None:
    config, port = write_config(tmp_path, tenants=TENANTS), free_port()
    first = restarted(config, port, "first")
    ours = backend(first.url, filled(host_pool(), 1))  # an fp16 SGLang
    ours.stale_s = 2.0  # (30 s by default)
    assert ours.batch_set_v1(["a0", "a1"], torch.arange(2 * PAGE)) == [True, True]
    assert first.stop() == 0
    second = restarted(config, port, "second", "bfloat16")  # same URL, another dtype
    try:
        theirs = backend(second.url, filled(host_pool(dtype=torch.bfloat16), 2))
        keys = ["b0", "b1"]
        assert theirs.batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
        assert ours.batch_get_v1(keys, torch.arange(2 * PAGE)) == [False, False]  # never cast
        skipped = ours.stats["skipped_calls"]
        assert ours.batch_exists(keys) == 0  # was 2: a hit that no load could serve
        assert ours.stats["skipped_calls"] == skipped + 1
    finally:
        assert second.stop() == 0
    third = restarted(config, port, "third")  # back on the host pool's layout
    try:
        # another rank stores (an MLA model's storage writer); this one never does, and hits
        # again once `stale_s` has passed (review 4: it stayed stale until its own store, so an
        # MLA group, which takes the least of its ranks' hits, never hit again)
        writer = backend(third.url, filled(host_pool(), 1))
        assert writer.batch_set_v1(["c0"], torch.arange(PAGE)) == [True]
        time.sleep(ours.stale_s)
        assert ours.batch_exists(["c0"]) == 1  # hits again
        assert ours.batch_set_v1(["c1"], torch.arange(PAGE)) == [True]
    finally:
        assert third.stop() == 0


def test_pages_the_sidecar_did_not_take_are_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with running(write_config(tmp_path, tenants=TENANTS)) as server:
        ours = backend(server.url, filled(host_pool(), 3))
        gone = SimpleNamespace(prefix_keys=["never-stored"])  # below a prefix kvtier lacks
        with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
            assert ours.batch_set_v1(["d0", "d1"], torch.arange(2 * PAGE), gone) == [False] * 2
        assert ours.stats["pages_not_stored"] == 2 and ours.stats["pages_set"] == 0
        assert any("2 of 2 pages not stored" in r.getMessage() for r in caplog.records)
        assert ours.batch_set_v1(["d0"], torch.arange(PAGE)) == [True]
        assert ours.stats["pages_not_stored"] == 2 and ours.stats["pages_set"] == 1


def test_ranks_said_to_share_their_kv_over_an_mha_pool_are_refused(tmp_path: Path) -> None:
    """`is_mla_model` gives the ranks one scope; an MHA pool holds each rank's own heads."""
    with running(write_config(tmp_path, tenants=TENANTS)) as server:
        with pytest.raises(ConfigError, match="is_mla_model"):
            backend(server.url, host_pool(), is_mla_model=True, tp_rank=1, tp_size=2)
        zero = backend(server.url, filled(host_pool(), 10), tp_rank=0, tp_size=2)
        assert zero.batch_set_v1(["e0"], torch.arange(PAGE)) == [True]
        one = backend(server.url, host_pool(), tp_rank=1, tp_size=2)
        assert one.batch_exists(["e0"]) == 0  # rank 0's heads are never rank 1's hit
