"""`kvtier.model` through vLLM's real scheduler and worker: a worker whose sidecar serves a
model of another name (same geometry: a base model and its fine-tune) fails at start naming
the key, and one whose sidecar's `model.name` is the one named runs and saves as before.
Without the key vLLM's KV was loaded from whatever model of that geometry the sidecar held.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_process import launch as run_engine
from engine_process import report as engine_report
from service_server import MODEL, Server, running, write_config

from kvtier.client import Client

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

ENGINE = Path(__file__).with_name("vllm_engine.py")
ALICE = "alice-key-0123456789abcdef"
PROMPT = list(range(3000, 3040))  # 40 tokens: 2 whole vLLM blocks (32 tokens) are saved


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(tmp_path_factory.mktemp("kvtier"), tenants={"a": {"api_keys": [ALICE]}})
    with running(config) as server:
        yield server


def launch(server: Server, model: str) -> subprocess.CompletedProcess[str]:
    args: dict[str, Any] = {"url": server.url, "api_key": ALICE, "prompt": PROMPT, "seed": 5,
                            "extra": {"kvtier.model": model}}  # fmt: skip
    return run_engine(ENGINE, args)


def test_a_sidecar_of_another_models_name_is_refused_at_start(sidecar: Server) -> None:
    done = launch(sidecar, f"{MODEL['name']}-finetune")
    assert done.returncode != 0, done.stderr[-800:]
    assert "config field 'kvtier.model'" in done.stderr and f"'{MODEL['name']}'" in done.stderr
    with Client(sidecar.url, api_key=ALICE) as client:
        assert client.lookup(PROMPT).num_tokens == 0  # it never ran: nothing saved


def test_the_sidecar_of_the_named_model_is_used(sidecar: Server) -> None:
    report = engine_report(launch(sidecar, str(MODEL["name"])))
    assert report["finished"] == "FINISHED_LENGTH_CAPPED", report
    with Client(sidecar.url, api_key=ALICE) as client:
        assert client.lookup(PROMPT).num_tokens == 32  # its two whole blocks, saved
