"""The vLLM scheduler's lookups (`integrations/lookups.py`) against real sockets: a sidecar that
hangs (accepts, never answers) costs one short timeout and then a quiet period; a refusal the
sidecar answers (one tenant's key) silences nothing. vLLM itself is not needed here: the
connector's part with vLLM's classes is `tests/engines/test_vllm_connector.py`."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.client import TransportError
from kvtier.errors import ConfigError, KVTierError, StorageError
from kvtier.integrations.lookups import Clients, Lookups
from kvtier.integrations.settings import call_timeout

TOKENS = list(range(64))


@pytest.fixture
def hung() -> Iterator[str]:
    """A sidecar that takes connections and never answers (a stopped process's listener)."""
    listener = socket.create_server(("127.0.0.1", 0))
    taken: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                taken.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for sock in [*taken, listener]:
        sock.close()


@pytest.fixture
def refusing() -> Iterator[str]:
    """A sidecar that answers every call at once with 401 (a key it does not know)."""

    class Refuse(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            body = b'{"error": "unauthorized", "detail": "unknown API key"}'
            self.send_response(401)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _refuse

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_hung_sidecar_costs_one_short_lookup_then_a_quiet_period(hung: str) -> None:
    lookups = Lookups(hung, timeout_s=0.6, quiet_s=0.6)  # each try (pools, lane, HTTP) 0.3 s
    try:
        assert lookups.open()
        began = time.monotonic()
        with pytest.raises(TransportError) as error:
            lookups.client("a-key-0123456789abcdef").lookup(TOKENS)
        assert 0.25 <= time.monotonic() - began < 1.6  # the lookup's own timeout, not 120 s
        lookups.failed(error.value)
        assert not lookups.open()  # no lookup asked meanwhile
        time.sleep(0.7)
        assert lookups.open()  # then the next one asks again
    finally:
        lookups.close()


def test_a_refusal_the_sidecar_answers_silences_nothing(refusing: str) -> None:
    lookups = Lookups(refusing, timeout_s=5.0, quiet_s=60.0)
    try:
        with pytest.raises(KVTierError) as error:
            lookups.client("another-tenants-key-0123456789").lookup(TOKENS)
        assert not isinstance(error.value, TransportError), error.value
        lookups.failed(error.value)
        assert lookups.open()  # another tenant's lookups go on
        lookups.failed(StorageError("the disk refused the write"))  # a 503 answered: an OSError
        assert lookups.open()
        lookups.failed(TransportError("the sidecar did not answer"))
        assert not lookups.open()
    finally:
        lookups.close()


def test_the_workers_clients_wait_their_timeout_not_120_s(hung: str) -> None:
    """The vLLM workers' loads and saves and the scheduler's reset (`kvtier.timeout_s`): a call
    waits that at most, each of its tries (the lane, then HTTP) half of it."""
    clients = Clients(hung, timeout_s=0.8)
    try:
        began = time.monotonic()
        with pytest.raises(TransportError):  # its first call, mapping the pools, bounded too
            clients.client("a-key-0123456789abcdef").load(TOKENS)
        assert 0.35 <= time.monotonic() - began < 2.0
    finally:
        clients.close()
    assert call_timeout({}, 120.0) == 120.0 and call_timeout({"kvtier.timeout_s": 3}, 1.0) == 3.0
    assert call_timeout({"kvtier.timeout_s": 0.1}, 1.0) == 0.1
    for wrong in (True, "10", 0, -1.0, 3601, float("nan"), None, 1e-9, 0.099):
        with pytest.raises(ConfigError, match=r"kvtier\.timeout_s"):
            call_timeout({"kvtier.timeout_s": wrong}, 120.0)
