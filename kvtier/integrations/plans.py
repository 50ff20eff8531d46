"""The vLLM connector's plans (`vllm.py`): what its scheduler side asks its workers to copy
(`LoadJob`, `SaveJob`, sent in `KvtierMetadata`), what it follows of each request (`Planned`,
its blocks: `follow_blocks`), which requests it plans for at all (`keyed_by_tokens`), what of a
prompt (`prompt_save`) and of a finished request's output (`output_save`) it saves, which blocks
no save may send yet (`LoadFence`), and what of a save a worker keeps when a load of its step
failed to fill some of its blocks (`cut_before`).
Plain data without vLLM: vLLM pickles the metadata from its scheduler process to its workers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
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
    output: int = 0  # of `tokens`, the last ones past the prompt's whole blocks (`decode_tokens`)


class Save(Enum):
    """Where a request's prompt save stands."""

    DUE = "due"  # planned once the prompt is computed past kvtier's prefix
    SENT = "sent"  # planned (queued, perhaps): only its output's blocks may follow
    SPOILED = "spoiled"  # computed over another request's failed load: nothing is saved
    NEVER = "never"  # the connector's `kv_role` is kv_consumer: it loads and saves nothing


@dataclass
class Planned:
    """A request the scheduler side follows until it finishes."""

    tokens: tuple[int, ...]
    key: str
    blocks: list[int] = field(default_factory=list)
    local: int = 0  # vLLM's own prefix hit when kvtier was asked
    found: int = 0  # kvtier's prefix at the lookup, in whole vLLM blocks (0: not known)
    save: Save = Save.DUE
    asked: bool = False  # kvtier answered the lookup (`found`): counted once admitted
    admitted: bool = False  # vLLM allocated its blocks; a later lookup (resumed) asks again

    @property
    def due(self) -> bool:
        return self.save is Save.DUE


def roles(kv_transfer_config: Any) -> tuple[bool, Save]:
    """What vLLM's `kv_role` lets the connector do, as vLLM's own properties read it: whether
    it loads (`kv_consumer`, `kv_both`), and the save state its requests start in: `DUE` where
    it saves (`kv_producer`, `kv_both`), `NEVER` for a consumer (a decode instance that reads
    what prefill instances stored: it writes nothing back)."""
    saves = bool(kv_transfer_config.is_kv_producer)
    return bool(kv_transfer_config.is_kv_consumer), Save.DUE if saves else Save.NEVER


class LoadFence:
    """The blocks of recent loads, which no prompt save planned now may send: a load that
    fails reports its blocks in its step's output, and vLLM's async scheduling (its default)
    plans the next step before it has processed that output (two batches in flight), so the
    blocks of the loads of this step and of the step before are fenced. A save planned then
    would send a synchronous load's unfilled blocks, and the KV computed over them, as the
    prompt's KV.

    And the blocks a failed load left unfilled (`owed`) until the request that loaded them has
    recomputed them: vLLM has one request recompute a shared block and the others that hold
    it wait for it (audit BP: a sharer saved them, unfilled, after the loader was aborted).
    If the loader leaves first (`left`: finished or preempted), every request holding them
    saves nothing (`Save.SPOILED`): no request recomputes them. They stay in vLLM's prefix
    cache under their hashes, so they are `stale` until a request computes them (its tokens
    there are not yet computed when it is scheduled: the block was given to it anew), and a
    request that a later step admits with a prefix hit on one saves nothing either
    (`follow_blocks`; review R2: a request admitted after the loader was aborted saved them
    as its prompt's KV, 32 of 64 tokens wrong)."""

    def __init__(self) -> None:
        self._before: frozenset[int] = frozenset()  # of the loads of the step before
        self._now: frozenset[int] = frozenset()
        self._scheduled: frozenset[str] = frozenset()  # the requests the last step scheduled
        self.owed: dict[int, tuple[str, int]] = {}  # block -> (its loader, tokens to recompute)
        self.stale: set[int] = set()  # blocks owed by a loader that left (`left`)

    def blocks(
        self, loads: list[LoadJob], scheduled: Mapping[str, int], computed: Mapping[str, int]
    ) -> set[int]:
        """The fenced blocks of a step whose loads are `loads`, which schedules the requests
        `scheduled` (with their tokens: vLLM's `num_scheduled_tokens`) over `computed` (request
        -> tokens computed before; called once a step)."""
        self._before, self._now = self._now, frozenset(b for job in loads for b in job.blocks)
        self._scheduled = frozenset(scheduled)
        for block, (loader, need) in list(self.owed.items()):
            if loader in scheduled and computed.get(loader, 0) + scheduled[loader] >= need:
                del self.owed[block]  # recomputed by this step, before its saves
        return set(self._now | self._before | self.owed.keys())

    def left(
        self, req_ids: Iterable[str], requests: dict[str, Planned], planned: Planned | None = None
    ) -> None:
        """`req_ids` left vLLM's running requests (preempted, or finished: its `planned`): the
        blocks they owed, none recomputes, so no request holding one saves anything, nor a
        finished one holding a block still owed."""
        leaving = set(req_ids)
        gone = {block for block, (loader, _) in self.owed.items() if loader in leaving}
        for block in gone:
            del self.owed[block]
        self.stale |= gone
        held = [p for p in requests.values() if not gone.isdisjoint(p.blocks)]
        if planned is not None and not (gone | self.owed.keys()).isdisjoint(planned.blocks):
            held.append(planned)
        for one in held:
            if one.save is not Save.NEVER:
                one.save = Save.SPOILED

    def computed_over(self, req_id: str, blocks: set[int]) -> bool:
        """Whether the last step scheduled `req_id` after a step whose loads wrote some of
        `blocks`: planned before that step's output was known (async scheduling), it computed
        over them."""
        return req_id in self._scheduled and not blocks.isdisjoint(self._before)


def after_failures(
    requests: dict[str, Planned], failed: set[str], invalid: set[int], fence: LoadFence, bs: int
) -> set[str]:
    """A step's failed loads (`failed` by request, `invalid` by vLLM block) applied to the
    `requests` followed (blocks of `bs` tokens); the ids of those they touch, which no later
    lookup claims. vLLM recomputes a request whose own load failed from its first unfilled
    block, and one sharing such a block (its prefix cache) from the tokens it had before the
    failed step: either's prompt is saved once recomputed (`found` 0). A sharer that a later
    step scheduled before the failure was known (async scheduling) keeps what that step
    computed over the unfilled block (vLLM takes back only the failed step's tokens): it saves
    nothing (`Save.SPOILED`), neither its prompt nor its output. The blocks a request's own
    load failed to fill are `fence.owed` until it recomputes them (`LoadFence`)."""
    touched = set()
    for req_id, planned in requests.items():
        held = invalid.intersection(planned.blocks)
        if req_id not in failed and not held:
            continue
        touched.add(req_id)
        own = planned.blocks[planned.local // bs : planned.found // bs]
        fence.owed.update((b, (req_id, (i + 1) * bs)) for i, b in enumerate(planned.blocks)
                          if b in held and b in own)  # fmt: skip
        shared = held.difference(own)
        if planned.save is Save.SPOILED or fence.computed_over(req_id, shared):
            planned.save = Save.SPOILED
        elif planned.save is not Save.NEVER:
            planned.found, planned.save = 0, Save.DUE
    return touched


def follow_blocks(
    requests: dict[str, Planned], scheduled: Any, fence: LoadFence | None = None, bs: int = 1
) -> dict[str, int]:
    """Bring the block ids of the `requests` followed up to date with a step's vLLM
    `SchedulerOutput` (`scheduled`); the tokens each request it schedules computed before it.
    With `fence`, its `stale` blocks (blocks of `bs` tokens): one a request holds before its
    computed tokens (a prefix hit) spoils its saves, one it has yet to compute is new."""
    computed: dict[str, int] = {}
    for new in scheduled.scheduled_new_reqs:
        computed[new.req_id] = new.num_computed_tokens
        planned = requests.get(new.req_id)
        if planned is not None:
            planned.blocks = list(new.block_ids[0])
        _stale(fence, planned, list(new.block_ids[0]), new.num_computed_tokens, bs)
    cached = scheduled.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        computed[req_id] = cached.num_computed_tokens[i]
        planned = requests.get(req_id)
        more = cached.new_block_ids[i]
        resumed = req_id in cached.resumed_req_ids
        if more is not None:  # a resumed request's blocks anew; a running one's added: new
            _stale(fence, planned, list(more[0]), computed[req_id] if resumed else 0, bs)
        if planned is None or more is None:
            continue
        if resumed:
            planned.blocks = list(more[0])
        else:
            planned.blocks.extend(more[0])
    return computed


def _stale(
    fence: LoadFence | None, planned: Planned | None, blocks: list[int], computed: int, bs: int
) -> None:
    """`follow_blocks`'s look at `blocks` (from the request's first, or new ones: `computed`
    0) for the fence's stale ones."""
    if fence is None or not fence.stale or fence.stale.isdisjoint(blocks):
        return
    for i, block in enumerate(blocks):
        if block not in fence.stale:
            continue
        if i * bs < computed:  # read as cached: bytes that no request recomputed
            if planned is not None and planned.save is not Save.NEVER:
                planned.save = Save.SPOILED
        else:  # the request computes it: its bytes are new
            fence.stale.discard(block)


def keyed_by_tokens(request: Any) -> bool:
    """Whether a vLLM request's KV is a function of its token ids alone (`vllm.py`, Inputs): no
    LoRA adapter, no multimodal input, no prompt embeddings, the extra keys of vLLM's block
    hashes besides the cache salt. Asked again when it finishes (`output_save`): a streaming
    session's later chunk may bring an image that its first chunk, looked up, did not have."""
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
    in an error and its KV is still its tokens' alone (`keyed_by_tokens`): with `decode`, the
    whole blocks its output filled past its prompt's; and its prompt's past those kvtier held
    (`found`) if that was computed but never saved (its save waits two steps after a load into
    its blocks: `LoadFence`)."""
    if request.status.name in UNSAVED or planned.save in (Save.SPOILED, Save.NEVER):
        return None
    if not keyed_by_tokens(request):
        return None
    prompt = len(planned.tokens) - len(planned.tokens) % bs
    # KV in place: computed by steps whose output vLLM has processed (async scheduling)
    done = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
    done = min(done, len(request.all_token_ids), len(block_ids) * bs)
    whole = done - done % bs if decode else min(done - done % bs, prompt)
    unsaved = planned.due and done >= len(planned.tokens)
    start = min(planned.found, prompt) if unsaved else prompt
    if whole <= start:
        return None
    tokens = tuple(request.all_token_ids[:whole])
    blocks = tuple(block_ids[: whole // bs])
    output = max(0, whole - prompt)
    return SaveJob(request.request_id, tokens, blocks, planned.key, start, True, output)


def prompt_save(req_id: str, planned: Planned, done: int, bs: int) -> SaveJob | None:
    """The save of a prompt computed up to `done` tokens (vLLM blocks of `bs` tokens): its
    whole blocks past those kvtier held at the lookup (`found`); None while some are still to
    compute, or when kvtier held them all."""
    whole = len(planned.tokens) - len(planned.tokens) % bs
    if done < len(planned.tokens) or whole <= planned.found:
        return None
    blocks = tuple(planned.blocks[: whole // bs])
    return SaveJob(req_id, planned.tokens[:whole], blocks, planned.key, planned.found)


def cut_before(job: SaveJob, unfilled: set[int] | None, bs: int) -> SaveJob | None:
    """`job` up to its first block in `unfilled` (blocks a load failed to fill: their KV, and
    that of every later block, computed over them, is not the tokens'), sending nothing of them
    (even if the prefix below `start` has left kvtier: `saving.store_job`); `job` itself when
    none is. None when nothing is left to send, but a `release` job is kept (without blocks if
    need be): vLLM holds the request's blocks until it is reported. `unfilled` None: none is
    sent (an MLA model's TP rank past 0: rank 0 saves the KV they all hold, `settings.tp_rank`)."""
    if unfilled is None:
        return released(job)
    cut = next((i for i, block in enumerate(job.blocks) if block in unfilled), None)
    if cut is None:
        return job
    whole = cut * bs
    if whole <= job.start:
        return released(job)
    output = max(0, job.output - (len(job.tokens) - whole))
    tokens, blocks = job.tokens[:whole], job.blocks[:cut]
    return SaveJob(job.req_id, tokens, blocks, job.key, job.start, job.release, output)


def released(job: SaveJob | None) -> SaveJob | None:
    """What of `job` a worker that sends none of its KV runs: its report alone, if it is a
    `release` job (vLLM holds the request's blocks until every worker reports it)."""
    return SaveJob(job.req_id, (), (), job.key, release=True) if job and job.release else None
