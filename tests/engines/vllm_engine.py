"""One vLLM engine in one process, for the connector tests (issue 15): vLLM's real v1
`Scheduler` (CPU, a local tiny `config.json`, no model weights) with kvtier's connector loaded
through `kv_connector_module_path`, and the connector's worker side on paged CPU KV shaped as
vLLM's (`[blocks, kv_heads, block_size, 2 * head_dim]` per layer).

    PYTHONPATH=.engines/vllm python tests/engines/vllm_engine.py '<json>'

runs one request to the end, and on until vLLM has its blocks back (`finished_sending`, when
the connector held them to save its output), and prints one JSON line. The model's forward
is the one thing played here: each step writes, for every token the scheduler scheduled
(prompt and output; every sampled token is 7), KV that is a function of (`seed`, position)
into the token's slot; tokens vLLM was told kvtier holds are not written, so they hold what
the connector loaded. The request's blocks are read back when
it first runs, and compared with what the forward would have written (`bit_exact`).

Arguments: url (or urls, one per tensor-parallel rank, with tp_size; this process is rank 0),
api_key, prompt (token ids), seed, load_async (bool), salt (cache_salt), tenant_keys ({name:
key}), kv_transfer_params, trust_tenant_param (bool), lora ([name, id, path]), groups (KV cache
groups, 1), clear_before_load (the admin key: clear the sidecar between the scheduler's lookup
and the worker's load, as an eviction would), warm (a prompt run to its end first in the same
engine, so that vLLM's own prefix cache holds its whole blocks: the request then loads from
kvtier only the part past them), max_tokens (2), save_decode (bool: the connector's default
when absent), extra (more `kv_connector_extra_config`), sliding_window (every layer a window
of that many tokens: vLLM's sliding-window manager), save_async (bool), flush_check (run
`flush_check` instead of a request), clear_before_save (the admin key: clear the sidecar
before the step that saves the prompt), clear_after_warm (the admin key: clear it after the
warm request), kv_events (vLLM's KV events on: a port to bind its PUB to; the report's
`vllm_events` are what a subscriber of it heard, decoded with vLLM's own classes, and
`relay_stats` the connector's relay's counts), relayed_blocks (with kv_events: after the
request, step the idle engine until vLLM has published that many blocks in a medium other than
its own GPU, or 10 s), mla (an MLA model: a tiny DeepSeek-V2 config, vLLM's `MLAAttentionSpec`
of one 576-value latent per token and layer, layers `[blocks, 1, block_size, 576]`), reset
(after the request, `reset_prefix_cache(reset_connector=True)`, as a weight update's cascade
does: the report's `reset` is its answer, `held_after_reset` what kvtier then holds of the
prompt, and `again` the same prompt served once more, with KV of seed `seed + 1`: new weights),
reset_when_finished (the same reset in the step the request finishes, its saves not yet sent),
kv_role (vLLM's: kv_both when absent), stop_pid (SIGSTOP that process, the sidecar, once the
worker has registered: it hangs from there; the report's `served_s` is how long the warm
request and the request took).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import torch
import zmq

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prometheus_client import REGISTRY
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.client import Client
from kvtier.integrations.plans import SaveJob
from kvtier.integrations.vllm import KvtierConnector, KvtierMetadata
from kvtier.integrations.vllm_stats import COUNTERS

LAYERS, HEADS, DIM, BLOCK = 2, 2, 64, 16  # kvtier's tiny test layout; vLLM blocks of 16 tokens
NUM_BLOCKS = 64
REPORTS: list[dict[str, Any]] = []  # the connector's counts in vLLM's scheduler stats
MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * DIM,
    "intermediate_size": 256, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
    "num_hidden_layers": LAYERS, "vocab_size": 50_000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
MLA_MODEL = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_hidden_layers": LAYERS, "vocab_size": 50_000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
    "bos_token_id": 1, "eos_token_id": 2, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "norm_topk_prob": False,
}  # fmt: skip
LATENT = 512 + 64  # an MLA layer's value per token: kv_lora_rank + qk_rope_head_dim
SHAPE = {"heads": HEADS, "dim": DIM}  # a layer's heads and half its last dimension (`run`)


def kv_at(seed: int, position: int) -> torch.Tensor:
    """What the forward writes for the token at `position`: `[layers, heads, 2 * dim]`."""
    gen = torch.Generator().manual_seed(seed * 100_003 + position)
    shape = (LAYERS, SHAPE["heads"], 2 * SHAPE["dim"])
    return torch.randn(shape, generator=gen).to(torch.float16)


def build(args: dict[str, Any], model_dir: Path) -> tuple[Scheduler, KvtierConnector, Any]:
    extra = {
        "kvtier.urls": args.get("urls") or [args["url"]],
        "kvtier.api_key": args["api_key"],
        "kvtier.load_async": args.get("load_async", True),
        "kvtier.tenant_keys": args.get("tenant_keys", {}),
        "kvtier.trust_tenant_param": args.get("trust_tenant_param", False),
        **{f"kvtier.{k}": args[k] for k in ("save_decode", "save_async") if k in args},
        **args.get("extra", {}),
    }
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                                 skip_tokenizer_init=True, dtype="float16", max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                         max_model_len=1024, is_encoder_decoder=False,
                                         async_scheduling=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=args.get("tp_size", 1)),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role=args.get("kv_role", "kv_both"), kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute"),
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                        endpoint=f"tcp://*:{args['kv_events']}", topic="kv")
        if args.get("kv_events") else None,
    )  # fmt: skip
    spec: Any = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                                  dtype=torch.float16)  # fmt: skip
    if args.get("mla"):  # one latent per token and layer: one "head" of 576 values
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT,
                                dtype=torch.float16)  # fmt: skip
    if args.get("sliding_window"):  # every layer windowed: vLLM's sliding-window manager
        window = int(args["sliding_window"])
        spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                                 dtype=torch.float16, sliding_window=window)  # fmt: skip
    groups = [KVCacheGroupSpec([f"layers-{g}"], spec) for g in range(args.get("groups", 1))]
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=groups)  # fmt: skip
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK, log_stats=True)  # fmt: skip
    worker = KvtierConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    return scheduler, worker, kv_cache_config


def built(args: dict[str, Any]) -> tuple[Scheduler, KvtierConnector, Any]:
    """`build` on the tiny model's `config.json` in a directory removed once built (vLLM reads
    it only then): the drivers that build engine after engine leave no directory behind."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MLA_MODEL if args.get("mla") else MODEL))
        return build(args, Path(tmp))


def run(args: dict[str, Any]) -> dict[str, Any]:
    if args.get("mla"):
        SHAPE.update(heads=1, dim=LATENT // 2)
    scheduler, worker, _ = built(args)
    assert bool(args.get("mla")) == scheduler.vllm_config.model_config.use_mla
    assert isinstance(scheduler.connector, KvtierConnector), type(scheduler.connector)
    heard = listen(args["kv_events"]) if args.get("kv_events") else None
    layers = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            NUM_BLOCKS, SHAPE["heads"], BLOCK, 2 * SHAPE["dim"], dtype=torch.float16)
        for i in range(LAYERS)
    }  # fmt: skip
    worker.register_kv_caches(layers)
    if args.get("stop_pid"):  # the sidecar hangs from here on (the test resumes it)
        os.kill(int(args["stop_pid"]), signal.SIGSTOP)
    started = time.monotonic()
    caches = list(layers.values())
    init_none_hash(sha256)
    if args.get("flush_check"):
        return flush_check(worker, caches, list(args["prompt"]), int(args["seed"]))
    seed = int(args["seed"])
    warm_stats: dict[str, int] = {}
    if args.get("warm"):  # run first, to the end: its whole blocks stay in vLLM's prefix cache
        warm = serve(scheduler, worker, caches, "w", list(args["warm"]), seed, {})
        assert warm["finished"] == "FINISHED_LENGTH_CAPPED", warm
        warm_stats = dict(worker.stats)
        if args.get("clear_after_warm"):  # kvtier loses what vLLM's own cache still holds
            clear(args["url"], args["clear_after_warm"])
    out = serve(scheduler, worker, caches, "r", list(args["prompt"]), seed, args)
    if args.get("reset"):  # new weights: vLLM's cache and kvtier's forgotten, then the prompt
        out["reset"] = scheduler.reset_prefix_cache(reset_connector=True)
        with Client(args["url"], api_key=args["api_key"]) as client:
            out["held_after_reset"] = client.lookup(list(args["prompt"])).num_tokens
        out["again"] = serve(scheduler, worker, caches, "r2", list(args["prompt"]), seed + 1, {})
        out["again"]["saved_tokens"] = worker.stats["saved_tokens"]
    out["served_s"] = time.monotonic() - started  # the warm request's and the request's
    out["warm_stats"] = warm_stats  # the worker's counters after the warm request
    out["stats"] = worker.stats
    out["scheduler_stats"] = scheduler.connector.stats
    out["hit"] = out["scheduler_stats"]["hit_tokens"]  # what kvtier's lookup gave vLLM
    if heard is not None:
        out["vllm_events"] = published(scheduler, heard, int(args.get("relayed_blocks", 0)))
        relay = scheduler.connector.relay
        out["relay_stats"] = relay.stats() if relay is not None else None
    worker.shutdown()
    out["logged"], out["prom"] = vllm_metrics(scheduler.vllm_config)
    return out


def vllm_metrics(config: VllmConfig) -> tuple[list[str], dict[str, float]]:
    """The connector's counts as vLLM reports them: the lines its logger writes, fed by every
    report the scheduler made (`REPORTS`), and the values of its Prometheus counters."""
    lines: list[str] = []
    logging = KVConnectorLogging(config.kv_transfer_config)
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    for data in REPORTS:
        logging.observe(data)
        prom.observe(data, 0)
    logging.log(log_fn=lambda fmt, *values: lines.append(fmt % values))
    labels = {"model_name": "tiny", "engine": "0"}
    values = {name: REGISTRY.get_sample_value(f"vllm:kvtier_{name}_total", labels)
              for name in COUNTERS}  # fmt: skip
    return lines, {name: value for name, value in values.items() if value is not None}


def listen(port: int) -> zmq.Socket[bytes]:
    """A subscriber of vLLM's KV-event PUB, connected before the first event."""
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # the subscription reaches the PUB
    return sub


def published(scheduler: Scheduler, sub: zmq.Socket[bytes], relayed: int) -> list[list[Any]]:
    """Every event vLLM published, `[kind, medium, hashes, token_ids]`, decoded by vLLM's
    classes; the idle engine stepped until `relayed` blocks in other media than GPU came."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events: list[list[Any]] = []
    deadline = time.monotonic() + 10
    while True:
        while sub.poll(50):
            _topic, _seq, payload = sub.recv_multipart()
            for e in decoder.decode(payload).events:
                events.append([type(e).__name__, e.medium, list(e.block_hashes),
                               list(getattr(e, "token_ids", []))])  # fmt: skip
        other = sum(len(e[2]) for e in events if e[0] == "BlockStored" and e[1] != "GPU")
        if other >= relayed or time.monotonic() > deadline:
            return events
        so = scheduler.schedule()  # an idle step: the connector's events go out with vLLM's
        scheduler.update_from_output(so, ModelRunnerOutput(req_ids=[], req_id_to_index={}))


def clear(url: str, admin_key: str) -> None:
    """Clear the sidecar at `url` (every tenant's blocks), as an eviction would."""
    cleared = httpx.post(f"{url}/v1/admin/clear", headers={"authorization": f"Bearer {admin_key}"})
    assert cleared.status_code == 200, cleared.text


def flush_check(
    worker: KvtierConnector, caches: list[torch.Tensor], prompt: list[int], seed: int
) -> dict[str, Any]:
    """The worker side alone: a save queued behind a job that holds the saves' thread for
    0.3 s; `handle_preemptions` returns at once without `flush`, and with it only once the
    save is done, before a forward could reuse a preempted request's blocks."""
    for p in range(32):  # blocks 1 and 2
        for layer, cache in enumerate(caches):
            cache[1 + p // BLOCK, :, p % BLOCK] = kv_at(seed, p)[layer]

    def step(meta: KvtierMetadata) -> float:
        start = time.perf_counter()
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        return time.perf_counter() - start

    step(KvtierMetadata(saves=[SaveJob("a", tuple(prompt[:16]), (1,), worker.key)]))
    step(KvtierMetadata(flush=True))  # the thread exists and the first save is done
    out: dict[str, Any] = {"first": worker.stats["saved_tokens"]}
    gate = threading.Event()
    assert worker.saving.thread is not None
    worker.saving.thread.submit(gate.wait)  # holds the thread until set
    out["queue_s"] = step(KvtierMetadata(saves=[SaveJob("b", tuple(prompt[:32]), (1, 2),
                                                        worker.key)]))  # fmt: skip
    out["no_flush_s"] = step(KvtierMetadata())
    out["before_flush"] = worker.stats["saved_tokens"]
    threading.Timer(0.3, gate.set).start()
    out["flush_s"] = step(KvtierMetadata(flush=True))
    out["after_flush"] = worker.stats["saved_tokens"]
    worker.shutdown()
    return out


def serve(
    scheduler: Scheduler,
    worker: KvtierConnector,
    caches: list[torch.Tensor],
    rid: str,
    prompt: list[int],
    seed: int,
    args: dict[str, Any],
) -> dict[str, Any]:
    """Run request `rid` to its end through the scheduler and the worker, playing the forward;
    what it saw (module doc)."""
    params = SamplingParams(max_tokens=args.get("max_tokens", 2))
    params.update_from_generation_config({}, 2)
    request = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                      pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256),
                      cache_salt=args.get("salt"))  # fmt: skip
    if args.get("kv_transfer_params"):
        request.kv_transfer_params = dict(args["kv_transfer_params"])
    if args.get("lora"):  # an adapter's KV differs for the same tokens
        request.lora_request = LoRARequest(*args["lora"])
    scheduler.add_request(request)
    out: dict[str, Any] = {"statuses": [], "bit_exact": None, "load_errors": []}
    table: list[int] = []
    for _ in range(200):
        so = scheduler.schedule()
        out["statuses"].append(request.status.name)
        meta = so.kv_connector_metadata
        for when, jobs in (("clear_before_load", meta.loads), ("clear_before_save", meta.saves)):
            if args.get(when) and jobs:  # as an eviction would
                clear(args["url"], args[when])
                args[when] = None  # once
        worker.handle_preemptions(so.kv_connector_metadata)
        worker.bind_connector_metadata(so.kv_connector_metadata)
        worker.start_load_kv(None)
        for new in so.scheduled_new_reqs:  # first run: the loaded part is in place now
            table = list(new.block_ids[0])
            loaded = new.num_computed_tokens
            out["loaded_tokens"] = loaded
            out["bit_exact"] = all(
                torch.equal(cache[table[p // BLOCK], :, p % BLOCK].view(torch.int16),
                            kv_at(seed, p)[layer].view(torch.int16))
                for p in range(loaded) for layer, cache in enumerate(caches)
            )  # fmt: skip
        for new in so.scheduled_cached_reqs.new_block_ids:
            table += list(new[0]) if new else []
        count = so.num_scheduled_tokens.get(rid, 0)
        start = request.num_computed_tokens - count if count else 0
        for p in range(start, start + count):  # the forward: prompt and output tokens
            for layer, cache in enumerate(caches):
                cache[table[p // BLOCK], :, p % BLOCK] = kv_at(seed, p)[layer]
        worker.wait_for_save()
        sent, recving = worker.get_finished(so.finished_req_ids)
        errors = worker.get_block_ids_with_load_errors()
        out["load_errors"] += sorted(errors)
        worker.clear_connector_metadata()
        ids = [rid] if count else []
        outputs = scheduler.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=recving, finished_sending=sent, invalid_block_ids=errors,
                kv_connector_stats=worker.get_kv_connector_stats())))  # fmt: skip
        for engine_out in outputs.values():  # vLLM's stats, its connector's counts aggregated
            stats = engine_out.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                REPORTS.append(stats.kv_connector_stats)
        if request.is_finished():
            if args.get("reset_when_finished"):  # its output's save is planned, not yet sent
                out["reset"] = scheduler.reset_prefix_cache(reset_connector=True)
                args["reset_when_finished"] = False
            out.setdefault("finished_step", len(out["statuses"]))
            if rid not in scheduler.requests:  # its blocks are vLLM's again
                out["saved_when_freed"] = worker.stats["saved_tokens"]
                break
        if not count:
            time.sleep(0.02)  # an async load in flight
    out["finished"] = request.status.name
    out["held_steps"] = len(out["statuses"]) - out["finished_step"]  # steps vLLM kept its blocks
    out["free_blocks"] = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    out["computed_prompt"] = all(  # every prompt token's KV in place at the end, loaded or not
        torch.equal(cache[table[p // BLOCK], :, p % BLOCK].view(torch.int16),
                    kv_at(seed, p)[layer].view(torch.int16))
        for p in range(len(prompt)) for layer, cache in enumerate(caches)
    )  # fmt: skip
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
