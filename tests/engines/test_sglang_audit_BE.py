"""kvtier's SGLang backend against audit BE: SGLang's real host pool and storage config, in
this process (the pool on CPU, no controller), a real `kvtier serve`.

- A sidecar that does not answer yet when SGLang builds the backend (started beside it, as a
  pod's containers are, or restarting) is waited for, as a vLLM worker waits: SGLang's start
  used to fail at once on the bare `TransportError` of `GET /v1/pools`. One that never comes
  is a `ConfigError` naming `kvtier.url`.
- SGLang walks a sequence in batches of 128 pages, passing every page before a batch as its
  prefix: each call mapped the whole chain's keys anew (quadratic: 8.7 s of hashing per walk
  of a 1M-token sequence at page 64). Each page is now mapped once per walk, and a chain is
  reused only when its every key matches.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_audit_BE.py
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from service_server import Server, free_port, running, start, write_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from test_sglang_audit3 import PAGE, TENANTS, built, fill, host_pool, pages_at
from test_sglang_audit_F import storage_config

from kvtier.errors import ConfigError
from kvtier.integrations import lookups
from kvtier.integrations.sglang import KvtierHiCacheStorage


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("be"), tenants=TENANTS)) as server:
        yield server


def test_a_sidecar_that_starts_after_sglang_is_waited_for(tmp_path: Path) -> None:
    port, servers = free_port(), []
    config = write_config(tmp_path, tenants=TENANTS)
    later = threading.Timer(1.0, lambda: servers.append(start(config, port=port)))
    later.start()
    try:
        backend = KvtierHiCacheStorage(storage_config(f"http://127.0.0.1:{port}"))
        host = host_pool()
        backend.register_mem_pool_host(host)
        slots = fill(host, seed=7, pages=2)
        keys = [f"{i:064x}" for i in (71, 72)]
        assert backend.batch_set_v1(keys, slots) == [True, True]
        back = host.alloc(2 * PAGE)
        assert backend.batch_get_v1(keys, back) == [True, True]
        assert torch.equal(pages_at(host, back), pages_at(host, slots))
        backend.close()
    finally:
        later.join()
        for server in servers:
            server.stop()


def test_a_sidecar_that_never_answers_is_a_config_error_naming_the_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lookups, "START_WAIT_S", 1.0)  # (`lookups.at_start`)
    url = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"'kvtier.url'.*within 1 s of SGLang's start"):
        KvtierHiCacheStorage(storage_config(url))
    assert 0.9 < time.monotonic() - began < 10


def walk(backend: Any, keys: list[str], call: Any, batch: int = 4) -> list[Any]:
    """SGLang's walk of a sequence (`_storage_hit_query`, `_page_backup`): batches of `batch`
    keys, each passed the keys before it."""
    answers = []
    for i in range(0, len(keys), batch):
        extra = HiCacheStorageExtraInfo(prefix_keys=keys[:i])
        answers.append(call(keys[i : i + batch], extra))
    return answers


def test_a_walk_maps_each_page_once_and_serves_the_same_pages(sidecar: Server) -> None:
    backend = KvtierHiCacheStorage(storage_config(sidecar.url))
    host = host_pool()
    backend.register_mem_pool_host(host)
    assert backend.pages is not None
    mapped: list[bytes | str] = []
    page = backend.pages.page

    def counted(key: bytes | str) -> list[int]:  # SGLang's keys as they are mapped
        mapped.append(key)
        return page(key)

    backend.pages.page = counted  # type: ignore[method-assign]
    keys = [f"{i:064x}" for i in range(900, 916)]
    slots = fill(host, seed=9, pages=16)
    stored = walk(backend, keys, lambda k, e: backend.batch_set_v1(k, slots[: len(k) * PAGE], e))
    assert mapped == keys  # each page once (it was 4 + 8 + 12 + 16 = 40 for 16 pages)
    mapped.clear()
    assert walk(backend, keys, backend.batch_exists) == [4, 4, 4, 4]
    assert len(mapped) == 16
    assert stored == [[True] * 4] * 4
    # the pages stored batch by batch: read back whole, bit-exact, as one chain
    back = host.alloc(16 * PAGE)
    # (each batch above stored slots[:4 pages]: the pages' KV is those 4 pages, 4 times)
    assert backend.batch_get_v1(keys, back) == [True] * 16
    want = pages_at(host, slots[: 4 * PAGE])
    assert torch.equal(pages_at(host, back), torch.cat([want] * 4, dim=1))
    # another prefix that ends in the same key is no chain kept: mapped anew, not found
    other = [f"{i:064x}" for i in (1, 2, 3)] + [keys[3]]
    assert backend.batch_exists(keys[4:8], HiCacheStorageExtraInfo(prefix_keys=other)) == 0
    assert backend.batch_exists(keys[4:8], HiCacheStorageExtraInfo(prefix_keys=keys[:4])) == 4
    backend.close()


@pytest.mark.parametrize("page", [1, 4, 2**16 + 4])
def test_a_page_size_kvtier_cannot_key_names_the_page_size_first(
    sidecar: Server, page: int
) -> None:
    """SGLang's default page size is 1: the backend asked for a sidecar of `block_tokens` 1
    (a restart that drops every block), which then failed anyway on the page size (a bare
    `page_tokens` error); a page of 4 tokens, a divisor's multiple, got only the latter."""
    pool = built(MHATokenToKVPoolHost, torch.zeros(2, 64, 2, 2, 64, dtype=torch.float16),
                 page_size=page)  # fmt: skip
    backend = KvtierHiCacheStorage(storage_config(sidecar.url))
    with pytest.raises(ConfigError, match=rf"'--page-size': got {page}, expected 8 to 65536"):
        backend.register_mem_pool_host(pool)
    assert backend.pages is None
    backend.close()
