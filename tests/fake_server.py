"""A fake sidecar for the client's trust tests (`test_client_trust.py`, `test_cuda_ipc.py`).

A real HTTP server on a thread of the test answers each path with the reply a test planted
(status and a JSON body, or raw bytes for garbage) and records the paths it was sent, so that a
test can play a hostile or broken server against a real `Client`:

    with fake_servers() as fake:
        server = fake(pools=(200, {...}), reserve=(200, {...}))    # /v1/pools, /v1/reserve
        Client(server.url) ...
        assert server.paths == ["/v1/pools"]
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack  # type: ignore[import-untyped]

Reply = tuple[int, Any]
"""(status, body): a JSON-able body, a map holding bytes (sent as msgpack, as the server sends
a KV), or bytes sent as they are."""


def ready_lease(block_tokens: int, layers: int, **fields: Any) -> dict[str, Any]:
    """A well-formed READY lease body of two blocks in gpu slots 0 and 1, `fields` replaced."""
    body = {
        "lease_id": 9,
        "tenant": "default",
        "num_tokens": 2 * block_tokens,
        "block_table": [0, 1],
        "expires_at": 1e9,
        "state": "ready",
        "layers_ready": layers,
        "reason": "",
    }
    return {**body, **fields}


def host_reservation(block_tokens: int, **fields: Any) -> dict[str, Any]:
    """A well-formed reservation body of two new blocks in host slots 0 and 1, `fields`
    replaced."""
    body = {
        "reservation_id": 7,
        "tenant": "default",
        "cached_tokens": 0,
        "num_tokens": 2 * block_tokens,
        "tier": "host",
        "slots": [0, 1],
        "expires_at": 1e9,
    }
    return {**body, **fields}


def _has_bytes(data: Any) -> bool:
    return isinstance(data, dict) and any(isinstance(v, bytes | memoryview) for v in data.values())


class FakeServer:
    """Answers `replies[path]` (404 for any other path) and records every path asked."""

    def __init__(self, replies: dict[str, Reply]) -> None:
        self.replies = replies
        self.paths: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                path = self.path.split("?")[0]
                fake.paths.append(path)
                status, data = fake.replies.get(path, (404, {"error": "nope", "detail": path}))
                kind = "application/json"
                if isinstance(data, bytes):
                    raw = data
                elif _has_bytes(data):  # JSON has no bytes: msgpack, as the server sends KV
                    raw, kind = msgpack.packb(data, use_bin_type=True), "application/msgpack"
                else:
                    raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = answer

            def log_message(self, *args: object) -> None:
                pass  # quiet: the tests assert on `paths`

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, args=(0.02,), daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@contextlib.contextmanager
def fake_servers() -> Iterator[Callable[..., FakeServer]]:
    """`fake(pools=reply, ...)` starts a server answering /v1/pools etc.; all close on exit."""
    servers: list[FakeServer] = []

    def make(**replies: Reply) -> FakeServer:
        server = FakeServer({f"/v1/{path}": reply for path, reply in replies.items()})
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.close()
