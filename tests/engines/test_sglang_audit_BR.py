"""kvtier's SGLang backend after audit BR: SGLang's real storage config and host pool, in this
process, one `kvtier serve` whose tenants need a key.

- A key the sidecar refuses (none given, or one it does not know) is a `ConfigError` naming
  `kvtier.api_key`, the key not shown, when SGLang builds the backend (it was a bare
  `ServiceError` "401 unauthorized" / "403 forbidden" naming no setting).
- A `kvtier.url` with a trailing `?` or `#` (an empty query or fragment, which `urlsplit`
  reads as none) is a `ConfigError` naming `kvtier.url` (it was the client's
  `InvalidArgumentError` naming `url`).
- An extra config that is not a JSON object (a list, a string, a number) is a `ConfigError`
  naming `extra_config`, its value not shown (it was a bare ValueError or TypeError).
- What held, kept: SGLang's concurrent backup and prefetch threads, each on its own chain and
  host slots, get back exactly what they set, in every MHA host layout.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_audit_BR.py
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from service_server import Server, running, write_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from test_sglang_audit3 import ALICE, PAGE, POOL, TENANTS, host_pool

from kvtier.errors import ConfigError
from kvtier.integrations import paged
from kvtier.integrations.sglang import KvtierHiCacheStorage


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("br"), tenants=TENANTS)) as server:
        yield server


def storage_config(extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny", extra_config=extra,
    )  # fmt: skip


@pytest.mark.parametrize("key", [None, "", "an-api-key-no-tenant-holds"])
def test_a_key_the_sidecar_refuses_is_a_config_error_naming_kvtier_api_key(
    sidecar: Server, key: str | None
) -> None:
    extra = {"kvtier.url": sidecar.url, "interface_v1": 1}
    if key is not None:
        extra["kvtier.api_key"] = key
    with pytest.raises(ConfigError, match=r"'kvtier.api_key'.*a key of a tenant") as refused:
        KvtierHiCacheStorage(storage_config(extra))
    assert key is None or key == "" or key not in str(refused.value)  # never shown


@pytest.mark.parametrize("tail", ["?", "#", "/?", "/#"])
def test_a_url_with_an_empty_query_or_fragment_is_a_config_error_naming_it(
    sidecar: Server, tail: str
) -> None:
    extra = {"kvtier.url": sidecar.url + tail, "kvtier.api_key": ALICE, "interface_v1": 1}
    with pytest.raises(ConfigError, match=r"'kvtier.url'.*no path, query or fragment"):
        KvtierHiCacheStorage(storage_config(extra))


@pytest.mark.parametrize("extra", [["kvtier.url"], "kvtier.url=http://x", 5])
def test_an_extra_config_that_is_not_an_object_is_a_config_error(extra: Any) -> None:
    with pytest.raises(ConfigError, match=r"'extra_config'.*not shown.*a JSON object"):
        KvtierHiCacheStorage(storage_config(extra))


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_head"])
def test_concurrent_threads_get_back_exactly_what_they_set(sidecar: Server, layout: str) -> None:
    extra = {"kvtier.url": sidecar.url, "kvtier.api_key": ALICE, "interface_v1": 1}
    backend = KvtierHiCacheStorage(storage_config(extra))
    device = MHATokenToKVPool(head_num=2, head_dim=64, **{**POOL, "size": 1024})
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False,
        device="cpu", device_capacity_tokens=device.size, start_layer=device.start_layer,
        end_layer=device.end_layer,
    )  # fmt: skip
    backend.register_mem_pool_host(host)
    pages, failures = 6, []
    slots_of = [(host.alloc(pages * PAGE), host.alloc(pages * PAGE)) for _ in range(4)]

    def worker(t: int) -> None:
        mine, back = slots_of[t]
        keys = [f"{layout}-{t}-{i}".encode().hex() for i in range(pages)]
        gen = torch.Generator().manual_seed(t)
        want = torch.randn((2, 2, pages * PAGE, 2, 64), generator=gen).to(torch.float16)
        paged.host_scatter(backend.buffer, backend.layout, mine, PAGE, want)
        for i in range(0, pages, 2):  # SGLang's backup walk: each batch under the ones before
            extra = HiCacheStorageExtraInfo(prefix_keys=keys[:i])
            assert backend.batch_set_v1(keys[i : i + 2], mine[i * PAGE : (i + 2) * PAGE], extra)
        for i, j in ((0, pages), (1, 4), (3, 6), (5, 6)) * 3:
            extra = HiCacheStorageExtraInfo(prefix_keys=keys[:i])
            slots = back[: (j - i) * PAGE]
            nan = torch.full((2, 2, len(slots), 2, 64), float("nan"), dtype=torch.float16)
            paged.host_scatter(backend.buffer, backend.layout, slots, PAGE, nan)
            got = backend.batch_get_v1(keys[i:j], slots, extra)
            kv = paged.host_gather(backend.buffer, backend.layout, slots, PAGE)
            bits, wanted = kv.view(torch.int16), want[:, :, i * PAGE : j * PAGE].view(torch.int16)
            if got != [True] * (j - i) or not torch.equal(bits, wanted):
                failures.append((t, i, j, got))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert backend.stats["errors"] == 0 and backend.stats["pages_got"] == 4 * 3 * (6 + 3 + 3 + 1)
    backend.close()


def test_no_keys_is_no_hit_and_no_error(sidecar: Server) -> None:
    """An empty batch (`batch_exists([])`) asked the sidecar a lookup of no tokens (or of the
    prefix alone), which it refused: an error counted and logged for a query that is valid."""
    extra = {"kvtier.url": sidecar.url, "kvtier.api_key": ALICE, "interface_v1": 1}
    backend = KvtierHiCacheStorage(storage_config(extra))
    backend.register_mem_pool_host(host_pool())
    assert backend.batch_exists([]) == 0
    assert backend.batch_exists([], HiCacheStorageExtraInfo(prefix_keys=["ab" * 32])) == 0
    assert backend.stats["errors"] == 0
    backend.close()
