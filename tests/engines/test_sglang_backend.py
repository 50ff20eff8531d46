"""kvtier's SGLang HiCache storage backend against SGLang's real classes (issue 15): controllers
in processes of their own (`sglang_engine.py`: SGLang's device and host pools and its
`HiCacheController` on CPU, the backend loaded by SGLang's factory from the `dynamic` backend's
extra config), one `kvtier serve` between them.

SGLang's own backup thread writes real host pages into kvtier; a second controller's prefetch
threads find them (`batch_exists`: the leading count) and read them into its host pool
(`batch_get_v1`), bit-exact, in its own host layout too; tenants never see each other's pages.

Run with SGLang installed apart, in a pytest run of its own (it needs another transformers
than vLLM; the default suite does not collect this directory):

    bash tests/engines/install.sh sglang
    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_*.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from engine_process import launch as run_engine
from engine_process import report as engine_report
from service_server import Server, free_port, running, write_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

ENGINE = Path(__file__).with_name("sglang_engine.py")
ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdefgh"


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tenants = {"alice": {"api_keys": [ALICE]}, "bob": {"api_keys": [BOB]}}
    with running(write_config(tmp_path_factory.mktemp("kvtier"), tenants=tenants)) as server:
        yield server


def launch(server: Server, **args: Any) -> subprocess.CompletedProcess[str]:
    return run_engine(ENGINE, {"url": server.url, "api_key": ALICE, "seed": 4, **args})


def controller(server: Server, **args: Any) -> dict[str, Any]:
    """Run one SGLang controller process; its report."""
    report = engine_report(launch(server, **args))
    assert report["backend"] == "KvtierHiCacheStorage" and report["stats"]["errors"] == 0
    return report


def test_pages_sglang_backs_up_are_prefetched_by_another_controller_bit_exact(
    sidecar: Server,
) -> None:
    tokens = list(range(500, 548))  # 6 pages of 8
    wrote = controller(sidecar, mode="write", tokens=tokens)
    assert wrote["acked"] and wrote["completed_tokens"] == 48
    assert wrote["stats"]["pages_set"] == 6
    longer = tokens + list(range(900, 916))  # 2 pages kvtier never saw
    read = controller(sidecar, mode="read", tokens=longer)
    assert read["hit_tokens"] == 48  # batch_exists: the leading 6 of 8 pages
    assert read["completed_tokens"] == 48 and read["bit_exact"] is True
    for layout in ("layer_first", "page_first_direct", "page_head"):  # other host layouts
        other = controller(sidecar, mode="read", tokens=tokens, layout=layout)
        assert other["completed_tokens"] == 48 and other["bit_exact"] is True, layout


def test_a_reader_that_holds_the_first_pages_gets_the_rest_bit_exact(sidecar: Server) -> None:
    """SGLang passes the keys of the pages it holds (`prefix_keys`): the backend loads only the
    pages past them (`load(start=)`), and they land in the right host slots."""
    tokens = list(range(1500, 1548))  # 6 pages
    assert controller(sidecar, mode="write", tokens=tokens, seed=6)["completed_tokens"] == 48
    read = controller(sidecar, mode="read", tokens=tokens, seed=6, held=2)
    assert read["hit_tokens"] == 32 and read["completed_tokens"] == 32  # the 4 pages past 2
    assert read["bit_exact"] is True and read["stats"]["pages_got"] == 4


def test_a_writer_in_another_layout_and_tenants_that_never_meet(sidecar: Server) -> None:
    tokens = list(range(700, 732))  # 4 pages
    controller(sidecar, mode="write", tokens=tokens, seed=8, layout="page_head")
    read = controller(sidecar, mode="read", tokens=tokens, seed=8, layout="layer_first")
    assert read["completed_tokens"] == 32 and read["bit_exact"] is True
    bob = controller(sidecar, mode="read", tokens=tokens, seed=8, api_key=BOB)
    assert bob["hit_tokens"] == 0 and bob["completed_tokens"] == 0
    different = controller(sidecar, mode="read", tokens=[7, *tokens[1:]], seed=8)
    assert different["hit_tokens"] == 0  # a page is found only under the same pages before it


def test_a_pool_of_more_heads_than_layers_round_trips_in_every_host_layout(
    tmp_path: Path,
) -> None:
    """`page_head` orders a page [heads, page, layers, dim]: with as many heads as layers, a
    mix-up of the two would pass unseen."""
    path = write_config(tmp_path, tenants={"alice": {"api_keys": [ALICE]}})
    config = yaml.safe_load(path.read_text())
    config["model"] = {**config["model"], "num_kv_heads": 4}
    config["tiers"] = {t: {**v, "capacity": 2 * v["capacity"]} for t, v in config["tiers"].items()}
    path.write_text(yaml.safe_dump(config))
    tokens = list(range(4500, 4532))
    with running(path) as server:
        wrote = controller(server, mode="write", tokens=tokens, heads=4, layout="page_head")
        assert wrote["completed_tokens"] == 32
        for layout in ("layer_first", "page_first", "page_first_direct", "page_head"):
            read = controller(server, mode="read", tokens=tokens, heads=4, layout=layout)
            assert read["completed_tokens"] == 32 and read["bit_exact"] is True, layout


def test_sglangs_storage_clear_forgets_the_tenants_pages(sidecar: Server) -> None:
    """SGLang's "clear HiCache storage" (after a weight update) reaches kvtier: the pages are
    gone for this tenant, and another tenant's stay."""
    tokens = list(range(3500, 3532))  # 4 pages
    controller(sidecar, mode="write", tokens=tokens, seed=12, api_key=BOB)
    wrote = controller(sidecar, mode="write", tokens=tokens, seed=12, clear=True)
    assert wrote["completed_tokens"] == 32 and wrote["cleared"] is None, wrote
    assert controller(sidecar, mode="read", tokens=tokens, seed=12)["hit_tokens"] == 0
    bob = controller(sidecar, mode="read", tokens=tokens, seed=12, api_key=BOB)
    assert bob["hit_tokens"] == 32 and bob["bit_exact"] is True


def test_a_sidecar_of_another_model_or_shard_is_refused_when_sglang_attaches_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    for model, field in (
        ({"head_dim": 32}, "model"),
        ({"tp_rank": 1, "tp_size": 2}, "model.tp_rank"),
    ):
        path = write_config(tmp_path_factory.mktemp("other"), tenants={"a": {"api_keys": [ALICE]}})
        config = yaml.safe_load(path.read_text())
        config["model"] = {**config["model"], **model}
        path.write_text(yaml.safe_dump(config))
        with running(path) as other:
            done = launch(other, mode="read", tokens=list(range(8)))
        assert done.returncode != 0 and f"config field '{field}'" in done.stderr, done.stderr[-800:]


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"kvtier.api_keys": ALICE}, "kvtier.api_keys"), ({"kvtier.url": 8750}, "kvtier.url")],
)
def test_a_bad_backend_setting_is_refused_at_start(
    sidecar: Server, extra: dict[str, Any], field: str
) -> None:
    """A misspelt `kvtier.*` key is never ignored (the key meant would be), nor a mistyped one."""
    done = launch(sidecar, mode="read", tokens=list(range(8)), extra=extra)
    assert done.returncode != 0 and f"config field '{field}'" in done.stderr, done.stderr[-800:]


def test_a_sidecar_restarted_on_another_model_is_a_miss_never_a_cast(tmp_path: Path) -> None:
    """The backend checked the sidecar's layout when SGLang registered its host pool; the
    sidecar behind the URL is then replaced by one of another dtype holding the same keys.
    The reader finds the pages, and the load is a miss, counted: its float32 KV is never cast
    into SGLang's float16 host pool."""
    tokens, port = list(range(2500, 2532)), free_port()  # 4 pages
    tenants = {"alice": {"api_keys": [ALICE]}}
    fp16 = write_config(tmp_path / "fp16", tenants=tenants)
    fp32 = write_config(tmp_path / "fp32", tenants=tenants)
    config = yaml.safe_load(fp32.read_text())
    config["model"] = {**config["model"], "dtype": "float32"}
    fp32.write_text(yaml.safe_dump(config))
    body = {"api_key": ALICE, "seed": 9, "mode": "read", "tokens": tokens, "pause": True}
    with running(fp16, port=port) as first:
        reader = subprocess.Popen(
            [sys.executable, str(ENGINE), json.dumps({**body, "url": first.url})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert reader.stdout is not None and reader.stdout.readline().strip() == "registered"
    with running(fp32, port=port) as second:
        wrote = controller(second, mode="write", tokens=tokens, seed=9, dtype="float32")
        assert wrote["completed_tokens"] == 32
        out, err = reader.communicate("go\n", timeout=300)
    assert reader.returncode == 0, err[-3000:]
    read = json.loads(out.strip().splitlines()[-1])
    assert read["hit_tokens"] == 32  # batch_exists: the keys are there
    assert read["completed_tokens"] == 0 and read["stats"]["pages_got"] == 0
    assert read["stats"]["errors"] >= 1
