"""`kvtier status --timeout`: a server that trickles its reply (a byte every 0.2 s) held the
command for the client's 120 s (126.5 s measured by audit BH); now 10 s by default, or what
`--timeout` says, then a typed error and a non-zero exit."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvtier.cli import main


def test_a_trickling_server_holds_kvtier_status_only_its_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stop = threading.Event()

    class Trickle(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "100000")
            self.end_headers()
            while not stop.is_set():
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.2)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        started = time.monotonic()
        status = main(["status", "--url", url, "--timeout", "1"])
        took = time.monotonic() - started
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    assert status != 0
    assert took < 8, took  # the client's default 120 s before
    assert "Traceback" not in capsys.readouterr().err
