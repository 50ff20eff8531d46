"""Read a llama-architecture GGUF file into a `Llama`: hyper-parameters and dequantized weights.

GGUF lists a tensor's dims innermost first; `gguf.quants.dequantize` already returns the array
in row-major order (`[out, in]` for a linear weight), which is what `Llama` uses.

llama.cpp's converter permutes the rows of attn_q / attn_k within each head so that its
interleaved RoPE (pairs 2i, 2i+1) equals HF's `rotate_half` RoPE (pairs i, i + D/2) on the
original weights. `unpermute_rows` undoes it, so the model and its KV follow HF's layout:

    gguf row of head h:  [p0a p0b p1a p1b ...]      (pair i = original rows i and i + D/2)
    original:            [p0a p1a ... | p0b p1b ...]

Needs the `gguf` package. The file is read memory-mapped; only the float copies are kept.

The file is untrusted: one that cannot be parsed (empty, truncated, bad bytes, non-UTF-8
strings), a hyper-parameter of the wrong type or out of range, a tensor missing, of another
shape than the hyper-parameters give, or with fewer bytes than its shape needs, is an
`InvalidArgumentError` naming the file, the field or tensor, the value and what was expected,
raised before any weight is dequantized (so a huge declared size allocates nothing). A file that
does not exist stays a `FileNotFoundError`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvtier.errors import InvalidArgumentError, shown
from kvtier.reference.llama import LayerWeights, Llama, LlamaConfig

MAX_DIM = 1 << 20
"""The largest hyper-parameter (layers, widths, heads) a file may declare; real ones are far
below (vocabularies 2**18)."""

_PARSE_ERRORS = (OSError, ValueError, IndexError, KeyError, TypeError, OverflowError)
"""What `gguf` raises on bytes it cannot parse (numpy reshapes and views of a short map, a
UTF-8 decode, an unknown enum value)."""

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


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A reader of the GGUF file at `path`; `InvalidArgumentError` naming it when its bytes
    cannot be parsed (`FileNotFoundError` when there is no such file)."""
    try:
        return gguf.GGUFReader(path)
    except FileNotFoundError:
        raise
    except _PARSE_ERRORS as error:
        raise InvalidArgumentError(
            f"GGUF file {str(path)!r}: cannot be parsed ({type(error).__name__}: "
            f"{shown(str(error))}); expected a complete GGUF file"
        ) from None


def field(reader: gguf.GGUFReader, key: str) -> Any:
    """The value of metadata field `key`; `InvalidArgumentError` naming the key when the file
    lacks it or its value cannot be decoded (a string that is not UTF-8)."""
    found = reader.get_field(key)
    if found is None:
        raise InvalidArgumentError(f"GGUF metadata field {key!r} is missing; expected it set")
    try:
        return found.contents()
    except _PARSE_ERRORS as error:
        raise InvalidArgumentError(
            f"GGUF metadata field {key!r}: cannot be decoded ({type(error).__name__}: "
            f"{shown(str(error))})"
        ) from None


def int_field(reader: gguf.GGUFReader, key: str, low: int = 1, high: int = MAX_DIM) -> int:
    """Metadata field `key` as an int in [low, high], else `InvalidArgumentError` naming it."""
    value = field(reader, key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"GGUF field {key!r}: got {shown(value)}, expected an integer")
    if not low <= int(value) <= high:
        raise InvalidArgumentError(f"GGUF field {key!r}: got {value}, expected {low}..{high}")
    return int(value)


def float_field(reader: gguf.GGUFReader, key: str, positive: bool) -> float:
    """Metadata field `key` as a finite float (> 0, or >= 0), else `InvalidArgumentError`."""
    value = field(reader, key)
    number = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = "> 0" if positive else ">= 0"
        raise InvalidArgumentError(
            f"GGUF field {key!r}: got {shown(value)}, expected a finite number {bound}"
        )
    return float(value)


def read_config(reader: gguf.GGUFReader, name: str) -> LlamaConfig:
    """The `LlamaConfig` of a llama-architecture file, with model name `name`;
    `InvalidArgumentError` naming the field for a value of the wrong type or out of range, or
    heads that do not divide the width (query heads) or the query heads (KV heads)."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise InvalidArgumentError(f"GGUF architecture: got {shown(arch)}, expected 'llama'")
    num_heads = int_field(reader, "llama.attention.head_count")
    hidden = int_field(reader, "llama.embedding_length")
    num_kv_heads = int_field(reader, "llama.attention.head_count_kv")
    if hidden % num_heads or (hidden // num_heads) % 2 or num_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"GGUF heads: embedding_length {hidden}, head_count {num_heads}, head_count_kv "
            f"{num_kv_heads}; expected an even head_dim = embedding_length / head_count and "
            "head_count a multiple of head_count_kv"
        )
    vocab = len(field(reader, "tokenizer.ggml.tokens"))
    return LlamaConfig(
        name=name,
        num_layers=int_field(reader, "llama.block_count"),
        hidden_size=hidden,
        ffn_size=int_field(reader, "llama.feed_forward_length"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden // num_heads,
        vocab_size=vocab,
        rope_base=float_field(reader, "llama.rope.freq_base", positive=True),
        rms_eps=float_field(reader, "llama.attention.layer_norm_rms_epsilon", positive=False),
        eos_token_id=int_field(reader, "tokenizer.ggml.eos_token_id", 0, vocab - 1),
    )


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a `Llama` of `config` takes, by GGUF name, with its row-major shape."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = {
        "attn_norm": (c.hidden_size,),
        "attn_q": (q_rows, c.hidden_size),
        "attn_k": (kv_rows, c.hidden_size),
        "attn_v": (kv_rows, c.hidden_size),
        "attn_output": (c.hidden_size, q_rows),
        "ffn_norm": (c.hidden_size,),
        "ffn_gate": (c.ffn_size, c.hidden_size),
        "ffn_up": (c.ffn_size, c.hidden_size),
        "ffn_down": (c.hidden_size, c.ffn_size),
    }
    shapes = {
        "token_embd.weight": (c.vocab_size, c.hidden_size),
        "output_norm.weight": (c.hidden_size,),
        "output.weight": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        shapes.update({f"blk.{i}.{part}.weight": shape for part, shape in layer.items()})
    return shapes


def check_tensor(path: Path, tensor: Any, expected: tuple[int, ...]) -> None:
    """`InvalidArgumentError` unless `tensor` has the `expected` shape and all its bytes."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if shape != expected:
        raise InvalidArgumentError(
            f"GGUF file {str(path)!r}: tensor {tensor.name!r} has shape {shape}, expected "
            f"{expected} (from the file's hyper-parameters)"
        )
    if int(tensor.data.nbytes) != int(tensor.n_bytes):
        raise InvalidArgumentError(
            f"GGUF file {str(path)!r}: tensor {tensor.name!r} has {tensor.data.nbytes} bytes, "
            f"expected {tensor.n_bytes} (the file is truncated)"
        )


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation of a `[num_heads * D, in]` weight (see above)."""
    rows, cols = weight.shape
    head_dim = rows // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, cols)
    return pairs.transpose(1, 2).reshape(rows, cols).contiguous()


def load_llama(path: Path, name: str, dtype: torch.dtype = torch.float32) -> Llama:
    """A `Llama` with every weight of the GGUF file at `path` dequantized to `dtype`; every
    tensor it needs checked (present, shape, bytes) before the first is dequantized (module
    doc: `InvalidArgumentError`)."""
    reader = open_gguf(path)
    config = read_config(reader, name)
    tensors = {t.name: t for t in reader.tensors}
    for tensor_name, expected in expected_shapes(config).items():
        if tensor_name in tensors:
            check_tensor(path, tensors[tensor_name], expected)
        elif tensor_name != "output.weight":  # tied embeddings: see below
            raise InvalidArgumentError(
                f"GGUF file {str(path)!r}: tensor {tensor_name!r} is missing; expected it "
                f"for {config.num_layers} layers"
            )

    def weight(tensor_name: str) -> torch.Tensor:
        tensor = tensors[tensor_name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise InvalidArgumentError(
                f"GGUF file {str(path)!r}: tensor {tensor_name!r} is of type "
                f"{tensor.tensor_type.name}, which gguf cannot dequantize"
            ) from None
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
