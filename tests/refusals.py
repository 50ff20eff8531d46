"""Starts of `kvtier serve` that are expected to fail, for the tests of hostile files and keys.

- `refused_start(config)`: the config (keys, state directory, secret) is refused before
  anything starts: exit status 2, the `ConfigError` on stderr, no traceback.
- `unready_detail(config)`: the process starts but its store does not (a disk directory that
  is refused, locked by another server, damaged): /readyz answers 503 with the reason, and
  the log says it in one line, without a traceback (it is a refusal of ours, not a bug).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from service_server import START_S, free_port, serve_command


def refused_start(config: Path, env: Mapping[str, str] | None = None) -> str:
    """Run `kvtier serve`, expect it to refuse to start (status 2, no traceback); its stderr."""
    done = subprocess.run(
        serve_command(config, free_port()),
        capture_output=True,
        text=True,
        timeout=START_S,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 2, f"status {done.returncode}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr


def unready_detail(config: Path, wrap: Sequence[str] = ()) -> str:
    """Start `kvtier serve` (its command after `wrap`, e.g. a namespace's `unshare`), whose
    store is expected to fail: the detail of its /readyz 503."""
    port = free_port()
    log = config.with_name(f"server-{port}.log")
    with log.open("wb") as out:
        command = [*wrap, *serve_command(config, port)]
        process = subprocess.Popen(command, stdout=out, stderr=out)
    detail = "recovering"
    try:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and detail == "recovering":
            assert process.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                assert response.status_code == 503, "the store started"
                detail = response.json()["detail"]
            time.sleep(0.05)
    finally:
        process.terminate()
        process.wait(START_S)
    assert detail != "recovering", f"no answer from /readyz within {START_S} s"
    output = log.read_text(errors="replace")
    assert "Traceback" not in output, output[-3000:]
    assert "the store failed to start (/readyz says so too): " in output, output[-3000:]
    return detail
