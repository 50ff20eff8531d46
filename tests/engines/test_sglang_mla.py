"""kvtier's SGLang HiCache storage backend with an MLA model (DeepSeek's multi-head latent
attention): SGLang's real `MLATokenToKVPool` and `MLATokenToKVPoolHost` (one latent of 576
values per token and layer, no separate V) under its `HiCacheController` on CPU
(`sglang_engine.py` with `mla`). kvtier holds the latent as one head of K and V halves
(`num_kv_heads: 1`, `head_dim: 288`), copied through `paged.mla_host_view`; the pages are
written and read by SGLang's documented dims, code of the test's own.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_mla.py
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_process import launch as run_engine
from engine_process import report as engine_report
from service_server import Server, running, write_mla_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

ENGINE = Path(__file__).with_name("sglang_engine.py")
ALICE = "alice-key-0123456789abcdef"
TENANTS = {"alice": {"api_keys": [ALICE]}}
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(write_mla_config(tmp_path_factory.mktemp("mla"), TENANTS)) as server:
        yield server


def launch(server: Server, **args: Any) -> subprocess.CompletedProcess[str]:
    body = {"url": server.url, "api_key": ALICE, "seed": 13, "mla": True}
    return run_engine(ENGINE, {**body, **args})


def controller(server: Server, **args: Any) -> dict[str, Any]:
    report = engine_report(launch(server, **args))
    assert report["backend"] == "KvtierHiCacheStorage" and report["stats"]["errors"] == 0
    return report


@pytest.mark.parametrize("writer", LAYOUTS)
def test_mla_pages_round_trip_bit_exact_between_any_two_host_layouts(
    sidecar: Server, writer: str
) -> None:
    tokens = list(range(3000 + 100 * LAYOUTS.index(writer), 3032 + 100 * LAYOUTS.index(writer)))
    wrote = controller(sidecar, mode="write", tokens=tokens, layout=writer)
    assert wrote["acked"] and wrote["completed_tokens"] == 32 and wrote["stats"]["pages_set"] == 4
    for reader in LAYOUTS:
        read = controller(sidecar, mode="read", tokens=tokens, layout=reader)
        assert read["hit_tokens"] == 32, (writer, reader)
        assert read["completed_tokens"] == 32 and read["bit_exact"] is True, (writer, reader)


def test_an_mla_reader_that_holds_the_first_pages_gets_the_rest(sidecar: Server) -> None:
    tokens = list(range(4000, 4048))  # 6 pages
    assert controller(sidecar, mode="write", tokens=tokens, seed=3)["completed_tokens"] == 48
    read = controller(sidecar, mode="read", tokens=tokens, seed=3, held=2, layout="page_unified")
    assert read["hit_tokens"] == 32 and read["completed_tokens"] == 32
    assert read["bit_exact"] is True and read["stats"]["pages_got"] == 4


def test_a_sidecar_holding_the_latent_as_it_is_named_is_refused_with_the_layout_to_set(
    tmp_path: Path,
) -> None:
    with running(write_mla_config(tmp_path, TENANTS, head_dim=576)) as other:
        done = launch(other, mode="read", tokens=list(range(8)))
    assert done.returncode != 0 and "config field 'model'" in done.stderr, done.stderr[-800:]
    assert "(2, 1, 288, torch.float16)" in done.stderr, done.stderr[-800:]
