"""The vLLM connector's helpers after audit BC (no vLLM needed: `lookups.py`, `settings.py`),
against a real `kvtier serve`:

- A worker checks its KV against the sidecar's layout at start (`register_kv_caches`). A
  sidecar not answering yet (a pod's containers start together; a restart) failed vLLM's start
  at once with a bare `TransportError` ("GET /v1/pools: ConnectionRefusedError"), naming
  neither the setting nor the URL: now it is asked again for a while (`served_layout`), then
  a `ConfigError` names `kvtier.url` and the URL.
- The connector's counters are added to from five threads: `Counts.add` loses none.
- `kvtier.events_topic` (or the replay endpoint) set without `kvtier.events_endpoint`, or of
  the wrong type, is refused by name, not ignored.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from fake_server import fake_servers
from service_server import BLOCK_BYTES, BT, DIM, HEADS, LAYERS, free_port, start, write_config

from kvtier.client import ServiceError
from kvtier.errors import ConfigError
from kvtier.integrations.lookups import Clients, Counts, served_layout
from kvtier.integrations.settings import ConnectorSettings


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_worker_waits_at_start_for_a_sidecar_that_answers_late(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = write_config(tmp_path)
    servers = []
    late = threading.Timer(1.0, lambda: servers.append(start(config, port=port)))
    late.start()
    clients = Clients(url, timeout_s=4.0)
    try:
        layout = served_layout(clients, "", "kvtier.url", wait_s=60.0)
        assert layout.num_layers == 2 and layout.head_dim == 64, layout
    finally:
        late.join()
        clients.close()
        for server in servers:
            server.stop()


def test_a_sidecar_that_never_answers_is_a_config_error_naming_the_url(tmp_path: Path) -> None:
    url = f"http://ops:s3cret-pass@127.0.0.1:{free_port()}"  # nothing listens there
    clients = Clients(url, timeout_s=2.0)
    began = time.monotonic()
    with pytest.raises(ConfigError) as error:
        served_layout(clients, "", "kvtier.urls[1]", wait_s=1.0)
    clients.close()
    assert 1.0 <= time.monotonic() - began < 10.0
    assert error.value.field == "kvtier.urls[1]", error.value
    assert "127.0.0.1" in str(error.value) and "s3cret" not in str(error.value), error.value
    assert "kvtier serve" in str(error.value), error.value


def test_a_sidecar_recovering_at_start_is_waited_for_and_a_refusal_is_not() -> None:
    """A sidecar that restarts with a disk tier answers 503 not_ready while it recovers (before:
    vLLM's start failed on that 503); a refusal it answered (401) is raised at once."""
    layout = {"dtype": "float16", "block_shape": [LAYERS, 2, BT, HEADS, DIM],
              "block_bytes": BLOCK_BYTES, "block_tokens": BT}  # fmt: skip
    served = (200, {"layout": layout, "pools": [{"tier": "host", "num_slots": 8}]})
    with fake_servers() as fake:
        server = fake(pools=(503, {"error": "not_ready", "detail": "recovering"}))
        threading.Timer(1.0, lambda: server.replies.update({"/v1/pools": served})).start()
        clients = Clients(server.url, timeout_s=4.0)
        assert served_layout(clients, "", "kvtier.url", wait_s=30.0).num_layers == LAYERS
        assert len(server.paths) >= 2, server.paths  # asked again while it recovered
        clients.close()
        refusing = fake(pools=(401, {"error": "unauthorized", "detail": "no such key"}))
        clients = Clients(refusing.url, timeout_s=4.0)
        with pytest.raises(ServiceError, match="401"):
            served_layout(clients, "", "kvtier.url", wait_s=30.0)
        assert refusing.paths == ["/v1/pools"]
        clients.close()


def test_the_connector_counts_lose_no_add_across_threads() -> None:
    """A guard, not a reproduction: unlocked `+=` lost no count here on CPython 3.11 (a switch
    falls only at calls and jumps); the lock is for a free-threaded Python."""
    counts = Counts(["loaded_tokens", "errors"])
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch as often as the interpreter allows

    def load() -> None:  # as a load thread counts
        for _ in range(20_000):
            counts.add("loaded_tokens", 16)

    try:
        adders = [threading.Thread(target=load) for _ in range(4)]
        for adder in adders:
            adder.start()
        for _ in range(20_000):
            counts.add("errors")
        for adder in adders:
            adder.join()
    finally:
        sys.setswitchinterval(interval)
    assert counts == {"loaded_tokens": 4 * 20_000 * 16, "errors": 20_000}
    assert dict(counts) == counts  # read as a dict by vLLM's stats and the tests


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"kvtier.events_topic": 5}, "kvtier.events_topic"),
        ({"kvtier.events_topic": "kv@pod"}, "kvtier.events_endpoint"),
        ({"kvtier.events_replay_endpoint": "tcp://127.0.0.1:5561"}, "kvtier.events_endpoint"),
    ],
)
def test_a_relay_setting_without_the_relay_is_refused_by_name(
    extra: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as error:
        ConnectorSettings.parse(extra, 1)
    assert error.value.field == field, error.value
    assert ConnectorSettings.parse({"kvtier.events_topic": ""}, 1).events is None
