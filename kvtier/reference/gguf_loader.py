"""Read a llama-architecture GGUF file into a `Llama`: hyper-parameters and dequantized weights.

GGUF lists a tensor's dims innermost first; `gguf.quants.dequantize` already returns the array
in row-major order (`[out, in]` for a linear weight), which is what `Llama` uses.

llama.cpp's converter permutes the rows of attn_q / attn_k within each head so that its
interleaved RoPE (pairs 2i, 2i+1) equals HF's `rotate_half` RoPE (pairs i, i + D/2) on the
original weights. `unpermute_rows` undoes it, so the model and its KV follow HF's layout:

    gguf row of head h:  [p0a p0b p1a p1b ...]      (pair i = original rows i and i + D/2)
    original:            [p0a p1a ... | p0b p1b ...]

Needs the `gguf` package. The file is read memory-mapped; only the float copies are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvtier.reference.llama import LayerWeights, Llama, LlamaConfig

_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "ffn_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
}
"""`LayerWeights` field -> GGUF tensor name within `blk.N.`."""


def field(reader: gguf.GGUFReader, key: str) -> Any:
    """The value of metadata field `key`; `KeyError` naming the key when the file lacks it."""
    found = reader.get_field(key)
    if found is None:
        raise KeyError(f"GGUF metadata field {key!r} is missing")
    return found.contents()


def read_config(reader: gguf.GGUFReader, name: str) -> LlamaConfig:
    """The `LlamaConfig` of a llama-architecture file, with model name `name`."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture: got {arch!r}, expected 'llama'")
    num_heads = int(field(reader, "llama.attention.head_count"))
    hidden = int(field(reader, "llama.embedding_length"))
    return LlamaConfig(
        name=name,
        num_layers=int(field(reader, "llama.block_count")),
        hidden_size=hidden,
        ffn_size=int(field(reader, "llama.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(field(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // num_heads,
        vocab_size=len(field(reader, "tokenizer.ggml.tokens")),
        rope_base=float(field(reader, "llama.rope.freq_base")),
        rms_eps=float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        eos_token_id=int(field(reader, "tokenizer.ggml.eos_token_id")),
    )


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation of a `[num_heads * D, in]` weight (see above)."""
    rows, cols = weight.shape
    head_dim = rows // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, cols)
    return pairs.transpose(1, 2).reshape(rows, cols).contiguous()


def load_llama(path: Path, name: str, dtype: torch.dtype = torch.float32) -> Llama:
    """A `Llama` with every weight of the GGUF file at `path` dequantized to `dtype`."""
    reader = gguf.GGUFReader(path)
    config = read_config(reader, name)
    tensors = {t.name: t for t in reader.tensors}

    def weight(tensor_name: str) -> torch.Tensor:
        if tensor_name not in tensors:
            raise KeyError(f"GGUF tensor {tensor_name!r} is missing from {path}")
        tensor = tensors[tensor_name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        # np.array copies: F32 tensors come back as read-only views of the memory map
        return torch.from_numpy(np.array(values).reshape(shape)).to(dtype)

    layers = []
    for i in range(config.num_layers):
        parts = {key: weight(f"blk.{i}.{suffix}.weight") for key, suffix in _LAYER_TENSORS.items()}
        parts["wq"] = unpermute_rows(parts["wq"], config.num_heads)
        parts["wk"] = unpermute_rows(parts["wk"], config.num_kv_heads)
        layers.append(LayerWeights(**parts))
    embed = weight("token_embd.weight")
    # tied embeddings: files without output.weight project with the embedding matrix
    output = weight("output.weight") if "output.weight" in tensors else embed
    return Llama(config, embed, layers, weight("output_norm.weight"), output)
