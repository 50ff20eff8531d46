"""The vLLM connector's plans (`vllm.py`): what its scheduler side asks its workers to copy
(`LoadJob`, `SaveJob`, sent in `KvtierMetadata`), and what it follows of each request
(`Planned`). Plain data without vLLM: vLLM pickles the metadata from its scheduler process to
its workers."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Store `tokens` (whole vLLM blocks of a prompt) from `blocks`."""

    req_id: str
    tokens: tuple[int, ...]
    blocks: tuple[int, ...]
    key: str


@dataclass
class Planned:
    """A request the scheduler side follows until its prompt blocks are planned for saving."""

    tokens: tuple[int, ...]
    key: str
    blocks: list[int] = field(default_factory=list)
    local: int = 0  # vLLM's own prefix hit when kvtier was asked
    external: int = 0  # tokens kvtier loads
    saved: bool = False
