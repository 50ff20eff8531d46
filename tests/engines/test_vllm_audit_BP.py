"""kvtier's vLLM connector after audit BP, with vLLM 0.33's real `VllmConfig` of a tiny MLA model
at tensor-parallel size 2 and a real `kvtier serve`:

- A synchronous load R fails (its prefix left kvtier), in the step S shares its blocks through
  vLLM's prefix cache: vLLM has R alone recompute them and S wait for it. R is aborted before
  it does: no request recomputes them, and S ran over their stale bytes; S saved its prompt
  with them as their tokens' KV (before: kvtier then served 32 wrong tokens of 64). A sharer's
  save now waits for its loader to recompute the block (`plans.LoadFence.owed`), and a loader
  that leaves first spoils the sharers' saves; without the abort S saves its true prompt.
- An MLA model's ranks hold the same latent (one unsharded sidecar: `settings.shard` keys them
  as one), so vLLM's rank 0 alone saves it: a rank past 0 sends none of a save's KV (before,
  each rank copied every save out to the one sidecar, tp_size times the traffic), still
  reports a finished request's release (vLLM frees its blocks once every rank has), loads
  bit-exact what rank 0 saved, and counts no tokens (vLLM sums the ranks' counts: before,
  sent and loaded tokens were counted once per rank).

    KVTIER_ENGINE_TESTS=1 PYTHONPATH=.:.engines/vllm \\
        python -m pytest tests/engines/test_vllm_audit_BP.py
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from service_server import Server, running, write_mla_config

pytest.importorskip("vllm", reason="vLLM is installed apart: bash tests/engines/install.sh vllm")

import httpx
import vllm.distributed.parallel_state as parallel_state
import vllm_engine as ve
from service_server import ADMIN_KEY, write_config
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvtier.client import Client
from kvtier.integrations.plans import LoadJob, SaveJob
from kvtier.integrations.vllm import KvtierConnector, KvtierMetadata

ALICE = "alice-key-0123456789abcdef"
PROMPT = tuple(range(7000, 7032))  # 2 vLLM blocks of 16


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_mla_config(tmp_path_factory.mktemp("kvtier"), {"alice": {"api_keys": [ALICE]}})
    with running(config) as server:
        yield server


@pytest.fixture(scope="module")
def built(sidecar: Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A real VllmConfig of the tiny MLA model at tensor-parallel size 2, and its KV cache
    config."""
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps(ve.MLA_MODEL))
    scheduler, _, kv_cache_config = ve.build(
        {"url": sidecar.url, "api_key": ALICE, "mla": True, "tp_size": 2}, model
    )
    return scheduler.vllm_config, kv_cache_config


def worker_of_rank(
    built: tuple[Any, Any], rank: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[KvtierConnector, list[torch.Tensor]]:
    """The connector's worker side as vLLM's TP rank `rank` (vLLM's own parallel state says
    so), on MLA layers of random bytes."""
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
    worker = KvtierConnector(built[0], KVConnectorRole.WORKER, built[1])
    gen = torch.Generator().manual_seed(rank)
    layers = {f"model.layers.{i}.self_attn.attn":
              torch.randn((64, 1, ve.BLOCK, ve.LATENT), generator=gen).to(torch.float16)
              for i in range(ve.LAYERS)}  # fmt: skip
    worker.register_kv_caches(layers)
    return worker, list(layers.values())


def step(worker: KvtierConnector, meta: KvtierMetadata) -> tuple[Any, Any]:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    finished = worker.get_finished(set())
    worker.clear_connector_metadata()
    return finished


def held(server: Server, tokens: tuple[int, ...]) -> int:
    with Client(server.url, api_key=ALICE) as client:
        return client.lookup(list(tokens)).num_tokens


def test_an_mla_models_rank_past_0_sends_no_save_but_loads_and_releases(
    sidecar: Server, built: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    one, _ = worker_of_rank(built, 1, monkeypatch)
    assert (one.tp_rank, one.tp_size) == (0, 1)  # the KV's shard, not vLLM's rank
    saves = [SaveJob("p", PROMPT, (1, 2), ALICE), SaveJob("r", PROMPT, (1, 2), ALICE, release=True)]
    assert step(one, KvtierMetadata(saves=saves, save_async=False)) == ({"r"}, None)
    assert held(sidecar, PROMPT) == 0  # rank 0 saves the latent every rank holds
    assert one.stats["sent_tokens"] == 0 and one.saving.skipped == 0
    zero, caches = worker_of_rank(built, 0, monkeypatch)
    assert step(zero, KvtierMetadata(saves=saves[:1], save_async=False)) == (None, None)
    assert held(sidecar, PROMPT) == 32 and zero.stats["sent_tokens"] == 32
    load = LoadJob("q", PROMPT, 0, (5, 6), ALICE)  # rank 1 loads what rank 0 saved
    assert step(one, KvtierMetadata(loads=[load], load_async=False)) == (None, None)
    assert one.get_block_ids_with_load_errors() == set()
    for mine, theirs in zip(one._layers, caches, strict=True):
        assert torch.equal(mine[5:7].view(torch.int16), theirs[1:3].view(torch.int16))
    counted = one.get_kv_connector_stats()  # vLLM sums the ranks' reports: rank 0 counts
    assert counted is None or not {"loaded_tokens", "sent_tokens"} & set(counted.data), counted
    assert zero.get_kv_connector_stats().data["sent_tokens"] == 32  # type: ignore[union-attr]
    one.shutdown()
    zero.shutdown()


@pytest.fixture(scope="module")
def mha_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = write_config(tmp_path_factory.mktemp("mha"), tenants={"a": {"api_keys": [ALICE]}})
    with running(config) as server:
        yield server


def kvtier_kv(positions: range) -> torch.Tensor:
    """The forward's KV (`vllm_engine.kv_at`) in kvtier's layout."""
    rows = torch.stack([ve.kv_at(9, p) for p in positions], 1)
    return torch.stack((rows[..., : ve.DIM], rows[..., ve.DIM :]), 1)


def shared_failed_load(
    server: Server, base: int, abort: bool, save_async: bool, late: bool = False
) -> list[int]:
    """R (sync load of a stored prefix, evicted before the load) and S (sharing R's blocks
    in its step) through vLLM's real scheduler; R aborted after the step if `abort`; with
    `late`, T (the same prefix) admitted at step 4, after R left. What kvtier then holds of
    S's prompt (T's with `late`): [tokens, tokens of the forward's KV]."""
    prefix = list(range(base, base + 32))
    with Client(server.url, api_key=ALICE) as client:
        client.store(prefix, kvtier_kv(range(32)))
    scheduler, worker, _ = ve.built(dict(url=server.url, api_key=ALICE, load_async=False,
                                         save_async=save_async))  # fmt: skip
    layers = {
        f"model.layers.{i}.self_attn.attn": torch.full(
            (ve.NUM_BLOCKS, ve.HEADS, ve.BLOCK, 2 * ve.DIM), 3.0, dtype=torch.float16
        )
        for i in range(ve.LAYERS)
    }  # an earlier request's bytes in every block
    worker.register_kv_caches(layers)
    init_none_hash(sha256)
    s_prompt = prefix + list(range(base + 300, base + 332))
    t_prompt = prefix + list(range(base + 400, base + 432))

    def add(rid: str, prompt: list[int]) -> None:
        params = SamplingParams(max_tokens=6)
        params.update_from_generation_config({}, 2)
        hasher = get_request_block_hasher(ve.BLOCK, sha256)
        scheduler.add_request(Request(request_id=rid, prompt_token_ids=prompt,
                                      sampling_params=params, pooling_params=None,
                                      block_hasher=hasher))  # fmt: skip

    add("R", prefix + list(range(base + 200, base + 216)))
    add("S", s_prompt)
    tables: dict[str, list[int]] = {}
    for step in range(200):
        if step == 4 and late:  # a prefix hit on the blocks no request recomputed
            add("T", t_prompt)
        if not scheduler.requests:
            break
        if step == 1 and abort:  # R's client goes: nobody recomputes the blocks it loaded
            scheduler.finish_requests("R", RequestStatus.FINISHED_ABORTED)
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        if meta.loads:  # the prefix leaves kvtier between the lookup and the load
            assert [(j.req_id, j.blocks) for j in meta.loads] == [("R", (1, 2))], meta.loads
            cleared = httpx.post(server.url + "/v1/admin/clear",
                                 headers={"authorization": "Bearer " + ADMIN_KEY})  # fmt: skip
            assert cleared.status_code == 200
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for new in out.scheduled_new_reqs:
            tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tables[rid] += list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else []
        for rid, count in out.num_scheduled_tokens.items():  # the forward
            done = scheduler.requests[rid].num_computed_tokens
            for p in range(done - count, done):
                for layer, cache in enumerate(layers.values()):
                    cache[tables[rid][p // ve.BLOCK], :, p % ve.BLOCK] = ve.kv_at(9, p)[layer]
        worker.wait_for_save()
        sent, recving = worker.get_finished(out.finished_req_ids)
        errors = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        if not ids:
            time.sleep(0.02)  # a release job on the saves' thread
        done_kv = KVConnectorOutput(finished_recving=recving, finished_sending=sent,
                                    invalid_block_ids=errors)  # fmt: skip
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids], kv_connector_output=done_kv))  # fmt: skip
    worker.saving.flush()
    assert worker.stats["failed_loads"] == 1 and not scheduler.requests, [
        (r.status.name, r.num_computed_tokens) for r in scheduler.requests.values()
    ]
    worker.shutdown()
    with Client(server.url, api_key=ALICE) as client:
        got = client.load(t_prompt if late else s_prompt)
    if not got.num_tokens:
        return [0, 0]
    want = kvtier_kv(range(got.num_tokens))
    true = sum(torch.equal(got.kv[:, :, p].cpu(), want[:, :, p]) for p in range(got.num_tokens))
    return [got.num_tokens, true]


@pytest.mark.parametrize("save_async", [False, True])
def test_a_sharer_saves_nothing_its_aborted_loader_never_recomputed(
    mha_sidecar: Server, save_async: bool
) -> None:
    held, true = shared_failed_load(mha_sidecar, 90_000 + 1000 * save_async, True, save_async)
    assert held == true, (held, true)  # before: 64 held, 32 true


def test_a_request_admitted_after_the_loader_left_saves_none_of_its_stale_blocks(
    mha_sidecar: Server,
) -> None:
    """T comes after R was aborted: vLLM's prefix cache still holds R's unfilled blocks under
    their hashes, and T takes them as cached (review R2: T saved them, 32 of 64 tokens wrong)."""
    held, true = shared_failed_load(mha_sidecar, 97_000, True, False, late=True)
    assert held == true, (held, true)


def test_a_sharer_saves_once_its_loader_recomputed_the_blocks(mha_sidecar: Server) -> None:
    assert shared_failed_load(mha_sidecar, 95_000, False, True) == [64, 64]
