"""kvtier's vLLM connector after audit N, with vLLM 0.33's real `VllmConfig` and a real
`kvtier serve` of the tiny MLA model:

- Pipeline and context parallelism are refused when vLLM builds the connector (scheduler and
  worker), with a `ConfigError` naming the setting and its value: their ranks hold other layers
  (PP) or other tokens of each block (DCP, PCP) under one tensor-parallel rank, which kvtier's
  keys do not tell apart. Before, an MLA model under DCP (or any model under PP) started, and a
  second engine's rank loaded another rank's KV bit for bit.
- KV tensors viewed in kernel blocks smaller than vLLM's `block_size` are refused at
  `register_kv_caches`, naming both sizes; before, they were accepted and then every save and
  load failed. Tensors in vLLM's own blocks are still accepted.
- `kvtier.url` / `kvtier.urls`: both set, an empty list, or a URL that is not a string is a
  `ConfigError` naming the key the operator wrote.
- A key that looks like kvtier's (`kvtier_url`, `" kvtier.url"`) is refused, not ignored;
  another connector's key is left alone.
- A layer that is not 4-D is refused with a message naming the four dimensions expected.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_audit_n.py
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from service_server import Server, running, write_mla_config

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

import vllm_engine as ve
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtier.errors import ConfigError, InvalidKVError
from kvtier.integrations import paged
from kvtier.integrations.vllm import KvtierConnector

ALICE = "alice-key-0123456789abcdef"
WORKER, SCHEDULER = KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER
SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size",
         "prefill_context_parallel_size")  # fmt: skip


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_mla_config(tmp_path_factory.mktemp("kvtier"), {"alice": {"api_keys": [ALICE]}})
    with running(config) as server:
        yield server


@pytest.fixture(scope="module")
def built(sidecar: Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A real VllmConfig of the tiny MLA model (one sidecar URL) and its KV cache config."""
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps(ve.MLA_MODEL))
    scheduler, _, kv_cache_config = ve.build(
        {"url": sidecar.url, "api_key": ALICE, "mla": True}, model
    )
    return scheduler.vllm_config, kv_cache_config


@pytest.fixture
def config(built: tuple[Any, Any]) -> Iterator[Any]:
    """The module's VllmConfig; what a test changes of it is put back."""
    vllm_config = built[0]
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    sizes = {name: getattr(parallel, name) for name in SIZES}
    block, extra = cache.block_size, vllm_config.kv_transfer_config.kv_connector_extra_config
    yield vllm_config
    for name, value in sizes.items():
        setattr(parallel, name, value)
    cache.block_size = block
    vllm_config.kv_transfer_config.kv_connector_extra_config = extra


def mla_layers(block: int) -> dict[str, torch.Tensor]:
    shape = (64, 1, block, ve.LATENT)
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.float16)
            for i in range(ve.LAYERS)}  # fmt: skip


@pytest.mark.parametrize(
    "setting",
    [
        {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2},
    ],
)
def test_pipeline_and_context_parallelism_are_refused_at_start(
    config: Any, built: tuple[Any, Any], setting: dict[str, int]
) -> None:
    for name, value in setting.items():
        setattr(config.parallel_config, name, value)
    split = next(name for name in setting if name != "tensor_parallel_size")
    for role in (WORKER, SCHEDULER):
        with pytest.raises(ConfigError, match=rf"'parallel_config\.{split}': got 2, expected 1"):
            KvtierConnector(config, role, built[1])


def test_kernel_blocks_smaller_than_vllms_are_refused_naming_both(
    config: Any, built: tuple[Any, Any]
) -> None:
    worker = KvtierConnector(config, WORKER, built[1])
    worker.register_kv_caches(mla_layers(ve.BLOCK))  # vLLM's own blocks: accepted
    worker.shutdown()
    config.cache_config.block_size = 2 * ve.BLOCK  # vLLM's blocks of 32 as kernel blocks of 16
    worker = KvtierConnector(config, WORKER, built[1])
    with pytest.raises(ConfigError, match=r"'cache_config\.block_size': got 32, .*size, 16"):
        worker.register_kv_caches(mla_layers(ve.BLOCK))
    worker.shutdown()


@pytest.mark.parametrize(
    ("extra", "field", "expected"),
    [
        ({"kvtier.urls": []}, "kvtier.urls", "a non-empty list"),
        ({"kvtier.url": "http://127.0.0.1:1"}, "kvtier.url", "unset when kvtier.urls is set"),
        ({"kvtier.urls": None, "kvtier.url": 5}, "kvtier.url", "the sidecar's URL, a string"),
        ({"kvtier_url": "http://x"}, "kvtier_url", "one of kvtier.url, kvtier.urls"),
        ({" kvtier.url": "http://x"}, " kvtier.url", "one of kvtier.url, kvtier.urls"),
    ],
)
def test_sidecar_urls_and_near_miss_keys_are_config_errors_naming_the_key(
    config: Any, built: tuple[Any, Any], extra: dict[str, Any], field: str, expected: str
) -> None:
    given = {**config.kv_transfer_config.kv_connector_extra_config, **extra}
    config.kv_transfer_config.kv_connector_extra_config = {
        k: v for k, v in given.items() if v is not None
    }
    with pytest.raises(ConfigError, match=f"config field '{field}': .*expected {expected}"):
        KvtierConnector(config, SCHEDULER, built[1])


def test_other_connectors_keys_are_left_alone(config: Any, built: tuple[Any, Any]) -> None:
    extra = config.kv_transfer_config.kv_connector_extra_config
    config.kv_transfer_config.kv_connector_extra_config = {**extra, "connectors": [],
                                                           "handshake_port": 5}  # fmt: skip
    KvtierConnector(config, SCHEDULER, built[1]).shutdown()


def test_a_layer_not_4d_names_the_dimensions_expected() -> None:
    layers = [torch.zeros(64, 16, 128), torch.zeros(64, 16, 128)]
    with pytest.raises(InvalidKVError, match=r"3 dimensions \(64, 16, 128\), expected 4: \["):
        paged.geometry(layers)
