"""The GPU benchmark script is ready for a lent GPU: it compiles, refuses cleanly without CUDA,
and its store part (the mover end to end) runs and verifies on a CPU "gpu" pool."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "bench_mover_gpu.py"


def load_script() -> object:
    spec = importlib.util.spec_from_file_location("bench_mover_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_the_script_says_so_and_exits_2() -> None:
    if torch.cuda.is_available():
        return  # on a CUDA machine the script runs for real (benchmarks/RESULTS.md)
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "CUDA is not available" in done.stdout


def test_the_store_part_runs_and_verifies_on_a_cpu_pool() -> None:
    script = load_script()
    mismatches: list[str] = []
    figures = script.measure_store(torch.device("cpu"), mismatches, prompts=3, tokens_each=64)  # type: ignore[attr-defined]
    assert mismatches == []
    assert figures["prompts"] == 3 and figures["ready_ms_p50"] > 0
    assert figures["mover"]["step_errors"] == 0
