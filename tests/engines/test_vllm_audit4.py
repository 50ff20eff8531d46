"""kvtier's vLLM connector after audit P, against vLLM's real scheduler (`vllm_engine.py`) and a
real `kvtier serve`:

- Two requests of one prefix in one step, synchronous loads, prefix caching on: R loads the
  prefix from kvtier into fresh blocks, which vLLM shares at once with C (its local hit), whose
  prompt is done in that step. The prefix leaves kvtier before R's load, which fails: no save
  sends those blocks (left with an earlier request's bytes) nor C's tail computed over them,
  neither planned by the scheduler in that step nor, when a plan names them, sent by a worker
  (inline or queued saves); what kvtier then holds of C's prompt is its true KV.
- `lookups` and `hit_tokens` count a request once vLLM admits it, the hit vLLM took: not each
  step vLLM retries a request that cannot get blocks yet (the sidecar is asked once), nor the
  hit of a request that skips cached prefixes (prompt logprobs).
- `decode_tokens` counts outputs only: a prompt's blocks saved with a finished request's
  release job are not outputs.

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.engines/vllm \\
        python -m pytest tests/engines/test_vllm_audit4.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from service_server import ADMIN_KEY, Server
from test_vllm_connector import ALICE, engine, saved
from test_vllm_connector import sidecar as sidecar  # the module's fixture

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

HERE = Path(__file__).resolve().parent

PRELUDE = """
import json, sys, tempfile
from pathlib import Path
sys.path[:0] = [sys.argv[5], str(Path(sys.argv[5]).parent)]
import httpx, torch
import vllm_engine as ve
from vllm import SamplingParams
from vllm.v1.request import Request
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.utils.hashing import sha256
from kvtier.client import Client
scenario, url, key, admin = sys.argv[1:5]
opts = json.loads(sys.argv[6])
SEED, BS = 9, ve.BLOCK
base = opts["base"]

def kv(positions):  # kvtier's layout of the forward's KV: [layers, 2, tokens, heads, dim]
    rows = torch.stack([ve.kv_at(SEED, p) for p in positions], 1)  # [layers, tokens, heads, 2d]
    return torch.stack((rows[..., : ve.DIM], rows[..., ve.DIM :]), 1)

def store(tokens):
    with Client(url, api_key=key) as client:
        client.store(tokens, kv(range(len(tokens))))

def clear():
    r = httpx.post(url + "/v1/admin/clear", headers={"authorization": "Bearer " + admin})
    assert r.status_code == 200, r.text

def true_tokens(prompt):  # of kvtier's prefix of `prompt`, how many hold the forward's KV
    with Client(url, api_key=key) as client:
        got = client.load(prompt)
    want = kv(range(got.num_tokens))
    same = [torch.equal(got.kv[:, :, p].cpu(), want[:, :, p]) for p in range(got.num_tokens)]
    return got.num_tokens, sum(same)
"""
"""A driver's first part (`drive` runs it in a process of its own): its arguments, the forward's
KV by position (`kv`), a store, an admin clear, and how much of a prefix kvtier holds true."""

DRIVER = (
    PRELUDE
    + """
from kvtier.integrations.plans import LoadJob, SaveJob
from kvtier.integrations.vllm import KvtierMetadata

def lookups():
    r = httpx.get(url + "/v1/status", headers={"authorization": "Bearer " + key})
    return r.json()["ops"]["lookups"]

def make(**args):
    sched, worker, _ = ve.built(dict(url=url, api_key=key, **args))
    caches = {f"model.layers.{i}.self_attn.attn": torch.full(
        (ve.NUM_BLOCKS, ve.HEADS, BS, 2 * ve.DIM), 3.0, dtype=torch.float16)
        for i in range(ve.LAYERS)}  # an earlier request's bytes in every block
    worker.register_kv_caches(caches)
    init_none_hash(sha256)
    return sched, worker, list(caches.values())

def request(rid, prompt, max_tokens=2, **kw):
    p = SamplingParams(max_tokens=max_tokens, **kw); p.update_from_generation_config({}, 2)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=p,
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))

def step(sched, worker, caches, tables, hook=None):
    so = sched.schedule()
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
    for rid, count in so.num_scheduled_tokens.items():
        done = sched.requests[rid].num_computed_tokens
        for p in range(done - count, done):
            for layer, cache in enumerate(caches):
                cache[tables[rid][p // BS], :, p % BS] = ve.kv_at(SEED, p)[layer]
    worker.wait_for_save()
    sent, recving = worker.get_finished(so.finished_req_ids)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    ids = list(so.num_scheduled_tokens)
    sched.update_from_output(so, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=KVConnectorOutput(finished_recving=recving, finished_sending=sent,
                                              invalid_block_ids=errors)))

def run(sched, worker, caches, hook=None):
    tables = {}
    for _ in range(100):
        if not sched.requests:
            break
        step(sched, worker, caches, tables, hook)
    worker.saving.flush()

out = {}
if scenario == "shared":
    prefix = list(range(base, base + 32))
    c_prompt = prefix + list(range(base + 200, base + 232))
    store(prefix)
    sched, worker, caches = make(load_async=False, save_async=opts["save_async"])
    sched.add_request(request("R", prefix + list(range(base + 100, base + 116))))
    sched.add_request(request("C", c_prompt))
    planned = []
    def evict(meta):  # the prefix leaves kvtier between the lookup and R's load
        if meta.loads:
            planned.extend(job.req_id for job in meta.saves)
            out["shared"] = [j.req_id for j in meta.loads], list(meta.loads[0].blocks)
            clear()
    run(sched, worker, caches, evict)
    out["saves_of_the_failed_step"] = planned
    out["c_held"], out["c_true"] = true_tokens(c_prompt)
    out["failed_loads"] = worker.stats["failed_loads"]
elif scenario == "worker":  # a plan that names the blocks a failing load was to fill
    prefix = list(range(base, base + 32))
    tokens = tuple(prefix + list(range(base + 200, base + 232)))
    sched, worker, caches = make(load_async=False)
    meta = KvtierMetadata([LoadJob("R", tuple(prefix), 0, (1, 2), key)],
                          [SaveJob("C", tokens, (1, 2, 4, 5), key, 0),
                           SaveJob("D", tokens, (3, 6, 2, 7), key, 0, release=True)],
                          load_async=False, save_async=opts["save_async"])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # kvtier holds nothing of it: the load fails
    worker.wait_for_save()
    worker.saving.flush()
    out["errors"] = sorted(worker.get_block_ids_with_load_errors())
    out["sent"] = sorted(worker.get_finished(set())[0] or ())
    with Client(url, api_key=key) as client:
        out["held"] = client.lookup(list(tokens)).num_tokens
    out["sent_tokens"] = worker.stats["sent_tokens"]
elif scenario == "retries":
    prompt = list(range(base, base + 40))
    store(prompt[:32])
    sched, worker, caches = make(load_async=False, save_async=False)  # steps of no waiting
    before = lookups()
    # A takes 62 of the 63 blocks for 12 steps; B (kvtier holds 32 of its tokens) waits
    sched.add_request(request("A", list(range(base + 1000, base + 1980)), max_tokens=12))
    named = {"kv_transfer_params": {"kvtier_tenant": "bob"}}  # untrusted here: refused
    sched.add_request(request("N", list(range(base + 3000, base + 3040)), extra_args=named))
    sched.add_request(request("B", prompt))  # waits behind N
    run(sched, worker, caches)
    out["sidecar_lookups"] = lookups() - before
    out["untrusted_names"] = sched.connector.stats["untrusted_names"]
elif scenario == "skip":
    prompt = list(range(base, base + 40))
    store(prompt[:32])
    sched, worker, caches = make()
    sched.add_request(request("q", prompt, prompt_logprobs=1))
    run(sched, worker, caches)
for name in ("lookups", "hit_tokens"):
    out[name] = sched.connector.stats[name]
out["loaded_tokens"] = worker.stats["loaded_tokens"]
print(json.dumps(out))
"""
)


def drive(server: Server, scenario: str, driver: str = DRIVER, **opts: Any) -> dict[str, Any]:
    """Run one of `driver`'s scenarios in a process of its own; what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(driver), scenario, server.url, ALICE, ADMIN_KEY,
         str(HERE), json.dumps(opts)],
        capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("save_async", [False, True])
def test_a_failed_synchronous_load_spoils_no_save_of_the_requests_sharing_its_blocks(
    sidecar: Server, save_async: bool
) -> None:
    seen = drive(sidecar, "shared", base=40_000 + 1000 * save_async, save_async=save_async)
    assert seen["shared"] == [["R"], [1, 2]] and seen["failed_loads"] == 1, seen
    assert seen["saves_of_the_failed_step"] == [], seen  # C's waits a step: R's load may fail
    # R and C recomputed, then saved: every token kvtier holds of C's prompt is its own KV
    assert seen["c_held"] == 64 and seen["c_true"] == 64, seen


@pytest.mark.parametrize("save_async", [False, True])
def test_a_worker_cuts_each_save_before_the_first_block_a_load_failed_to_fill(
    sidecar: Server, save_async: bool
) -> None:
    """C's save starts with the unfilled blocks: nothing sent. D's release job (blocks 3, 6,
    then unfilled 2): its first 32 tokens only, and it is still reported."""
    seen = drive(sidecar, "worker", base=42_000 + 1000 * save_async, save_async=save_async)
    assert seen["errors"] == [1, 2] and seen["sent"] == ["D"], seen
    assert seen["sent_tokens"] == 32 and seen["held"] == 32, seen


def test_a_request_retried_for_blocks_is_looked_up_and_counted_once(sidecar: Server) -> None:
    """vLLM asks again for a request it could not give blocks: one lookup, one hit, and one
    refusal (`untrusted_names`) a request, not one a retry."""
    seen = drive(sidecar, "retries", base=44_000)
    assert seen["loaded_tokens"] == 32, seen
    assert seen["lookups"] == 2 and seen["hit_tokens"] == 32, seen  # A (a miss) and B
    assert seen["sidecar_lookups"] == 2, seen
    assert seen["untrusted_names"] == 1, seen  # N, refused once however often it is retried


def test_a_request_that_skips_cached_prefixes_counts_no_hit(sidecar: Server) -> None:
    seen = drive(sidecar, "skip", base=45_000)
    assert seen["loaded_tokens"] == 0 and seen["lookups"] == 1 and seen["hit_tokens"] == 0, seen


def test_decode_tokens_count_no_prompt_tokens(sidecar: Server) -> None:
    """A synchronous load of 32 into a 56-token prompt that finishes in its first step: its
    prompt's third block is saved with the release job, and is no output."""
    head = list(range(46_000, 46_040))
    engine(sidecar, prompt=head, seed=3)
    assert saved(sidecar, head) == 32
    prompt = head[:32] + list(range(46_100, 46_124))
    done = engine(sidecar, prompt=prompt, seed=3, load_async=False, max_tokens=1)
    assert done["loaded_tokens"] == 32 and done["stats"]["saved_tokens"] == 16, done["stats"]
    assert done["stats"]["decode_tokens"] == 0 and done["prom"]["decode_tokens"] == 0, done
