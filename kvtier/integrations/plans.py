"""The vLLM connector's plans (`vllm.py`): what its scheduler side asks its workers to copy
(`LoadJob`, `SaveJob`, sent in `KvtierMetadata`), and what it follows of each request
(`Planned`), which requests it plans for at all (`keyed_by_tokens`), and what of a finished
request's output it saves (`output_save`). Plain data without vLLM: vLLM pickles the metadata
from its scheduler process to its workers."""

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
    """Store `tokens` (whole vLLM blocks: a prompt's, or, with `release`, a finished request's
    prompt and output) from `blocks`, sending the KV from `start` on, which kvtier was seen to
    lack (below `tokens[:start]`; all of it if that prefix has left kvtier since). A `release`
    job is reported in `finished_sending` once done, saved or not: vLLM holds the request's
    blocks until then."""

    req_id: str
    tokens: tuple[int, ...]
    blocks: tuple[int, ...]  # vLLM block ids of all `tokens`
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
    found: int = 0  # kvtier's prefix at the lookup, in whole vLLM blocks (0: not known)
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


UNSAVED = frozenset({"FINISHED_ERROR", "FINISHED_IGNORED"})  # the KV may not be the tokens'


def output_save(
    request: Any, planned: Planned, block_ids: list[int], bs: int, decode: bool = True
) -> SaveJob | None:
    """The `release` save of a finished vLLM request (blocks of `bs` tokens), if it did not end
    in an error: with `decode`, the whole blocks its output filled past its prompt's; and its
    prompt's past those kvtier held (`found`) if that was computed but never saved (its save
    waits for the step after a synchronous load: `vllm.py`)."""
    if request.status.name in UNSAVED:
        return None
    prompt = len(planned.tokens) - len(planned.tokens) % bs
    # KV in place: computed by steps whose output vLLM has processed (async scheduling)
    done = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
    done = min(done, len(request.all_token_ids), len(block_ids) * bs)
    whole = done - done % bs if decode else min(done - done % bs, prompt)
    unsaved = not planned.saved and done >= len(planned.tokens)
    start = min(planned.found, prompt) if unsaved else prompt
    if whole <= start:
        return None
    tokens = tuple(request.all_token_ids[:whole])
    blocks = tuple(block_ids[: whole // bs])
    return SaveJob(request.request_id, tokens, blocks, planned.key, start, release=True)
