"""benchmarks/bench_datapath.py (issue 19) at tiny sizes: its rounds alternate and time what
they should, every in-process figure comes out positive with its loads bit-exact, and the load
check really compares bytes (a corrupted expectation, or a load that writes nothing into `out`,
is caught). The sidecar part runs end to end against a real `kvtier serve` (slow)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import KVStore, parse_config
from kvtier.results import LoadResult

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    """The script as a module (registered: its dataclasses look their module up), with
    benchmarks/ on the path while it imports bench_service, as benchmarks import each other."""
    spec = importlib.util.spec_from_file_location(
        "bench_datapath", BENCHMARKS / "bench_datapath.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_datapath"] = module
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    yield module
    del sys.modules["bench_datapath"]


def test_rounds_rotate_the_order_skip_the_warmup_and_run_before_untimed(bench: Any) -> None:
    calls: list[str] = []
    ops = [
        bench.Op(lambda: calls.append("a"), lambda: calls.append("clear")),
        bench.Op(lambda: calls.append("b")),
    ]
    seconds = bench.medians(ops, repeat=2, warmup=1)
    # round 0 (warm-up): a, b; round 1: b, a; round 2: a, b
    assert calls == ["clear", "a", "b", "b", "clear", "a", "clear", "a", "b"]
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


def test_a_figure_is_the_baseline_seconds_over_its_own(bench: Any) -> None:
    figure = bench.Figure("1MiB", 16, "store write_through", "store", 10**9, 0.5, "2 raw", 0.4)
    assert (figure.gbps, figure.baseline_gbps) == (2.0, 2.5)
    assert figure.ratio == pytest.approx(0.8) and figure.met
    assert not bench.Figure("1MiB", 16, "x", "store", 10**9, 0.5, "raw", 0.39).met


def test_every_in_process_figure_is_positive_and_every_load_bit_exact(bench: Any) -> None:
    run = bench.Run()
    for geometry in bench.GEOMETRIES:  # 1 MiB blocks: a 2-block prompt; 64 KiB: 32 blocks
        bench.measure_geometry(run, geometry, [2], repeat=1, rounds=1, sidecar=False)
    assert run.mismatches == []
    names = [(f.block, f.name) for f in run.figures]
    assert names == [
        (block, name)
        for block in ("1MiB", "64KiB")
        for name in (
            "load out=layers",
            "load out=blocks",
            "load start=80% out=layers",
            "load (allocating)",
            "store write_through",
            "store write_back",
        )
    ]
    assert all(f.gbps > 0 and f.baseline_gbps > 0 for f in run.figures)
    whole = [f for f in run.figures if "start" not in f.name]
    assert all(f.nbytes == 2 << 20 for f in whole)
    tails = {f.block: f.nbytes for f in run.figures if "start" in f.name}  # the last fifth
    assert tails == {"1MiB": 1 << 20, "64KiB": 7 * (64 << 10)}
    verdicts = run.verdicts()
    assert verdicts["sidecar"] is None and verdicts["concurrency"] is None
    assert all(isinstance(verdicts[p], bool) for p in ("load_out", "load_alloc", "store"))
    assert {f["name"] for f in run.as_json()["figures"]} == {name for _, name in names}


@pytest.fixture
def stored(bench: Any) -> Iterator[tuple[KVStore, Any]]:
    geometry = bench.GEOMETRIES[1]  # 64 KiB blocks
    prompt = bench.prompt_of(geometry.layout, 1, 0, seed=3)
    store = KVStore(parse_config(geometry.config(2, "write_through")))
    store.store(prompt.tokens, prompt.kv)
    yield store, prompt
    store.close()


def test_the_load_check_passes_exact_loads_and_catches_one_changed_element(
    bench: Any, stored: tuple[KVStore, Any]
) -> None:
    store, prompt = stored
    assert bench.check_loads("exact", store.load, prompt, into_out=True) == []
    prompt.kv.view(torch.int16)[3, 1, 100, 2, 7] ^= 1  # the expectation, one bit off
    problems = bench.check_loads("corrupt", store.load, prompt, into_out=True)
    assert problems == [
        f"corrupt load {what}: 1 of {n} slices along dim 0 differ"
        for what, n in (("out=layers", 4), ("out=blocks", 16), ("(allocating)", 4))
    ]


def test_a_load_that_leaves_out_as_it_was_is_caught_out_is_zeroed_first(
    bench: Any, stored: tuple[KVStore, Any]
) -> None:
    store, prompt = stored
    prompt.out.copy_(prompt.kv)  # what a raw-copy round leaves there

    def lazy(tokens: Any, out: torch.Tensor | None = None, layout: str = "layers") -> LoadResult:
        if out is None:
            return store.load(tokens)
        return LoadResult(len(tokens), out)  # claims the prefix, writes nothing

    problems = bench.check_loads("lazy", lazy, prompt, into_out=True)
    assert [p.split(":")[0] for p in problems] == ["lazy load out=layers", "lazy load out=blocks"]


def test_the_check_compares_bits_so_a_nan_equals_itself(bench: Any) -> None:
    kv = torch.full((2, 2, 4, 1, 2), float("nan"), dtype=torch.bfloat16)
    assert bench.check_load("nan", LoadResult(4, kv.clone()), kv) == []
    short = bench.check_load("short", LoadResult(2, kv[:, :, :2]), kv)
    assert short == [
        "short: loaded 2 tokens of shape (2, 2, 2, 1, 2), expected 4 of (2, 2, 4, 1, 2)"
    ]


@pytest.mark.slow
def test_the_sidecar_part_runs_end_to_end_against_a_real_server(bench: Any) -> None:
    run = bench.Run()
    bench.measure_geometry(run, bench.GEOMETRIES[0], [2], repeat=1, rounds=1, sidecar=True)
    assert run.mismatches == []
    sidecar = [f for f in run.figures if f.point == "sidecar"]
    assert [f.name for f in sidecar][-1] == "sidecar store" and all(f.gbps > 0 for f in sidecar)
    one, many = run.concurrency["1MiB"]
    assert (one.clients, one.rounds, many.clients, many.rounds) == (1, 16, 16, 1)
    assert len(one.store_s) == len(many.load_s) == 16 and many.gbps > 0
