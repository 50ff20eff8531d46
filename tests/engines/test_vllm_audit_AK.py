"""kvtier's vLLM connector after audit AK, against vLLM's real connector classes and a real
`kvtier serve`:

- A sidecar that hangs (SIGSTOP) costs the worker one `kvtier.timeout_s`, not one per call:
  the saves queued behind a save that went unanswered are skipped for a while, so a finished
  request's `release` job (vLLM holds its blocks until it is reported) is not kept waiting for
  each of them in turn (before: 8 queued saves held it 8 timeouts; with the default 120 s and
  the 64 saves the queue holds, two hours of blocks vLLM cannot use), and a step's synchronous
  loads fail at once after the first (vLLM recomputes) rather than each waiting in the step.
- `kvtier.url` / `kvtier.urls` that the sidecar clients cannot use are a `ConfigError` naming
  the key when vLLM builds the connector (before: accepted, then every lookup, load and save
  failed, or the client's socket raised an error of its own), credentials not shown;
  `kvtier.tenant_keys` that is not a map (an empty list) is refused too.
- A weight update's reset (`reset_prefix_cache(reset_connector=True)`) while the sidecar is
  down is a reset that failed (False), in the scheduler and in the workers' next step: never an
  exception out of vLLM's reset or its step.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_audit_AK.py
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import test_vllm_audit4 as audit4
from service_server import running, start, write_config
from test_vllm_connector import ALICE

from kvtier.errors import ConfigError
from kvtier.integrations.settings import ConnectorSettings

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

DRIVER = (
    audit4.PRELUDE
    + """
import os, signal, time
from kvtier.integrations.plans import LoadJob, SaveJob
from kvtier.integrations.vllm import KvtierMetadata

sched, worker, _ = ve.built(dict(url=url, api_key=key, extra={"kvtier.timeout_s": 1.0},
                                 tenant_keys={"team-b": "bob-key-0123456789abcdefgh"}))
worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(
    ve.NUM_BLOCKS, ve.HEADS, BS, 2 * ve.DIM, dtype=torch.float16) for i in range(ve.LAYERS)})
if scenario == "reset":  # the sidecar is gone; no client of team-b's key was made yet
    os.kill(opts["pid"], signal.SIGKILL)
    out = {"scheduler": sched.reset_prefix_cache(reset_connector=True)}
    worker.bind_connector_metadata(KvtierMetadata(reset=True))
    worker.start_load_kv(None)  # the workers' reset, in the step after: not an exception
    worker.clear_connector_metadata()
    out["worker"] = "stepped"
    print(json.dumps(out))
    sys.exit(0)
os.kill(opts["pid"], signal.SIGSTOP)  # the sidecar hangs from here (the test resumes it)

def step(meta):
    began = time.monotonic()
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return time.monotonic() - began

out = {}
saves = [SaveJob(f"p{i}", tuple(range(base + 100 * i, base + 100 * i + 32)), (1, 2), key)
         for i in range(8)]
saves.append(SaveJob("done", tuple(range(base + 5000, base + 5032)), (3, 4), key, release=True))
began = time.monotonic()
step(KvtierMetadata(saves=saves))  # queued to the saves' thread
while not worker.get_finished(set())[0]:
    time.sleep(0.02)
out["release_s"] = time.monotonic() - began
out["skipped_saves"] = worker.get_kv_connector_stats().data.get("skipped_saves", 0)
loads = [LoadJob(f"l{i}", tuple(range(base + 9000 + 100 * i, base + 9032 + 100 * i)), 0,
                 (10 + 2 * i, 11 + 2 * i), key) for i in range(4)]
out["loads_s"] = step(KvtierMetadata(loads=loads, load_async=False))
out["load_errors"] = sorted(worker.get_block_ids_with_load_errors())
out["errors"] = worker.stats["errors"]
os.kill(opts["pid"], signal.SIGCONT)
worker.shutdown()
print(json.dumps(out))
"""
)


def test_a_hung_sidecar_costs_the_worker_one_timeout_not_one_per_queued_call(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, tenants={"alice": {"api_keys": [ALICE]}})
    with running(config) as server:
        pid = server.process.pid
        try:
            out = audit4.drive(server, "hung", DRIVER, base=710_000, pid=pid)
        finally:
            os.kill(pid, signal.SIGCONT)
    # one save waits its timeout (1 s); the 7 queued behind it are skipped, the release is
    # reported (before: 5-8 s, one wait per save)
    assert out["release_s"] < 3.0, out
    assert out["skipped_saves"] >= 6, out
    # within the quiet period a step's synchronous loads fail at once: vLLM recomputes them
    # (before: each waited in the step, 4 waits)
    assert out["loads_s"] < 1.0, out
    assert out["load_errors"] == list(range(10, 18)), out


def test_a_weight_reset_while_the_sidecar_is_down_fails_and_the_engine_steps_on(
    tmp_path: Path,
) -> None:
    # vLLM's reset_prefix_cache(reset_connector=True) with the sidecar down: the clients of
    # keys not used yet are made then, and making one reaches the sidecar (before: that
    # TransportError came out of vLLM's reset, and out of the worker's start_load_kv, its step)
    server = start(write_config(tmp_path, tenants={"alice": {"api_keys": [ALICE]}}))
    try:
        out = audit4.drive(server, "reset", DRIVER, base=720_000, pid=server.process.pid)
    finally:
        server.process.kill()
        server.process.wait()
    assert out == {"scheduler": False, "worker": "stepped"}, out


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"kvtier.url": "garbage"}, "kvtier.url"),
        ({"kvtier.url": "ftp://127.0.0.1:8750"}, "kvtier.url"),
        ({"kvtier.url": "http://side car:8750"}, "kvtier.url"),  # http.client's own error
        ({"kvtier.url": "http://127.0.0.1:99999"}, "kvtier.url"),
        ({"kvtier.urls": ["http://127.0.0.1:8750", "127.0.0.1:8751"]}, "kvtier.urls[1]"),
        ({"kvtier.tenant_keys": []}, "kvtier.tenant_keys"),
    ],
)
def test_a_url_the_clients_cannot_use_is_a_config_error_naming_the_key(
    extra: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as error:
        ConnectorSettings.parse(extra, len(extra.get("kvtier.urls") or [1]))  # type: ignore[arg-type]
    assert error.value.field == field


def test_a_refused_urls_credentials_are_not_shown() -> None:
    with pytest.raises(ConfigError) as error:
        ConnectorSettings.parse({"kvtier.url": "http://ops:hunter2-secret@side car:1"}, 1)
    assert "hunter2" not in str(error.value) and error.value.field == "kvtier.url"
    good = {"kvtier.urls": ["http://127.0.0.1:8750", "https://[::1]:8751/kv"]}
    assert ConnectorSettings.parse(good, 2).urls == tuple(good["kvtier.urls"])
    assert ConnectorSettings.parse({"kvtier.tenant_keys": None}, 1).tenant_keys == {}
