"""kvtier's SGLang backend after audit N: an extra-config key that looks like kvtier's but is
not one (`kvtier_url`, `" kvtier.url"`, `kvtier-api_key`) is a `ConfigError` naming it and the
known keys when SGLang builds the backend, never silently ignored (the shared
`settings.closed`); SGLang's own and other backends' keys are left alone.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_audit_n.py
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from service_server import Server, running, write_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvtier.errors import ConfigError
from kvtier.integrations.sglang import KvtierHiCacheStorage


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("kvtier"))) as server:
        yield server


def storage_config(extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny", extra_config={"kvtier.url": "http://127.0.0.1:1", **extra},
    )  # fmt: skip


@pytest.mark.parametrize("key", ["kvtier_url", " kvtier.url", "kvtier-api_key", "KVTIER url"])
def test_a_key_that_looks_like_kvtiers_is_refused_naming_it(key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}': .*one of kvtier.url, kvtier.api_key"):
        KvtierHiCacheStorage(storage_config({key: "http://x"}))


def test_sglangs_own_keys_are_left_alone(sidecar: Server) -> None:
    extra = {"interface_v1": 1, "backend_name": "kvtier", "module_path": "kvtier.integrations",
             "kvtier.url": sidecar.url}  # fmt: skip
    backend = KvtierHiCacheStorage(storage_config(extra))
    assert backend.url == sidecar.url
    backend.close()
