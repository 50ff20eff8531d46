"""kvtier's vLLM connector after audit C, against vLLM's real scheduler (`vllm_engine.py`) and a
real `kvtier serve`:

- vLLM's async scheduling (its default) plans step N+1 before it processes step N's output.
  A synchronous load (`kvtier.load_async: false`) fails in step N (the prefix left kvtier
  after the lookup); the prompt's save planned in step N+1 must not send the blocks the load
  left unwritten: kvtier then holds nothing but the prompt's true KV.
- A request that takes such a load's blocks from vLLM's prefix cache in the step after it,
  before the failure is known, computes its own KV over them, and vLLM takes back only the
  failed step's tokens: it saves nothing.
- A streaming session (a resumable request) looked up on a text chunk, whose next chunk
  brings an image: its KV from there depends on the image, so its save at the session's end
  stores none of it (the first chunk's prompt blocks stay saved).

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_audit_C.py
"""

from __future__ import annotations

from typing import Any

import pytest
import test_vllm_audit4 as audit4
from service_server import Server
from test_vllm_audit4 import PRELUDE
from test_vllm_connector import sidecar as sidecar  # the module's fixture

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

DRIVER = (
    PRELUDE
    + """
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.structured_output import StructuredOutputManager

def make(asynchronous=False, **args):
    sched, worker, kvc = ve.built(dict(url=url, api_key=key, **args))
    if asynchronous:  # vLLM's default: the step after is planned before this one's output
        config = sched.vllm_config
        sched = AsyncScheduler(vllm_config=config, kv_cache_config=kvc, block_size=BS,
                               structured_output_manager=StructuredOutputManager(config),
                               log_stats=True)
    caches = {f"model.layers.{i}.self_attn.attn": torch.full(
        (ve.NUM_BLOCKS, ve.HEADS, BS, 2 * ve.DIM), 3.0, dtype=torch.float16)
        for i in range(ve.LAYERS)}  # an earlier request's bytes in every block
    worker.register_kv_caches(caches)
    init_none_hash(sha256)
    return sched, worker, list(caches.values())

def request(rid, prompt, max_tokens=2, **kw):
    p = SamplingParams(max_tokens=max_tokens); p.update_from_generation_config({}, 2)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=p,
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256), **kw)

def execute(so, worker, caches, tables, hook=None):
    meta = so.kv_connector_metadata
    if hook:
        hook(meta)
    worker.handle_preemptions(meta); worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for new in so.scheduled_new_reqs:
        tables[new.req_id] = list(new.block_ids[0])
    c = so.scheduled_cached_reqs
    for i, rid in enumerate(c.req_ids):
        if c.new_block_ids[i] is not None:
            more = list(c.new_block_ids[i][0])
            tables[rid] = more if rid in c.resumed_req_ids else tables[rid] + more
    starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    starts.update(zip(c.req_ids, c.num_computed_tokens))
    for rid, count in so.num_scheduled_tokens.items():
        for p in range(starts[rid], starts[rid] + count):  # the forward
            for layer, cache in enumerate(caches):
                cache[tables[rid][p // BS], :, p % BS] = ve.kv_at(SEED, p)[layer]
    worker.wait_for_save()
    sent, recving = worker.get_finished(so.finished_req_ids)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=KVConnectorOutput(finished_recving=recving, finished_sending=sent,
                                              invalid_block_ids=errors))

out = {}
if scenario == "async":  # with opts["share"]: S, sharing R's loaded blocks, a step later
    prompt = list(range(base, base + 56))  # 3 whole blocks; kvtier holds the first 2
    other = prompt[:32] + list(range(base + 5000, base + 5024))
    store(prompt[:32])
    sched, worker, caches = make(True, load_async=False, save_async=opts["save_async"])
    tables, plans = {}, []
    def evict(meta):  # the prefix leaves kvtier between the lookups and R's load
        plans.append([[j.req_id, list(j.blocks)] for j in meta.saves])
        if meta.loads and "loaded" not in out:
            out["loaded"] = list(meta.loads[0].blocks)
            clear()
    sched.add_request(request("R", prompt, max_tokens=4))
    so = sched.schedule(); result = execute(so, worker, caches, tables, evict)
    if opts.get("share"):
        sched.add_request(request("S", other, max_tokens=4))  # before R's step's output is known
    for _ in range(30):  # two batches in flight: step N+1 is planned before N's output
        later = sched.schedule() if sched.requests else None
        after = execute(later, worker, caches, tables, evict) if later else None
        sched.update_from_output(so, result)
        if later is None:
            break
        so, result = later, after
    worker.saving.flush()
    out["plans"], out["tables"] = plans, tables
    out["held"], out["true"] = true_tokens(prompt)
    with Client(url, api_key=key) as client:
        out["other_held"] = client.lookup(other).num_tokens
    out["failed_loads"] = worker.stats["failed_loads"]
elif scenario == "session":
    first = list(range(base, base + 20))
    image = [base + 900] * 32  # an image's placeholder tokens: the same for every image
    sched, worker, caches = make(save_async=False)
    session = request("S", first, resumable=True)
    sched.add_request(session)
    tables = {}
    for _ in range(5):  # the first chunk to its end: the session waits for more input
        so = sched.schedule()
        sched.update_from_output(so, execute(so, worker, caches, tables))
    out["first_saved"] = worker.stats["saved_tokens"]
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier="image-A",
                                    mm_position=PlaceholderRange(offset=0, length=32))
    sched.add_request(request("S", image + [base + 1], resumable=True, mm_features=[feature]))
    out["with_image"] = bool(session.mm_features)
    # the chunk computed by a multimodal model's forward (this tiny one has no encoder)
    session.num_computed_tokens = session.num_tokens - 1
    sched.finish_requests("S", session.status.__class__.FINISHED_ABORTED)  # the session ends
    for _ in range(3):
        so = sched.schedule()
        saves = so.kv_connector_metadata.saves
        out.setdefault("end_saves", []).extend([j.req_id, len(j.tokens)] for j in saves)
        sched.update_from_output(so, execute(so, worker, caches, tables))
    with Client(url, api_key=key) as client:
        out["held"] = client.lookup(list(session.all_token_ids)).num_tokens
print(json.dumps(out))
"""
)


def drive(server: Server, scenario: str, **opts: Any) -> dict[str, Any]:
    """Run one of `DRIVER`'s scenarios in a process of its own; what it printed."""
    return audit4.drive(server, scenario, DRIVER, **opts)


@pytest.mark.parametrize("save_async", [False, True])
def test_under_async_scheduling_a_failed_synchronous_load_spoils_no_save(
    sidecar: Server, save_async: bool
) -> None:
    out = drive(sidecar, "async", base=610_000 + 1000 * save_async, save_async=save_async)
    assert out["failed_loads"] == 1, out
    loaded = set(out["loaded"])
    # the plan of the step after the failed load's (made before its output) saves none of them
    assert not any(loaded & set(blocks) for step in out["plans"][:2] for _, blocks in step), out
    assert out["held"] == out["true"] and out["held"] >= 48, out  # recomputed, saved true


def test_a_sessions_chunk_with_an_image_is_not_saved_as_tokens(sidecar: Server) -> None:
    out = drive(sidecar, "session", base=620_000)
    assert out["with_image"] is True and out["first_saved"] == 16, out
    assert out["held"] == 16, out  # the first chunk's prompt block; nothing past the image


def test_a_request_a_later_step_computed_over_a_failed_load_saves_nothing(sidecar: Server) -> None:
    # S takes R's two loaded blocks from vLLM's prefix cache in the step after R's load, before
    # that load's failure is known, and computes its own tail over them; vLLM recomputes R, and
    # takes back from S only what the failed step computed (none), so S's KV past them is not
    # its tokens' (before: S's prompt was saved, blocks [1, 2, 5])
    out = drive(sidecar, "async", base=630_000, save_async=False, share=True)
    assert out["failed_loads"] == 1 and set(out["loaded"]) <= set(out["tables"]["S"]), out
    assert not any(req == "S" for step in out["plans"] for req, _ in step), out
    assert out["other_held"] == 32, out  # the prefix R saved once recomputed; none of S's tail
    assert out["held"] == out["true"] and out["held"] >= 48, out  # R recomputed and saved true
