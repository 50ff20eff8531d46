"""Drift between kvtier's SGLang backend and the installed SGLang (issue 15): every abstract
method of `HiCacheStorage` is implemented, every method we override takes the parameters
SGLang passes (names, kinds, order), and SGLang's own `StorageBackendFactory` builds the class
from the `dynamic` backend's extra config. Run it against a newer SGLang to see what changed
(edit the pin in tests/engines/requirements-sglang.txt, rerun install.sh)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
from service_server import Server, running, write_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvtier.integrations.sglang import KvtierHiCacheStorage


def shape(function: object) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


def test_every_abstract_method_is_implemented_with_sglangs_parameters() -> None:
    assert HiCacheStorage.__abstractmethods__
    assert not KvtierHiCacheStorage.__abstractmethods__
    overridden = [
        name
        for name, member in vars(KvtierHiCacheStorage).items()
        if callable(member) and hasattr(HiCacheStorage, name) and not name.startswith("__")
    ]
    assert {"batch_exists", "batch_get_v1", "batch_set_v1", "register_mem_pool_host"} <= set(
        overridden
    )
    drifted = {
        name: (shape(getattr(HiCacheStorage, name)), shape(getattr(KvtierHiCacheStorage, name)))
        for name in overridden
        if shape(getattr(HiCacheStorage, name)) != shape(getattr(KvtierHiCacheStorage, name))
    }
    assert not drifted, drifted


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_config(tmp_path_factory.mktemp("kvtier"))) as server:
        yield server


def test_sglangs_factory_builds_the_backend_from_the_dynamic_extra_config(sidecar: Server) -> None:
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "kvtier.url": sidecar.url,
    }
    config = HiCacheStorageConfig(
        tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny", extra_config=extra,
    )  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(backend, KvtierHiCacheStorage)
    assert backend.scope == 'model="tiny" tp1/2'  # each rank's heads under keys of their own
    backend.close()
