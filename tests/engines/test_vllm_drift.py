"""Drift between kvtier's vLLM connector and the installed vLLM (issue 15): every abstract
method of `KVConnectorBase_V1` is implemented, every method we override takes the parameters
vLLM passes (names, kinds and order), and vLLM's own factory loads the class through
`kv_connector_module_path`. Run it against a newer vLLM to see what changed:

    bash tests/engines/install.sh vllm          # after editing the vllm pin in
    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm python -m pytest tests/engines/test_vllm_drift.py
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvtier.integrations.vllm import KvtierConnector


def shape(function: object) -> list[tuple[str, object]]:
    """A signature's parameter names and kinds, in order (annotations and defaults aside)."""
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


def test_every_abstract_method_is_implemented() -> None:
    assert KVConnectorBase_V1.__abstractmethods__  # vLLM still declares some
    assert not KvtierConnector.__abstractmethods__


def test_every_method_we_override_takes_what_vllm_passes() -> None:
    overridden = [
        name
        for name, member in vars(KvtierConnector).items()
        if callable(member) and hasattr(KVConnectorBase_V1, name) and not name.startswith("__")
    ]
    overridden.append("__init__")
    assert "get_num_new_matched_tokens" in overridden and "start_load_kv" in overridden
    drifted = {
        name: (shape(getattr(KVConnectorBase_V1, name)), shape(getattr(KvtierConnector, name)))
        for name in overridden
        if shape(getattr(KVConnectorBase_V1, name)) != shape(getattr(KvtierConnector, name))
    }
    assert not drifted, drifted
    base = inspect.getattr_static(KVConnectorBase_V1, "requires_kv_delivery")
    assert isinstance(base, property)  # we answer it as a property too


def test_vllms_factory_loads_the_connector_by_module_path() -> None:
    config = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
    )
    assert KVConnectorFactory.get_connector_class(config) is KvtierConnector
