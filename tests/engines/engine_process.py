"""Running one engine script (`vllm_engine.py`, `sglang_engine.py`) as a process of its own: its
arguments as one JSON argument, its report as the last line of its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def launch(script: Path, body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Run `script` with `body` (this environment, PYTHONPATH naming the engine, passed on)."""
    return subprocess.run(
        [sys.executable, str(script), json.dumps(body)],
        capture_output=True, text=True, timeout=300, check=False, env=dict(os.environ),
    )  # fmt: skip


def report(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The report of a run that succeeded (its stderr's tail if it did not)."""
    assert done.returncode == 0, done.stderr[-3000:]
    body: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return body
