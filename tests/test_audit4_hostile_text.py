"""Text from outside kvtier reaches the status and the terminal bounded and escaped (audit 4).

Pins: a cluster node's error line, however long and whatever it holds (terminal escapes, new
lines), is kept in the remote tier's `last_error` cut to 512 characters with its control
characters escaped, and so is a host name the node's slot table gives; `kvtier status` prints a
server's error detail and the status' fields with their control characters escaped, never a
terminal escape or a line of the server's making; the status page's refusals (400, 401, 403,
405) carry its security headers. The cluster node is a real socket speaking RESP (a fake node
of this file), the sidecar a real HTTP server, the page the real app.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from starlette.testclient import TestClient
from test_remote_audit import Answer, FakeNode

from kvtier.cli import main
from kvtier.config import parse_config
from kvtier.service.app import create_app
from kvtier.store import KVStore
from kvtier.tiers.remote.cluster import ClusterSettings, RemoteCluster

ESCAPES = "\x1b]0;PWNED-TITLE\x07\x1b[2J\x1b[H\x1b[31mFAKE: all good\x1b[0m\r\nINJECTED LINE"
CONTROLS = [chr(c) for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))]

# ---- a fake cluster node: honest about its slots, hostile in its errors ---------------------


def erring(error: bytes) -> Answer:
    """`FakeNode`'s answer to every data command: the error line `error`."""

    def answer(args: list[bytes], conn: socket.socket) -> bytes:
        if args[0].upper() in (b"AUTH", b"READONLY"):
            return b"+OK\r\n"
        return b"-ERR " + error + b"\r\n"

    return answer


def _last_error(node: FakeNode, allowed: tuple[str, ...] | None = None) -> str:
    """The `last_error` a remote tier on `node` keeps after a lookup and a probe."""
    cluster = RemoteCluster(
        ClusterSettings(nodes=(f"127.0.0.1:{node.port}",), timeout_s=1.0, allowed=allowed)
    )
    try:
        deadline = time.monotonic() + 5
        while not cluster.stats()["last_error"] and time.monotonic() < deadline:
            cluster.present([b"kvtier:probe"])
            time.sleep(0.05)
        error = cluster.stats()["last_error"]
        assert error == cluster.last_error
        return str(error)
    finally:
        cluster.close()
        node.close()


def _is_terminal_safe(text: str) -> bool:
    return not any(char in text for char in CONTROLS)


def test_a_nodes_error_line_is_kept_escaped_and_cut_to_512_characters() -> None:
    """An error line of 900 characters full of escapes (within what a reply may take,
    `rounds.REPLY_SLACK`: a longer one is refused unread, `test_remote_audit_n.py`; no bare
    new line, at which redis-py's parser waits for more): kept as 512 characters at most (and
    a note of the cut), no control character in it, the escapes shown as `\\x1b`."""
    node = FakeNode(erring(ESCAPES.replace("\r\n", "\x9b").encode() + b"A" * 800))
    error = _last_error(node)
    assert _is_terminal_safe(error), repr(error[:200])
    assert "\\x1b]0;PWNED-TITLE\\x07" in error and "\\x9bINJECTED LINE" in error
    kept = error.partition("…")[0]
    assert len(kept) <= 512, len(kept)
    assert len(error) < 600, len(error)


def test_a_host_name_with_new_lines_in_the_slot_table_is_kept_escaped() -> None:
    """A slot table naming '127.0.0.1\\n<forged line>' (a node outside `allowed_nodes`, so
    refused by name): `last_error` names it on one line, its escapes shown, not sent."""
    forged = b"127.0.0.1\n\x1b[32mremote: connected; 9999 hits (forged line)\x1b[0m\n"
    error = _last_error(FakeNode(erring(b"never asked"), host=forged), allowed=("127.0.0.1",))
    assert "forged line" in error
    assert _is_terminal_safe(error), repr(error)
    assert "127.0.0.1\\x0a\\x1b[32mremote: connected" in error


# ---- `kvtier status` against a hostile sidecar -------------------------------------------------


class _Sidecar(BaseHTTPRequestHandler):
    status = 200
    body: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:
        data = json.dumps(self.body).encode()
        self.send_response(self.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def sidecar() -> Iterator[tuple[str, type[_Sidecar]]]:
    with fake_sidecar() as served:
        yield served


@contextlib.contextmanager
def fake_sidecar() -> Iterator[tuple[str, type[_Sidecar]]]:
    """An HTTP server answering every GET with its handler's `status` and `body` (set them)."""
    handler = type("Handler", (_Sidecar,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_kvtier_status_prints_a_servers_error_detail_escaped(
    sidecar: tuple[str, type[_Sidecar]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A 503 whose detail sets the title, clears the screen and adds a line: one line on
    stderr, exit 2, the escapes shown as text."""
    url, handler = sidecar
    handler.status = 503
    handler.body = {"error": "not_ready", "detail": ESCAPES + "\nkvtier: all fine"}
    assert main(["status", "--url", url]) == 2
    out = capsys.readouterr()
    assert _is_terminal_safe(out.err.rstrip("\n")), repr(out.err)
    assert out.err.count("\n") == 1 and out.err.startswith("kvtier: ")
    assert "\\x1b]0;PWNED-TITLE\\x07" in out.err and "\\x0akvtier: all fine" in out.err


def test_kvtier_status_prints_status_fields_escaped(
    sidecar: tuple[str, type[_Sidecar]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A real store's status with a remote section whose `last_error` and a tier location
    hold escapes and new lines: every line printed is free of control characters, and no
    line is the server's forged one."""
    config = parse_config({"tiers": {"gpu": {"capacity": "1MiB"}, "host": {"capacity": "1MiB"}}})
    with KVStore(config) as store:
        status = store.status()
    status["tiers"]["host"]["location"] = "\x1b[2Jcpu\nremote: connected; 9999 hits"
    remote: dict[str, Any] = dict.fromkeys(
        ("hits", "misses", "verify_failures", "errors", "filled_blocks", "writer_pending_bytes"), 0
    )
    remote.update(writer_written_blocks=0, writer_dropped_blocks=0, connected=False)
    remote["last_error"] = ESCAPES + "\nremote: connected; 9999 hits"
    status["remote"] = remote
    url, handler = sidecar
    handler.body = status
    assert main(["status", "--url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(_is_terminal_safe(line) for line in lines), lines
    assert not any(line.startswith("remote: connected") for line in lines), lines
    assert any("\\x1b]0;PWNED-TITLE\\x07" in line for line in lines)


# ---- the page's refusals carry its headers -----------------------------------------------------

ADMIN, TENANT = "admin-key-0123456789", "tenant-a-key-0123456789"


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/", {}, 401),
        ("GET", "/", {"authorization": "Bearer nope-nope-nope-nope"}, 403),
        ("GET", "/?part=<script>x</script>", {"authorization": f"Bearer {ADMIN}"}, 400),
        ("HEAD", "/", {"authorization": f"Bearer {ADMIN}"}, 405),
        ("POST", "/page.js", {}, 405),
    ],
)
def test_the_pages_refusals_carry_its_security_headers(
    tmp_path: Path, method: str, path: str, headers: dict[str, str], status: int
) -> None:
    """Each refusal of the page's paths: CSP (scripts from this origin only), nosniff, no
    referrer, no store, as on its 200s."""
    config = parse_config(
        {
            "tiers": {"gpu": {"capacity": "1MiB"}, "host": {"capacity": "1MiB"}},
            "service": {"admin_key": ADMIN, "state_dir": str(tmp_path)},
            "tenants": {"a": {"api_keys": [TENANT]}},
        }
    )
    with TestClient(
        create_app(config, lambda: KVStore(config)), base_url="http://127.0.0.1"
    ) as client:
        ok = client.get("/", headers={"authorization": f"Bearer {ADMIN}"})
        refused = client.request(method, path, headers=headers)
    assert ok.status_code == 200
    assert refused.status_code == status
    for name in ("content-security-policy", "x-content-type-options", "referrer-policy"):
        assert refused.headers.get(name) == ok.headers[name], name
    assert refused.headers.get("cache-control") == "no-store"
    assert "script-src 'self'" in refused.headers["content-security-policy"]
