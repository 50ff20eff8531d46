"""kvtier's SGLang backend against audit X (SGLang's real host pool classes, in this process, one
`kvtier serve`):

- Host indices must be an int64 or int32 vector: torch indexes with a uint8 tensor as a mask,
  and a narrower dtype wraps the bounds check, so a uint8 vector of "slot 1" as long as the pool
  stored every slot of the pool under the keys (`paged._integer_vector`). Refused, a miss.
- `kvtier.url` with a path, query, fragment or user is a `ConfigError` naming it (a path
  failed later as a 404 naming nothing; a user's password is never shown).

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_audit4.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from service_server import Server, running, write_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from test_sglang_audit3 import PAGE, TENANTS, host_pool, storage_config

from kvtier.errors import ConfigError
from kvtier.integrations.sglang import KvtierHiCacheStorage


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("mha4"), tenants=TENANTS)) as server:
        yield server


def test_a_uint8_vector_of_host_slots_is_refused_not_taken_as_a_mask(sidecar: Server) -> None:
    host = host_pool()
    backend = KvtierHiCacheStorage(storage_config(sidecar.url, model_name="uint8"))
    backend.register_mem_pool_host(host)
    capacity = host.kv_buffer.shape[1]  # page_first: [2, slots, layers, heads, dim]
    keys = [f"{9000 + i:064x}" for i in range(capacity // PAGE)]
    asked = torch.ones(capacity, dtype=torch.uint8)  # slot 1, again and again
    assert backend.batch_set_v1(keys, asked) == [False] * len(keys)
    assert backend.batch_exists(keys) == 0 and backend.stats["errors"] >= 1
    for narrow in (torch.int8, torch.int16, torch.uint8):  # a page at slots 8..15, in range
        slots = torch.arange(PAGE, 2 * PAGE, dtype=narrow)
        assert backend.batch_set_v1(keys[:1], slots) == [False]
    assert backend.batch_set_v1(keys[:1], torch.arange(PAGE, 2 * PAGE)) == [True]  # int64
    backend.close()


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8750/some/path", "http://127.0.0.1:8750?x=1", "http://127.0.0.1:8750#f",
     "http://user:hunter2-secret@127.0.0.1:8750"],
)  # fmt: skip
def test_a_url_with_more_than_host_and_port_is_refused_naming_kvtier_url(url: str) -> None:
    config = storage_config("", extra_config={"kvtier.url": url})
    with pytest.raises(ConfigError, match=r"'kvtier\.url'") as info:
        KvtierHiCacheStorage(config)
    assert "hunter2" not in str(info.value)
