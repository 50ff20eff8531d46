"""kvtier's vLLM connector after audit BC, against vLLM's real scheduler (`vllm_engine.py`) and
a real `kvtier serve`:

- A worker whose sidecar does not answer yet when vLLM starts (a pod's containers start
  together; the sidecar restarting) waits for it (`lookups.served_layout`, 30 s), then serves:
  before, `register_kv_caches` raised a bare `TransportError` ("GET /v1/pools:
  ConnectionRefusedError"), and vLLM failed to start. One that never answers is a
  `ConfigError` naming `kvtier.url` and the URL.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_audit_BC.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from service_server import free_port, write_config
from test_vllm_connector import ALICE

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

HERE = Path(__file__).resolve().parent

DRIVER = """
import json, sys, threading
from pathlib import Path
sys.path[:0] = [sys.argv[4], str(Path(sys.argv[4]).parent)]
import torch
import vllm_engine as ve
from service_server import start
from kvtier.integrations import lookups
scenario, config, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
url = f"http://127.0.0.1:{port}"
sched, worker, _ = ve.built(dict(url=url, api_key=sys.argv[5]))
caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(
    ve.NUM_BLOCKS, ve.HEADS, ve.BLOCK, 2 * ve.DIM, dtype=torch.float16) for i in range(ve.LAYERS)}
servers = []
if scenario == "late":  # the sidecar answers 1 s after the worker first asks
    lookups.START_WAIT_S = 120.0  # (its start may take long on a loaded machine)
    threading.Timer(1.0, lambda: servers.append(start(config, port=port))).start()
else:
    lookups.START_WAIT_S = 1.0
out = {}
try:
    worker.register_kv_caches(caches)
except Exception as e:
    out["error"] = [type(e).__name__, getattr(e, "field", None), str(e)]
else:
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.utils.hashing import sha256
    init_none_hash(sha256)
    served = ve.serve(sched, worker, list(caches.values()), "r", list(range(3000, 3040)), 5, {})
    worker.saving.flush()
    out.update(finished=served["finished"], saved=worker.stats["saved_tokens"])
worker.shutdown()
for server in servers:
    server.stop()
print(json.dumps(out))
"""


def drive(scenario: str, tmp_path: Path) -> dict[str, Any]:
    config = write_config(tmp_path, tenants={"alice": {"api_keys": [ALICE]}})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRIVER), scenario, str(config), str(free_port()),
         str(HERE), ALICE],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_worker_started_before_its_sidecar_waits_for_it_then_serves(tmp_path: Path) -> None:
    out = drive("late", tmp_path)
    assert "error" not in out, out  # before: TransportError out of register_kv_caches
    assert out == {"finished": "FINISHED_LENGTH_CAPPED", "saved": 32}, out


def test_a_sidecar_that_never_answers_fails_the_start_naming_kvtier_url(tmp_path: Path) -> None:
    out = drive("never", tmp_path)
    kind, field, text = out["error"]
    assert (kind, field) == ("ConfigError", "kvtier.url"), out  # before: a bare TransportError
    assert "127.0.0.1" in text and "kvtier serve" in text, out
