"""The scripts of benchmarks/gpu/ are ready for a lent GPU: each refuses cleanly without CUDA
(exit 2, saying so), and the parts of them that run on a CPU compute what they should: the
mover script's store part end to end, the kernels script's gather + SDPA baseline, the data
path script's figures and checks on CPU pools."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.kernels.paged_attention import paged_decode_reference

GPU_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu"


def load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, GPU_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up while it is defined
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the scripts run for real")
@pytest.mark.parametrize(
    "name",
    [
        "bench_datapath_gpu",
        *(  # one script in the default suite, the others with `pytest -m slow` (`.ci/run`)
            pytest.param(name, marks=pytest.mark.slow)
            for name in ("bench_mover_gpu", "bench_kernels", "bench_dequant")
        ),
    ],
)
def test_without_cuda_the_script_says_so_and_exits_2(name: str) -> None:
    script = GPU_DIR / f"{name}.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{name}: CUDA is not available" in done.stdout


def test_the_mover_scripts_store_part_runs_and_verifies_on_a_cpu_pool() -> None:
    script = load_script("bench_mover_gpu")
    mismatches: list[str] = []
    figures = script.measure_store(torch.device("cpu"), mismatches, prompts=3, tokens_each=64)
    assert mismatches == []
    assert figures["prompts"] == 3 and figures["ready_ms_p50"] > 0
    assert figures["short_leases"] == 0
    assert figures["mover"]["step_errors"] == 0


def test_the_kernels_scripts_gather_sdpa_baseline_matches_the_reference() -> None:
    script = load_script("bench_kernels")
    gen = torch.Generator().manual_seed(0)
    # 6 slots of 2 layers, 4-token blocks, 2 kv heads, head_dim 8; 4 query heads (GQA 2)
    buffer = torch.randn(6, 2, 2, 4, 2, 8, generator=gen)
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    q = torch.randn(2, 4, 8, generator=gen)
    lens = torch.tensor([12, 12], dtype=torch.int32)
    want = paged_decode_reference(q, buffer, script.LAYER, table, lens)
    assert script.relative_error(script.gather_sdpa(q, buffer, table, 12), want) < 1e-5
    shorter = paged_decode_reference(q, buffer, script.LAYER, table, lens - 3)
    assert script.relative_error(script.gather_sdpa(q, buffer, table, 9), shorter) < 1e-5


def test_the_datapath_scripts_figures_run_and_check_on_cpu_pools() -> None:
    script = load_script("bench_datapath_gpu")
    bench = script.measure(script.LAYOUTS[1], 1, 1, torch.device("cpu"))  # 16 blocks of 64 KiB
    assert bench.mismatches == []
    assert [f.name for f in bench.figures] == [
        "load d2h out=layers",
        "load d2h out=blocks",
        "load h2d out=layers",
        "load h2d out=blocks",
        "store write_through",
        "store write_back",
    ]
    assert all(f.seconds > 0 and f.baseline_seconds > 0 for f in bench.figures)
    assert [f.baseline for f in bench.figures[-2:]] == ["d2d + d2h", "d2d"]
