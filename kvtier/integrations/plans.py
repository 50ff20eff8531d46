"""The vLLM connector's plans (`vllm.py`): what its scheduler side asks its workers to copy
(`LoadJob`, `SaveJob`, sent in `KvtierMetadata`), and what it follows of each request
(`Planned`), and which requests it plans for at all (`keyed_by_tokens`). Plain data without
vLLM: vLLM pickles the metadata from its scheduler process to its workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoadJob:
    """Copy prompt tokens `start..stop` (whole vLLM blocks) of `tokens[:stop]` into `blocks`."""

    req_id: str
    tokens: tuple[int, ...]  # the prompt up to `stop`
    start: int
    blocks: tuple[int, ...]  # vLLM block ids of tokens start..stop
    key: str  # the API key of the request's tenant


@dataclass(frozen=True)
class SaveJob:
    """Store `tokens[start:]` (whole vLLM blocks: a prompt's, or, with `release`, the output
    of a finished request past its prompt's blocks) from `blocks`, below `tokens[:start]`.
    A `release` job is reported in `finished_sending` once done, saved or not: vLLM holds the
    request's blocks until then."""

    req_id: str
    tokens: tuple[int, ...]
    blocks: tuple[int, ...]  # vLLM block ids of tokens start..
    key: str
    start: int = 0
    release: bool = False


@dataclass
class Planned:
    """A request the scheduler side follows until it finishes."""

    tokens: tuple[int, ...]
    key: str
    blocks: list[int] = field(default_factory=list)
    local: int = 0  # vLLM's own prefix hit when kvtier was asked
    external: int = 0  # tokens kvtier loads
    saved: bool = False


def keyed_by_tokens(request: Any) -> bool:
    """Whether a vLLM request's KV is a function of its token ids alone (`vllm.py`, Inputs): no
    LoRA adapter, no multimodal input, no prompt embeddings, the extra keys of vLLM's block
    hashes besides the cache salt."""
    return (
        not getattr(request, "lora_request", None)
        and not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
    )
