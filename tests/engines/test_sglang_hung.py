"""kvtier's SGLang backend against a sidecar that hangs (a real `kvtier serve` under SIGSTOP:
its sockets take connections and never answer), with SGLang's real host pool on CPU.

SGLang calls the backend from its backup and prefetch threads; each call used to wait the
client's 120 s, so one stopped sidecar held both threads two minutes per call. A call now
waits `kvtier.timeout_s` at most, and after one went unanswered the backend answers misses
without asking for a quiet period (`stats["skipped_calls"]`), then asks again.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_hung.py
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from service_server import Server, running, write_config

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from test_sglang_audit3 import PAGE, TENANTS, host_pool
from test_sglang_audit_F import storage_config

from kvtier.errors import ConfigError
from kvtier.integrations.lookups import Quiet
from kvtier.integrations.sglang import KvtierHiCacheStorage


@pytest.fixture
def sidecar(tmp_path: object) -> Iterator[Server]:
    """A sidecar of its own: the test stops it (SIGCONT always sent back)."""
    with running(write_config(tmp_path, tenants=TENANTS)) as server:  # type: ignore[arg-type]
        try:
            yield server
        finally:
            server.process.send_signal(signal.SIGCONT)


def stop(server: Server) -> None:
    """SIGSTOP `server` and wait until it is stopped (the signal lands asynchronously: a call
    sent at once may still be answered)."""
    server.process.send_signal(signal.SIGSTOP)
    stat = Path(f"/proc/{server.process.pid}/stat")
    deadline = time.monotonic() + 5
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the sidecar did not stop"
        time.sleep(0.005)


def timing_out(url: str, timeout_s: object) -> Any:
    """The storage config of `test_sglang_audit_F` with `kvtier.timeout_s` set to `timeout_s`."""
    config = storage_config(url)
    config.extra_config["kvtier.timeout_s"] = timeout_s
    return config


def timed(call: object) -> tuple[object, float]:
    began = time.monotonic()
    result = call()  # type: ignore[operator]
    return result, time.monotonic() - began


def test_a_hung_sidecar_costs_one_timeout_then_misses_until_it_answers_again(
    sidecar: Server,
) -> None:
    backend = KvtierHiCacheStorage(timing_out(sidecar.url, 2.0))
    backend.quiet = Quiet(0.8)  # 10 s by default
    host = host_pool()
    backend.register_mem_pool_host(host)
    slots = host.alloc(2 * PAGE)
    host.kv_buffer.copy_(
        torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(3))
    )
    keys = ["hung-0", "hung-1"]
    assert backend.batch_set_v1(keys, slots) == [True, True]
    stop(sidecar)
    found, took = timed(lambda: backend.batch_exists(keys))
    assert found == 0 and 0.9 <= took < 5.0, took  # the timeout (lane, then HTTP), not 120 s
    assert backend.stats["errors"] == 1 and backend.stats["skipped_calls"] == 0
    out = host.alloc(2 * PAGE)
    for call in (
        lambda: backend.batch_get_v1(keys, out),
        lambda: backend.batch_set_v1(keys, slots),
    ):
        answer, took = timed(call)
        assert answer == [False, False] and took < 0.5, took  # not asked: a miss at once
    assert backend.batch_exists(keys) == 0
    assert backend.stats["skipped_calls"] == 3 and backend.stats["errors"] == 1
    sidecar.process.send_signal(signal.SIGCONT)
    time.sleep(0.9)  # the quiet period over: asked again, answered (once the sidecar caught up)
    deadline = time.monotonic() + 10
    while backend.batch_exists(keys) != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert backend.batch_get_v1(keys, out) == [True, True]
    backend.close()


def test_a_failure_the_sidecar_did_not_cause_silences_nothing(sidecar: Server) -> None:
    backend = KvtierHiCacheStorage(storage_config(sidecar.url))
    host = host_pool()
    backend.register_mem_pool_host(host)
    wrong = torch.full((PAGE,), 10**6, dtype=torch.int64)  # past the host pool: refused here
    assert backend.batch_set_v1(["far-0"], wrong) == [False]
    assert backend.stats["errors"] == 1 and backend.quiet.open()
    assert backend.batch_set_v1(["near-0"], host.alloc(PAGE)) == [True]  # asked, stored
    assert backend.stats["skipped_calls"] == 0
    backend.close()


@pytest.mark.parametrize("value", [True, "10", 0, -1.0, 3601, float("nan"), None, 1e-9])
def test_timeout_s_must_be_seconds(value: object) -> None:
    with pytest.raises(ConfigError, match=r"kvtier\.timeout_s"):
        KvtierHiCacheStorage(timing_out("http://127.0.0.1:1", value))


def test_no_store_lands_after_a_clear_nor_starts_during_one(sidecar: Server) -> None:
    """SGLang's clear follows a weight update; a backup under way holds pages read from the host
    pool before it (the old weights'). A store that began during the clear used to land after
    the reset (kept, served to the new weights); now it is a miss, and the clear waits for the
    stores that began before it, then resets them away too."""
    backend = KvtierHiCacheStorage(timing_out(sidecar.url, 6.0))
    host = host_pool()
    backend.register_mem_pool_host(host)
    before, during = ["old-0", "old-1"], ["late-0", "late-1"]
    slots = host.alloc(2 * PAGE)
    stop(sidecar)  # every call waits until SIGCONT
    results: dict[str, object] = {}
    storing = threading.Thread(
        target=lambda: results.update(set=backend.batch_set_v1(before, slots))
    )
    storing.start()
    time.sleep(0.3)

    def clear() -> None:
        backend.clear()
        results["clear"] = None  # it returned: no error

    clearing = threading.Thread(target=clear)
    clearing.start()
    time.sleep(0.3)
    answer, took = timed(lambda: backend.batch_set_v1(during, slots))
    assert answer == [False, False] and took < 0.5, took  # refused during the clear, not queued
    sidecar.process.send_signal(signal.SIGCONT)
    storing.join(10)
    clearing.join(10)
    assert results == {"set": [True, True], "clear": None}
    assert backend.batch_exists(before) == 0 and backend.batch_exists(during) == 0
    assert backend.batch_set_v1(during, slots) == [True, True]  # after it: stored again
    assert backend.batch_exists(during) == 2
    backend.close()
