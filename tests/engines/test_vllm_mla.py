"""kvtier's vLLM connector with an MLA model (DeepSeek's multi-head latent attention): vLLM's real
`ModelConfig` of a tiny DeepSeek-V2 (`use_mla`), its `MLAAttentionSpec` (one latent of 576
values per token and layer, no separate V), and layers viewed as vLLM's `[blocks, 1,
block_size, 576]`. The connector copies a block's bytes whatever the last dimension means
(`paged.py`): kvtier holds the latent as one "head" of K and V halves, `num_kv_heads: 1` and
`head_dim: 288`. An MLA model's tensor-parallel ranks hold the same latent: one sidecar,
unsharded, for every rank.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_mla.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_process import launch as run_engine
from engine_process import report as engine_report
from service_server import Server, running, write_mla_config

from kvtier.client import Client

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

ENGINE = Path(__file__).with_name("vllm_engine.py")
ALICE = "alice-key-0123456789abcdef"
TENANTS = {"alice": {"api_keys": [ALICE]}}
PROMPT = list(range(2000, 2040))  # 40 tokens: 2 whole vLLM blocks of 16 saved


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_mla_config(tmp_path_factory.mktemp("mla"), TENANTS)) as server:
        yield server


def engine(server: Server, **args: Any) -> dict[str, Any]:
    body = {"url": server.url, "api_key": ALICE, "prompt": PROMPT, "seed": 11, "mla": True}
    report = engine_report(run_engine(ENGINE, {**body, **args}))
    assert report["finished"] == "FINISHED_LENGTH_CAPPED", report
    assert report["computed_prompt"], report
    return report


def test_an_mla_model_loads_what_another_engine_saved_bit_exact(sidecar: Server) -> None:
    first = engine(sidecar)
    assert first["hit"] == 0 and first["stats"]["saved_tokens"] == 32
    with Client(sidecar.url, api_key=ALICE) as client:
        assert client.lookup(PROMPT).num_tokens == 32
    second = engine(sidecar)  # asynchronous load
    assert "WAITING_FOR_REMOTE_KVS" in second["statuses"], second["statuses"]
    assert second["loaded_tokens"] == 32 and second["bit_exact"] is True
    third = engine(sidecar, load_async=False)
    assert third["loaded_tokens"] == 32 and third["bit_exact"] is True


def test_an_mla_models_tensor_parallel_ranks_share_one_unsharded_sidecar(sidecar: Server) -> None:
    """Each rank holds the same latent (vLLM does not split MLA's KV by heads), so one URL
    serves a TP group, unlike a model with KV heads (`test_vllm_connector.py`)."""
    prompt = list(range(6000, 6040))
    first = engine(sidecar, prompt=prompt, tp_size=2)  # this process is rank 0
    assert first["stats"]["saved_tokens"] == 32
    again = engine(sidecar, prompt=prompt, tp_size=2)
    assert again["loaded_tokens"] == 32 and again["bit_exact"] is True


def test_a_sidecar_holding_the_latent_as_it_is_named_is_refused_with_the_layout_to_set(
    tmp_path: Path,
) -> None:
    """`head_dim: 576` (the latent's size) is not how kvtier holds it: the error names the
    layout that is (one head of 288)."""
    with running(write_mla_config(tmp_path, TENANTS, head_dim=576)) as other:
        done = run_engine(ENGINE, {"url": other.url, "api_key": ALICE, "prompt": PROMPT,
                                   "seed": 11, "mla": True})  # fmt: skip
    assert done.returncode != 0 and "config field 'model'" in done.stderr, done.stderr[-800:]
    assert "(2, 1, 288, torch.float16, 0, 1)" in done.stderr, done.stderr[-800:]
