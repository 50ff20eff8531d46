"""kvtier's SGLang backend against audit K: SGLang's real host pool classes and storage config,
in this process (the pools on CPU, no controller), one `kvtier serve` per model.

- Only the host pools whose whole page lives in `kv_buffer` are taken: the MXFP8 pool (its
  per-page scales in `k_scale_host`/`v_scale_host`, which kvtier would not move), the
  asymmetric pool (K and V of different head dims, two buffers) and any other subclass are a
  `ConfigError` naming the class at registration, never an AttributeError or wrong KV.
- The keys' scope names the model (two models of one geometry never read each other's KV)
  and the attention context-parallel and decode context-parallel ranks, which hold different
  slices of every page (each rank gets its own slice back, never another's).
- `kvtier.url` is checked by the backend (http or https, a host, a port in range): a
  `ConfigError` naming it; `KVTIER.url` (any case of the prefix) is refused, not ignored.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_audit3.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from service_server import Server, running, write_config, write_mla_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import (
    AsymmetricMHATokenToKVPoolHost,
    HiSparseMHATokenToKVPoolHost,
    MHATokenToKVPoolHost,
)
from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvtier.errors import ConfigError
from kvtier.integrations import sglang
from kvtier.integrations.sglang import KvtierHiCacheStorage

ALICE = "alice-key-0123456789abcdef"
TENANTS = {"alice": {"api_keys": [ALICE]}}
PAGE, LAYERS = 8, 2
POOL = {"size": 256, "page_size": PAGE, "dtype": torch.float16, "layer_num": LAYERS,
        "device": "cpu", "enable_memory_saver": False}  # fmt: skip


def storage_config(url: str, **fields: Any) -> HiCacheStorageConfig:
    values: dict[str, Any] = {
        "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0,
        "attn_cp_size": 1, "is_mla_model": False, "enable_storage_metrics": False,
        "is_page_first_layout": True, "model_name": "tiny",
        "extra_config": {"kvtier.url": url, "kvtier.api_key": ALICE},
    }  # fmt: skip
    return HiCacheStorageConfig(**{**values, **fields})


def host_pool(mla: bool = False, layout: str = "page_first", dtype: Any = torch.float16) -> Any:
    """SGLang's own host pool of the tiny model (MHA: 2 heads of 64; MLA: a 576 latent), in
    host `layout`, of a KV cache of `dtype`."""
    pool = {**POOL, "dtype": dtype}
    if mla:
        device: Any = MLATokenToKVPool(kv_lora_rank=512, qk_rope_head_dim=64, **pool)
        host_class, more = MLATokenToKVPoolHost, {"target_layer_num": LAYERS}
    else:
        device = MHATokenToKVPool(head_num=2, head_dim=64, **pool)
        host_class, more = MHATokenToKVPoolHost, {}
    return host_class(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
        pin_memory=False, device="cpu", device_capacity_tokens=device.size,
        start_layer=device.start_layer, end_layer=device.end_layer, **more,
    )  # fmt: skip


def built(cls: type, kv_buffer: Any, **fields: Any) -> Any:
    """A pool of `cls` with the attributes its `__init__` sets (some need CUDA to build)."""
    pool: Any = object.__new__(cls)
    values = {"layout": "page_first", "page_size": PAGE, "layer_num": LAYERS, "head_num": 2,
              "head_dim": 64, "v_head_dim": 64, "dtype": torch.float16, "size": 64,
              "page_num": 64 // PAGE, "kv_buffer": kv_buffer}  # fmt: skip
    pool.__dict__.update({**values, **fields})
    return pool


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("mha"), tenants=TENANTS)) as server:
        yield server


@pytest.fixture(scope="module")
def fp8_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model in fp8: the MXFP8 pool's payload dtype (its layout check passes)."""
    path = write_config(tmp_path_factory.mktemp("fp8"), tenants=TENANTS)
    config = yaml.safe_load(path.read_text())
    config["model"]["dtype"] = "float8_e4m3fn"
    path.write_text(yaml.safe_dump(config))
    with running(path) as server:
        yield server


@pytest.fixture(scope="module")
def mla_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_mla_config(tmp_path_factory.mktemp("mla"), TENANTS)) as server:
        yield server


def fill(host: Any, seed: int, pages: int = 2) -> torch.Tensor:
    """`pages` host pages allocated and filled with KV of `seed`; their slots."""
    slots: torch.Tensor = host.alloc(pages * PAGE)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(host.kv_buffer[..., slots, :, :, :].shape, generator=gen)
    if host.kv_buffer.dim() == 4:  # MLA page_first: [slots, layers, 1, C]
        host.kv_buffer[slots] = values.to(host.kv_buffer.dtype)
    else:  # MHA page_first: [2, slots, layers, heads, dim]
        host.kv_buffer[:, slots] = values.to(host.kv_buffer.dtype)
    return slots


def pages_at(host: Any, slots: torch.Tensor) -> torch.Tensor:
    buffer: torch.Tensor = host.kv_buffer
    return (buffer[slots] if buffer.dim() == 4 else buffer[:, slots]).clone()


def test_the_mxfp8_pool_whose_scales_live_outside_kv_buffer_is_refused(
    fp8_sidecar: Server,
) -> None:
    scales = torch.zeros(8, LAYERS, 16, dtype=torch.uint8)
    pool = built(MHATokenToKVPoolMXFP8Host,
                 torch.zeros(2, 64, LAYERS, 2, 64, dtype=torch.float8_e4m3fn),
                 k_scale_host=scales, v_scale_host=scales.clone())  # fmt: skip
    backend = KvtierHiCacheStorage(storage_config(fp8_sidecar.url))
    with pytest.raises(ConfigError, match=r"MHATokenToKVPoolMXFP8Host.*k_scale_host"):
        backend.register_mem_pool_host(pool)
    assert backend.pages is None  # no page can move
    backend.close()


def test_an_asymmetric_pool_is_a_config_error_not_an_attribute_error(sidecar: Server) -> None:
    pool = built(AsymmetricMHATokenToKVPoolHost,
                 (torch.zeros(64, LAYERS, 2, 64, dtype=torch.float16),
                  torch.zeros(64, LAYERS, 2, 32, dtype=torch.float16)),
                 v_head_dim=32)  # fmt: skip
    backend = KvtierHiCacheStorage(storage_config(sidecar.url))
    with pytest.raises(ConfigError, match=r"AsymmetricMHATokenToKVPoolHost.*head dims"):
        backend.register_mem_pool_host(pool)
    backend.close()


def test_any_other_subclass_of_the_mha_pool_is_refused(sidecar: Server) -> None:
    class Unknown(MHATokenToKVPoolHost):  # type: ignore[misc]
        pass  # may keep part of a page where kvtier would not look

    buffer = torch.zeros(2, 64, LAYERS, 2, 64, dtype=torch.float16)
    for cls in (Unknown, HiSparseMHATokenToKVPoolHost):
        backend = KvtierHiCacheStorage(storage_config(sidecar.url))
        with pytest.raises(ConfigError, match=f"'mem_pool_host': got '{cls.__name__}'"):
            backend.register_mem_pool_host(built(cls, buffer))
        backend.close()
    backend = KvtierHiCacheStorage(storage_config(sidecar.url))
    backend.register_mem_pool_host(host_pool())  # the pool itself: taken
    backend.close()


def test_two_models_of_one_geometry_never_read_each_others_pages(sidecar: Server) -> None:
    keys = [f"{i:064x}" for i in (31, 32)]
    ours, theirs, twin = (KvtierHiCacheStorage(storage_config(sidecar.url, model_name=name))
                          for name in ("org/model-a", "org/model-b", "org/model-a"))  # fmt: skip
    hosts = [host_pool() for _ in range(3)]
    for backend, host in zip((ours, theirs, twin), hosts, strict=True):
        backend.register_mem_pool_host(host)
    slots = fill(hosts[0], seed=1)
    assert ours.batch_set_v1(keys, slots) == [True, True]
    assert theirs.batch_exists(keys) == 0  # another model's KV under the same keys: not served
    assert theirs.batch_get_v1(keys, hosts[1].alloc(2 * PAGE)) == [False, False]
    out = hosts[2].alloc(2 * PAGE)
    assert twin.batch_exists(keys) == 2 and twin.batch_get_v1(keys, out) == [True, True]
    assert torch.equal(pages_at(hosts[2], out), pages_at(hosts[0], slots))
    for backend in (ours, theirs, twin):
        backend.close()


@pytest.mark.parametrize("parallel", ["cp", "dcp"])
def test_context_parallel_ranks_each_get_their_own_slice(
    mla_sidecar: Server, parallel: str
) -> None:
    """Each rank of an MLA model under attention context parallelism (NSA-CP) or decode context
    parallelism holds another slice of every page: under the same keys, each backs up its own
    and is served its own, never the other rank's."""
    base = storage_config(mla_sidecar.url, is_mla_model=True)
    keys = [f"{i:064x}" for i in ((41, 42) if parallel == "cp" else (43, 44))]
    ranks, hosts, wrote = [], [], []
    for rank in (0, 1):
        if parallel == "dcp":
            config = dataclasses.replace(base, tp_size=2, tp_rank=rank, dcp_size=2,
                                         dcp_rank=rank, logical_page_size=2 * PAGE)  # fmt: skip
        else:
            config = dataclasses.replace(base, tp_size=2, tp_rank=rank, attn_cp_rank=rank,
                                         attn_cp_size=2)  # fmt: skip
        backend, host = KvtierHiCacheStorage(config), host_pool(mla=True)
        backend.register_mem_pool_host(host)
        slots = fill(host, seed=100 + rank)
        assert backend.batch_set_v1(keys, slots) == [True, True], rank
        ranks.append(backend)
        hosts.append(host)
        wrote.append(pages_at(host, slots))
    for rank, (backend, host) in enumerate(zip(ranks, hosts, strict=True)):
        out = host.alloc(2 * PAGE)
        assert backend.batch_get_v1(keys, out) == [True, True], rank
        assert torch.equal(pages_at(host, out), wrote[rank]), rank
        backend.close()
    assert ranks[0].scope != ranks[1].scope


def test_the_scope_names_the_model_and_each_rank_an_older_sglang_lacks_none() -> None:
    scope = sglang.scope
    config = storage_config("http://127.0.0.1:1", model_name="org/m", tp_rank=1, tp_size=2)
    assert scope(config) == 'model="org/m" tp1/2'
    assert scope(dataclasses.replace(config, pp_rank=1, pp_size=2)) == 'model="org/m" tp1/2 pp1/2'
    mla = dataclasses.replace(config, is_mla_model=True, attn_cp_rank=1, attn_cp_size=2)
    assert scope(mla) == 'model="org/m" mla cp1/2'
    older = SimpleNamespace(is_mla_model=False, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    assert scope(older) == "model=null tp0/1"  # no model_name, no context-parallel fields
    assert scope(dataclasses.replace(config, model_name='a" tp1/2')) != scope(config)


@pytest.mark.parametrize(
    "url",
    ["ftp://x", "not a url", "unix:///tmp/x.sock", "http://[::1", "http://h:99999",
     "http://127.0.0.1:0", "http://h:port", "http://", "http://h :1", 8750, "", None],
)  # fmt: skip
def test_a_bad_url_is_a_config_error_naming_kvtier_url(url: Any) -> None:
    config = storage_config("", extra_config={"kvtier.url": url})
    with pytest.raises(ConfigError, match=r"'kvtier\.url'"):
        KvtierHiCacheStorage(config)


@pytest.mark.parametrize("key", ["KVTIER.url", "Kvtier.api_key", "kvtier.URL"])
def test_a_kvtier_key_in_another_case_is_refused_not_ignored(key: str) -> None:
    config = storage_config("", extra_config={key: "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match=f"'{key}'.*kvtier.url"):
        KvtierHiCacheStorage(config)


def test_a_good_url_still_reaches_the_sidecar(sidecar: Server) -> None:
    backend = KvtierHiCacheStorage(storage_config(sidecar.url.replace("127.0.0.1", "localhost")))
    backend.register_mem_pool_host(host_pool())
    assert backend.batch_exists([f"{7:064x}"]) == 0 and backend.stats["errors"] == 0
    backend.close()
