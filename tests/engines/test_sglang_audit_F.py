"""kvtier's SGLang backend against audit F: SGLang's real pool classes and storage config in
this process (the pools on CPU, no controller), a real `kvtier serve` per model.

- A key of the extra config that looks like kvtier's but is not one is refused naming the
  key, never showing its value: a misspelt `kvtier.api_key` holds the tenant's API key, which
  the error (printed by SGLang at start, kept in its logs) used to carry in full.
- Without `"interface_v1": 1` SGLang calls the copying `batch_get` / `batch_set`, which kvtier
  does not serve: the backend says so at start (an error log naming the key) and counts each
  such call in `stats["errors"]`; it used to raise a bare NotImplementedError per call, the
  counters at 0, so a backend that moved no page looked healthy.
- An fp8 KV cache (`--kv-cache-dtype fp8_e4m3`): SGLang's pools keep its bytes as uint8, so
  the backend refused every fp8 SGLang at start, asking the sidecar for a `uint8` dtype that
  kvtier's config does not have. A uint8 host pool under an fp8 sidecar is now copied as the
  sidecar's fp8, bit for bit, in each host layout, MLA's latent too, and through SGLang's own
  controller (`sglang_engine.py`: its backup thread writes, another's prefetch reads).

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_audit_F.py
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from engine_process import launch, report
from service_server import Server, running, write_config, write_mla_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from test_sglang_audit3 import host_pool

from kvtier.errors import ConfigError
from kvtier.integrations.sglang import KvtierHiCacheStorage

ENGINE = Path(__file__).with_name("sglang_engine.py")
ALICE = "alice-key-0123456789abcdef"
SECRET = "a-secret-api-key-0123456789"
TENANTS = {"alice": {"api_keys": [ALICE]}}
PAGE = 8
FP8 = torch.float8_e4m3fn


def storage_config(url: str, v1: bool = True, extra: dict[str, str] | None = None) -> Any:
    more: dict[str, Any] = {"interface_v1": 1} if v1 else {}
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny",
        extra_config={"kvtier.url": url, "kvtier.api_key": ALICE, **more, **(extra or {})},
    )  # fmt: skip


def fp8_config(path: Path) -> Path:
    config = yaml.safe_load(path.read_text())
    config["model"]["dtype"] = "float8_e4m3fn"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def fp8_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model (2 layers, 2 heads of 64) in fp8."""
    with running(fp8_config(write_config(tmp_path_factory.mktemp("fp8"), tenants=TENANTS))) as s:
        yield s


@pytest.fixture(scope="module")
def fp8_mla_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny MLA model (a 576 latent as one head of 288) in fp8."""
    path = write_mla_config(tmp_path_factory.mktemp("fp8-mla"), TENANTS, dtype="float8_e4m3fn")
    with running(path) as server:
        yield server


def fp8_host_pool(layout: str, mla: bool = False) -> Any:
    """SGLang's own host pool of an fp8 KV cache (whose bytes it keeps as uint8)."""
    host = host_pool(mla, layout, FP8)
    assert host.kv_buffer.dtype == torch.uint8  # SGLang's store dtype for fp8
    return host


def pages(host: Any, slots: torch.Tensor) -> torch.Tensor:
    """The bytes of host slots `slots` (whole pages), by SGLang's dims of the pool's layout."""
    by_page = host.layout not in ("layer_first", "page_first")
    index = slots[::PAGE] // PAGE if by_page else slots
    axis = (1 if host.layout == "layer_first" else 0) + (type(host) is MHATokenToKVPoolHost)
    picked: torch.Tensor = host.kv_buffer.index_select(axis, index)
    return picked


def test_a_misspelt_keys_value_is_never_shown() -> None:
    for key in ("kvtier_api_key", "kvtier.apikey", "KVTIER.api_key"):
        with pytest.raises(ConfigError, match=f"'{key}'.*kvtier.api_key") as refused:
            KvtierHiCacheStorage(storage_config("http://127.0.0.1:1", extra={key: SECRET}))
        assert SECRET not in str(refused.value), key


def test_without_interface_v1_the_start_says_so_and_each_copying_call_is_an_error(
    fp8_sidecar: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="kvtier.sglang"):
        backend = KvtierHiCacheStorage(storage_config(fp8_sidecar.url, v1=False))
    assert any("interface_v1" in r.getMessage() for r in caplog.records), caplog.text
    keys = [f"{1:064x}"]
    for call in (lambda: backend.batch_set(keys), lambda: backend.batch_get(keys),
                 lambda: backend.get(keys[0]), lambda: backend.set(keys[0])):  # fmt: skip
        with pytest.raises(NotImplementedError, match="interface_v1"):
            call()
    assert backend.stats["errors"] == 4
    backend.close()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kvtier.sglang"):
        KvtierHiCacheStorage(storage_config(fp8_sidecar.url)).close()
    assert not caplog.records  # set: nothing said


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_an_fp8_kv_cache_round_trips_bit_exact(fp8_sidecar: Server, layout: str) -> None:
    writer, reader = fp8_host_pool(layout), fp8_host_pool("page_first_direct")
    keys = [f"{layout}-{i}" for i in range(2)]
    ours, theirs = (KvtierHiCacheStorage(storage_config(fp8_sidecar.url)) for _ in range(2))
    ours.register_mem_pool_host(writer)
    theirs.register_mem_pool_host(reader)
    slots = writer.alloc(2 * PAGE)
    gen = torch.Generator().manual_seed(7)
    every_byte = torch.randint(0, 256, writer.kv_buffer.shape, generator=gen, dtype=torch.uint8)
    writer.kv_buffer.copy_(every_byte)  # NaN and -0 encodings too: bytes, never values
    assert ours.batch_set_v1(keys, slots) == [True, True]
    out = reader.alloc(2 * PAGE)
    assert theirs.batch_get_v1(keys, out) == [True, True]
    back = fp8_host_pool(layout)  # the writer's layout again, read back through kvtier
    again = KvtierHiCacheStorage(storage_config(fp8_sidecar.url))
    again.register_mem_pool_host(back)
    into = back.alloc(2 * PAGE)
    assert again.batch_get_v1(keys, into) == [True, True]
    assert torch.equal(pages(back, into), pages(writer, slots))
    for backend in (ours, theirs, again):
        assert backend.stats["errors"] == 0
        backend.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_an_fp8_mla_latent_round_trips_bit_exact(fp8_mla_sidecar: Server, layout: str) -> None:
    config = storage_config(fp8_mla_sidecar.url)
    config.is_mla_model = True
    writer, reader = fp8_host_pool(layout, mla=True), fp8_host_pool(layout, mla=True)
    ours, theirs = KvtierHiCacheStorage(config), KvtierHiCacheStorage(config)
    ours.register_mem_pool_host(writer)
    theirs.register_mem_pool_host(reader)
    slots = writer.alloc(2 * PAGE)
    gen = torch.Generator().manual_seed(8)
    writer.kv_buffer.copy_(torch.randint(0, 256, writer.kv_buffer.shape, generator=gen,
                                         dtype=torch.uint8))  # fmt: skip
    keys = [f"mla-{layout}-{i}" for i in range(2)]
    assert ours.batch_set_v1(keys, slots) == [True, True]
    out = reader.alloc(2 * PAGE)
    assert theirs.batch_get_v1(keys, out) == [True, True]
    assert torch.equal(pages(reader, out), pages(writer, slots))
    ours.close()
    theirs.close()


def test_sglangs_controller_backs_up_and_prefetches_an_fp8_cache_bit_exact(
    fp8_sidecar: Server,
) -> None:
    tokens = list(range(700, 732))  # 4 pages of 8
    body = {"url": fp8_sidecar.url, "api_key": ALICE, "seed": 9, "tokens": tokens,
            "dtype": "float8_e4m3fn"}  # fmt: skip
    wrote = report(launch(ENGINE, {**body, "mode": "write"}))
    assert wrote["completed_tokens"] == 32 and wrote["stats"]["errors"] == 0
    read = report(launch(ENGINE, {**body, "mode": "read", "layout": "page_head"}))
    assert read["hit_tokens"] == 32 and read["completed_tokens"] == 32
    assert read["bit_exact"] is True and read["stats"]["errors"] == 0
