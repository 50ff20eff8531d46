"""The kernels' GPU benchmark is ready for a lent GPU: it refuses cleanly without CUDA, and its
gather + SDPA baseline computes the same attention as the plain-torch reference."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from kvtier.kernels.paged_attention import paged_decode_reference

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "bench_kernels.py"


def load_script() -> Any:
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_the_script_says_so_and_exits_2() -> None:
    if torch.cuda.is_available():
        return  # on a CUDA machine the script runs for real
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "bench_kernels: CUDA is not available" in done.stdout


def test_the_gather_sdpa_baseline_matches_the_reference_on_a_cpu_pool() -> None:
    script = load_script()
    gen = torch.Generator().manual_seed(0)
    # 6 slots of 2 layers, 4-token blocks, 2 kv heads, head_dim 8; 4 query heads (GQA 2)
    buffer = torch.randn(6, 2, 2, 4, 2, 8, generator=gen)
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    q = torch.randn(2, 4, 8, generator=gen)
    lens = torch.tensor([12, 12], dtype=torch.int32)
    want = paged_decode_reference(q, buffer, script.LAYER, table, lens)
    got = script.gather_sdpa(q, buffer, table, 12)
    assert script.relative_error(got, want) < 1e-5
    shorter = paged_decode_reference(q, buffer, script.LAYER, table, lens - 3)
    assert script.relative_error(script.gather_sdpa(q, buffer, table, 9), shorter) < 1e-5
