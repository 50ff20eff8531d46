"""The backend's default call bound stays within what SGLang's detach waits for each storage
thread (`HiCacheController._stop_storage_threads` joins each with a timeout): a thread held in
one call to a hung sidecar for as long as the join waits made the detach fail ("Failed to
stop HiCache storage threads cleanly"). Read from the installed SGLang's source, so that a
release that shortens its join is caught here.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/sglang:tests/engines/placeholders \\
        python -m pytest tests/engines/test_sglang_timeout.py
"""

from __future__ import annotations

import ast
import inspect

import pytest

pytest.importorskip("sglang", reason="SGLang is installed apart: tests/engines/install.sh sglang")

from sglang.srt.managers.cache_controller import HiCacheController

from kvtier.integrations.sglang import TIMEOUT_S


def join_timeouts() -> list[float]:
    """The `timeout=` of every `join` in SGLang's `_stop_storage_threads`."""
    tree = ast.parse(inspect.getsource(HiCacheController._stop_storage_threads).lstrip())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "join":
            for keyword in node.keywords:
                value = keyword.value.value if isinstance(keyword.value, ast.Constant) else None
                if keyword.arg == "timeout" and isinstance(value, int | float):
                    found.append(float(value))
    return found


def test_a_call_ends_before_sglang_stops_waiting_for_its_thread() -> None:
    timeouts = join_timeouts()
    assert timeouts, "SGLang's detach joins its storage threads with a timeout"
    assert 0.8 * min(timeouts) >= TIMEOUT_S, (TIMEOUT_S, timeouts)  # (before: 10 s of 10 s)
