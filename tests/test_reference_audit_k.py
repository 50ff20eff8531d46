"""Auditor K's findings on the reference engine and the keyed API, pinned.

- A one-token prompt is valid (`prefill` refuses only an empty one): it has no prefix to reuse,
  so nothing is looked up, and it is computed as a cold run is. Before, `lookup(prompt[:-1])`
  was `lookup([])` and raised `InvalidTokensError: tokens: got an empty sequence`.
- A prompt holding an id outside the model's vocabulary (49152 ids) is refused with an
  `InvalidTokensError` naming the id and the vocabulary's range, before the cache is touched.
  Before, the embedding lookup raised a bare `IndexError`.
- `KeyedPages(page_tokens)` is bounded above (`MAX_PAGE_TOKENS`): a huge value is an
  `InvalidArgumentError` naming it and the range. Before, `KeyedPages(2**40)` built a list of
  2**40 filler tokens (a `MemoryError`, or the OOM killer).
- Reusing a cached prefix adds no error of kvtier's: the logits over leased pages are those of
  the model's own incremental pass (`Llama.forward(suffix, past_kv)`), which in fp64 equals a
  full pass exactly (no KV position, mask or token is off). In fp32 the incremental pass sums
  in another order than a full pass (a matmul of 1 row against one of 33), and SmolLM2's
  residual stream reaches ~2e4 on a repeated token (a massive activation, where one fp32 ulp
  is 2e-3), so a degenerate prompt's logits differ by up to `DEGENERATE_ATOL` where natural
  text stays within 1e-4. README ("Reference engine") states that bound.

SmolLM2-135M in fp32 over an fp32 store, 16 tokens a block, attention by the torch reference
kernel (as in `test_reference_engine.py`). Skipped unless the model file is installed.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf", reason="the reference model needs the gguf package")
pytest.importorskip("tokenizers", reason="the reference model needs the tokenizers package")

import torch

import kvtier
from kvtier import keyed
from kvtier.config import parse_config
from kvtier.errors import InvalidArgumentError, InvalidTokensError
from kvtier.kernels import paged_attention
from kvtier.keyed import KeyedPages
from kvtier.reference import LayerWeights, Llama, find_smollm2_gguf, generate
from kvtier.reference.engine import Engine
from kvtier.store import KVStore

if find_smollm2_gguf() is None:
    pytest.skip(reason="SmolLM2 GGUF not installed", allow_module_level=True)

README = Path(kvtier.__file__).resolve().parent.parent / "README.md"
"""The README beside the kvtier under test (the old tree's, when run against it)."""
VOCAB = 49152
DEGENERATE_ATOL = 5e-3
"""How far a degenerate prompt's logits over a cached prefix may be from a cold run's (fp32
summation order amplified by SmolLM2's massive activations; module docstring)."""


def config() -> Any:
    return parse_config(
        {
            "model": {
                "name": "SmolLM2-135M-Instruct",
                "num_layers": 30,
                "num_kv_heads": 3,
                "head_dim": 64,
                "dtype": "float32",
            },
            "block_tokens": 16,
            "tiers": {"gpu": {"capacity": "64MiB", "device": "cpu"}, "host": {"capacity": "64MiB"}},
            "mover": {"background": False},
        }
    )


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PagedAttention` on the CPU picks the torch reference (the interpreter is slow)."""
    monkeypatch.setattr(paged_attention, "INTERPRETED", False)


# ---- finding 6: a one-token prompt --------------------------------------------------------------


def test_a_one_token_prompt_is_computed_as_a_cold_run(smollm2: Llama) -> None:
    with KVStore(config()) as store:
        run = Engine(smollm2, store).generate([1], max_new_tokens=2)
        assert run.prefill.hit.num_tokens == 0 and run.prefill.reused_tokens == 0
        assert run.prefill.stored.stored_tokens == 0  # less than a block
        assert run.tokens == generate(smollm2, [1], 2)
        cold, _ = smollm2.forward(torch.tensor([1], dtype=torch.int64))
        assert torch.equal(run.prefill.logits, cold)
        assert store.leases() == []
        store.check()


# ---- finding 9: ids outside the vocabulary, huge pages -------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "at"),
    [([1] * 20 + [VOCAB], 20), ([2**31] + [1] * 20, 0), ([1, 2, 2**32 - 1], 2)],
    ids=["vocab-size-last", "2**31-first", "2**32-1"],
)
def test_an_id_outside_the_vocabulary_is_refused_before_the_cache_is_touched(
    smollm2: Llama, prompt: list[int], at: int
) -> None:
    with KVStore(config()) as store:
        with pytest.raises(InvalidTokensError) as refused:
            Engine(smollm2, store).prefill(prompt)
        message = str(refused.value)
        assert f"prompt[{at}]: got {prompt[at]}" in message and f"[0, {VOCAB})" in message
        assert store.lookup([1] * 20).num_tokens == 0  # nothing stored
        store.check()


def test_a_huge_page_size_is_refused_typed_naming_the_range() -> None:
    with pytest.raises(InvalidArgumentError, match=r"got 65537, expected an int in \[8, 65536\]"):
        KeyedPages(2**16 + 1)
    assert keyed.MAX_PAGE_TOKENS == 2**16
    for huge in (2**31, 2**40, 2**200):  # before, 2**40 built a list of 2**40 ints
        with pytest.raises(InvalidArgumentError, match=r"expected an int in \[8, 65536\]"):
            KeyedPages(huge)
    largest = KeyedPages(2**16, "scope")
    assert len(largest.page("ab")) == 2**16 and max(largest.page("ab")) < 2**32


# ---- finding 7: logits over a cached prefix against a cold run -----------------------------------


DEGENERATE = {"[0]*33": [0] * 33, "[0]*49": [0] * 49, "[1, 2]*24+[0]": [1, 2] * 24 + [0]}


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
@pytest.mark.parametrize("name", list(DEGENERATE))
def test_over_a_cached_prefix_the_logits_are_the_models_incremental_pass_exactly(
    smollm2: Llama, name: str
) -> None:
    """kvtier adds nothing: the paged path equals `forward(suffix, past_kv)`; both are within
    the README's degenerate-prompt bound of a cold run, and give its greedy ids."""
    prompt = DEGENERATE[name]
    ids = torch.tensor(prompt, dtype=torch.int64)
    with KVStore(config()) as store:
        engine = Engine(smollm2, store)
        cold = engine.prefill(prompt)
        warm = engine.prefill(prompt)
    reused = warm.reused_tokens
    assert reused == (len(prompt) - 1) // 16 * 16
    incremental, _ = smollm2.forward(ids[reused:], cold.kv[:, :, :reused])
    torch.testing.assert_close(warm.logits, incremental, atol=1e-6, rtol=0)
    torch.testing.assert_close(warm.logits, cold.logits[reused:], atol=DEGENERATE_ATOL, rtol=0)
    assert torch.equal(warm.logits.argmax(-1), cold.logits[reused:].argmax(-1))


def test_in_fp64_the_incremental_pass_equals_a_full_pass(smollm2: Llama) -> None:
    """What differs in fp32 is summation order only: no KV position, mask or token is off."""
    model = as_fp64(smollm2)
    ids = torch.zeros(49, dtype=torch.int64)
    full, kv = model.forward(ids)
    incremental, _ = model.forward(ids[48:], kv[:, :, :48])
    torch.testing.assert_close(incremental, full[48:], atol=1e-9, rtol=0)


def test_the_readme_states_the_degenerate_prompt_bound() -> None:
    section = README.read_text().split("## Reference engine", 1)[1].split("\n## ", 1)[0]
    text = " ".join(section.split())
    assert re.search(r"logits agree to 1e-4 on natural text", text), text[:400]
    assert f"within {DEGENERATE_ATOL:.0e}".replace("e-0", "e-") in text


def as_fp64(model: Llama) -> Llama:
    """A copy of `model` with every weight in fp64."""
    layers = [
        LayerWeights(**{f.name: getattr(layer, f.name).double() for f in dataclasses.fields(layer)})
        for layer in model.layers
    ]
    norm, output = model.output_norm.double(), model.output.double()
    return Llama(model.config, model.embed.double(), layers, norm, output)
