"""kvtier as a vLLM KV connector (issue 15): one flag, and vLLM's prefix cache reaches kvtier's
host, disk and remote tiers through a `kvtier serve` sidecar.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"kvtier.url": "http://127.0.0.1:8750",
                                    "kvtier.api_key": "env:KVTIER_API_KEY"}}'

What runs where. vLLM owns HBM; kvtier keeps what vLLM computed and hands it back:
- The scheduler process (`role` SCHEDULER) asks the sidecar how many of a new request's
  prompt tokens kvtier holds (`lookup`), answers vLLM with the part past its own prefix hit
  (whole blocks, at most `num_tokens - 1`), and plans loads into the blocks vLLM allocated,
  saves of the prompt's whole blocks once prefilled, and (`kvtier.save_decode`) of those its
  output filled once it finishes (a chat's next turn finds its history), in `KvtierMetadata`.
- Each worker (`role` WORKER) copies between vLLM's paged KV (`register_kv_caches`) and the
  sidecar (`paged.py`; its shared-memory pool on the same host): a load reads the part past
  vLLM's own hit (`load(start=)`) on a thread while the request waits in
  WAITING_FOR_REMOTE_KVS (`get_finished` reports it), or in `start_load_kv` with
  `"kvtier.load_async": false`; saves are queued in `wait_for_save` to a thread of their own
  (`saving.py`), or done inside it with `"kvtier.save_async": false`.
- Blocks being saved keep their KV (`saving.py`): a finished request's are held
  (`request_finished` True) until reported in `finished_sending`; a preemption `flush`es.

Contract:
- A load that returns fewer tokens than planned (the blocks left kvtier, the sidecar failed)
  reports the blocks it did not fill in `get_block_ids_with_load_errors` (vLLM recomputes from
  there with `kv_load_failure_policy: recompute`); an asynchronous one is still reported in
  `finished_recving`. The scheduler never claims a hit for a request whose load failed. No
  save sends a block a load failed (or has yet) to fill, nor any later block of its request,
  whichever request's (vLLM shares a synchronous load's blocks at once): a prompt's save waits
  two steps after a load into its blocks, and for one a load failed to fill until its loader
  recomputed it (`plans.LoadFence`; else nothing is saved), and a worker cuts each save before
  the first block its step's loads did not fill (`plans.cut_before`).
- A lookup and its hit are counted once vLLM admits the request (vLLM retries one that lacks
  blocks: the sidecar is asked once until then); `vllm_stats.py` says each count.
- A sidecar that is down, hangs or refuses a call is a miss (a lookup waits 5 s, then none is
  asked for 10 s: `lookups.py`; a load or save waits `kvtier.timeout_s`, 120 s, then none
  is tried for 10 s: a load fails, a save is skipped), logged and counted (`vllm_stats.py`).
  At start a worker waits 30 s for it to answer (`lookups.served_layout`), then fails.
- Tenants: a call's tenant is its API key's: `kvtier.api_key`, or the key `kvtier.tenant_keys`
  gives the name a request carries in its `cache_salt` (or, trusted and salted apart, in
  `kv_transfer_params`: vLLM shares blocks across a salt, `settings.key_for`);
  a name without a key neither reads nor writes kvtier (`settings.key_for`: names are
  credentials, as vLLM's server takes them from the client).
- Weights changed (`reset_cache`, `resets.py`): every tenant's KV in the sidecars forgotten,
  queued saves dropped; False (the reset failed) when a remote tier may still hold it.
- Inputs: a request whose KV depends on more than its tokens (LoRA, multimodal, embeddings;
  a session from a chunk that brings an image) neither reads nor writes kvtier (`keyed_by_tokens`).
- `kv_role` (`plans.roles`): kv_both loads and saves, kv_consumer only loads, kv_producer saves.
- Checked at start (`settings.py`): one KV cache group of full causal attention, no pipeline
  or context parallelism, the KV tensors' blocks vLLM's `block_size` (not smaller kernel
  blocks), kvtier's `block_tokens` dividing it, the sidecar's layout the caches'.

Tensor parallelism: each rank has a sidecar of its own shard (`kvtier.urls` in rank order,
`model.tp_rank` / `tp_size` in its config, checked); the scheduler asks rank 0's, and a rank
whose sidecar lacks the blocks fails its load. An MLA model's ranks hold the same KV: one
unsharded sidecar, its model `num_kv_heads: 1`, `head_dim` half the latent, which vLLM's rank 0
alone saves (`settings.tp_rank`). Pipeline and context parallelism (other layers, or other
tokens of a block, under one TP rank) are refused.

Events: with `kvtier.events_endpoint`, kvtier's blocks go out in vLLM's own KV-event stream
(`take_events`, `vllm_events.py`). Not here yet: loads layer by layer, a GPU run.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.errors import ConfigError
from kvtier.integrations import lookups, plans, vllm_events
from kvtier.integrations.lookups import Clients, Counts, Lookups, count_error, counted_key
from kvtier.integrations.plans import LoadJob, Planned, Save, SaveJob, output_save
from kvtier.integrations.resets import reset_or_log
from kvtier.integrations.saving import Saves, load_job, store_job
from kvtier.integrations.settings import (
    WORKER_TIMEOUT_S,
    ConnectorSettings,
    call_timeout,
    check_blocks,
    check_layout,
    kv_cache_refusal,
    served_model,
    shard,
    tp_rank,
)
from kvtier.integrations.vllm_stats import COUNTERS, KvtierStats, StatsBuilders, gained_since

__all__ = ["KvtierConnector", "KvtierMetadata", "LoadJob", "SaveJob"]


@dataclass
class KvtierMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, scheduler to workers."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    load_async: bool = True
    save_async: bool = True
    flush: bool = False  # a request preempted this step may have saves queued: finish them
    reset: bool = False  # the weights changed: drop queued saves, reset the sidecars again


class KvtierConnector(StatsBuilders, KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        refusal = kv_cache_refusal(kv_cache_config)
        if refusal is not None:
            raise ConfigError(*refusal)
        self.tp_rank, self.tp_size = shard(vllm_config)  # the KV's; vLLM's rank: `rank`
        self.rank = tp_rank() if role == KVConnectorRole.WORKER else 0
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.settings = ConnectorSettings.parse(extra, self.tp_size)
        self.model = served_model(extra)  # the sidecar's model must have this name, if set
        # the scheduler asks rank 0's sidecar; a rank that lacks a block fails its load
        self.url = self.settings.urls[self.tp_rank if role == KVConnectorRole.WORKER else 0]
        self.key = self.settings.key
        self.block_size = int(vllm_config.cache_config.block_size)
        self.loads, self.first_save = plans.roles(self._kv_transfer_config)
        self._clients = Clients(self.url, call_timeout(extra, WORKER_TIMEOUT_S))
        self.stats = Counts(COUNTERS)  # since start (`vllm_stats.py`), added to by 4 threads
        self._reported: dict[str, int] = {}  # `stats` when vLLM last asked for them
        # scheduler side
        self._requests: dict[str, Planned] = {}
        self._failed: set[str] = set()  # loads that failed: never claimed again
        self._seen: set[str] = set()  # requests asked about (until `request_finished`)
        self._loads: list[LoadJob] = []
        self._saves: list[SaveJob] = []  # of finished requests, for the next step
        self._holding: set[str] = set()  # finished requests whose blocks vLLM keeps for us
        self._saving: set[str] = set()  # requests with a prompt save planned: a preemption flushes
        self._fence = plans.LoadFence()  # blocks of recent loads: no save sends them yet
        self._lookups = Lookups(self.url)  # short, and none for a while after one failed
        self._reset = False  # `reset_cache` asked: the next step's plan says so
        scheduler = role == KVConnectorRole.SCHEDULER
        self.relay = vllm_events.start(self.settings, vllm_config, self.url) if scheduler else None
        # worker side
        self._layers: list[torch.Tensor] = []
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future[list[int]]] = {}
        self._done: set[str] = set()
        self.saving = Saves(self._save, self._clients.open)  # its thread (`saving.py`)
        self._load_errors: set[int] = set()
        self._unfilled: set[int] = set()  # blocks this step's synchronous loads did not fill
        self._worker_lock = threading.Lock()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save that never happens is a later miss

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        first = req_id not in self._seen  # refusals counted once a request (vLLM retries)
        self._seen.add(req_id)
        if not plans.keyed_by_tokens(request):
            self.stats.add("other_inputs", first)
            return 0, False
        key = counted_key(self.settings, request, self.stats, first)
        if key is None or req_id in self._failed:
            return 0, False
        planned = self._requests.get(req_id)
        if planned is None or planned.admitted:  # asked once until admitted (vLLM retries)
            planned = self._requests[req_id] = self._lookup(request, key)
        planned.local = num_computed_tokens
        usable = min(planned.found, len(planned.tokens) - 1)
        new = usable - usable % self.block_size - num_computed_tokens
        return (new, self.settings.load_async) if new > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        planned = self._requests.get(request.request_id)
        if planned is None:
            return
        if not planned.admitted:  # counted as vLLM counts: once admitted, the hit it took
            planned.admitted = True
            self.stats.add("lookups", planned.asked)
            self.stats.add("hit_tokens", max(0, num_external_tokens))
        planned.blocks = ids = list(blocks.get_block_ids()[0])
        if num_external_tokens <= 0:
            return
        first = planned.local // self.block_size
        count = num_external_tokens // self.block_size
        stop = planned.local + num_external_tokens
        self._loads.append(
            LoadJob(request.request_id, planned.tokens[:stop], planned.local,
                    tuple(ids[first : first + count]), planned.key)
        )  # fmt: skip

    def build_connector_meta(self, scheduler_output: Any) -> KvtierMetadata:
        s, bs = self.settings, self.block_size
        preempted = scheduler_output.preempted_req_ids or ()
        flush = any(r in self._saving for r in preempted)  # whatever Planned it has now
        meta = KvtierMetadata(self._loads, self._saves, s.load_async, s.save_async, flush)
        computed = plans.follow_blocks(self._requests, scheduler_output, self._fence, bs)
        loading = self._fence.blocks(self._loads, scheduler_output.num_scheduled_tokens, computed)
        self._fence.left(preempted, self._requests)  # the blocks they owe, none recomputes now
        meta.reset, self._reset = self._reset, False
        self._loads, self._saves = [], []
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            planned = self._requests.get(req_id)
            if planned is None or not planned.due or loading.intersection(planned.blocks):
                continue
            save = plans.prompt_save(req_id, planned, computed.get(req_id, 0) + count, bs)
            if save is not None:
                meta.saves.append(save)
                planned.save = Save.SENT
                self._saving.add(req_id)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Loads that failed (by request or by block): never claimed again, their requests'
        saves as `plans.after_failures` says. Finished requests saved: their blocks are vLLM's."""
        self._holding.difference_update(connector_output.finished_sending or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        invalid = set(connector_output.invalid_block_ids or ())
        if not failed and not invalid:  # every step: nothing to look through
            return
        bs = self.block_size
        self._failed.update(plans.after_failures(self._requests, failed, invalid, self._fence, bs))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """True (vLLM keeps the blocks until a worker reports the request in
        `finished_sending`) when its output is saved now (`kvtier.save_decode`), or a save of
        its prompt may still be queued (`kvtier.save_async`)."""
        req_id = request.request_id
        planned = self._requests.pop(req_id, None)
        for followed in (self._seen, self._failed, self._saving):
            followed.discard(req_id)
        if planned is None:
            return False, None
        self._fence.left([req_id], self._requests, planned)  # owing blocks, or holding owed ones
        job = output_save(request, planned, block_ids, self.block_size, self.settings.save_decode)
        if job is None and not (planned.save is Save.SENT and self.settings.save_async):
            return False, None
        self._saves.append(job or SaveJob(req_id, (), (), planned.key, release=True))
        self._holding.add(req_id)
        return True, None

    def reset_cache(self) -> bool:
        """The weights changed (`resets.py`); the workers follow at the next plan."""
        self._reset = True  # (a save from a prefix kvtier lost sends all: `store_job`)
        # finished requests' saves not yet sent hold the old weights' KV: release them only
        self._saves = [SaveJob(j.req_id, (), (), j.key, release=True) for j in self._saves]
        return reset_or_log(map(self._clients.client, self.settings.api_keys()), "scheduler")

    def has_pending_block_frees(self) -> bool:
        """Blocks held for saves come back next step: vLLM waits rather than preempts."""
        return bool(self._holding)

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The engine's paged KV, layer by layer in the engine's order; its blocks checked to
        be vLLM's blocks (`check_blocks`), then against the sidecar's model layout (layers, KV
        heads, head size, dtype, block size), waited for a while (`lookups.served_layout`)."""
        self._layers = list(kv_caches.values())
        check_blocks(self._layers, self.block_size)
        where = f"kvtier.urls[{self.tp_rank}]" if self.tp_size > 1 else "kvtier.url"
        served = lookups.served_layout(self._clients, self.key, where)
        check_layout(self._layers, served, (self.tp_rank, self.tp_size), self.url, self.model)

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """The counts gained since the last call, for vLLM's logs and `/metrics`."""
        self.stats["skipped_saves"] = self.saving.skipped  # the saves' thread skips some too
        return gained_since(self.stats, self._reported, self.rank if self._layers else 0)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvtierMetadata):
            return
        if meta.reset:  # no KV of the old weights stored from here; then this rank's sidecar
            self.saving.drop()
            reset_or_log(map(self._clients.client, self.settings.api_keys()), f"rank {self.rank}")
        self._unfilled = set()
        for job in meta.loads:
            if not meta.load_async:
                missing = self._load(job)  # done before the forward: nothing to report
                with self._worker_lock:
                    self._finish_load(job.req_id, missing, report=False)
                self._unfilled.update(missing)  # this step computes over them: saved nowhere
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvtier-load")
            future = self._pool.submit(self._load, job)
            with self._worker_lock:
                self._inflight[job.req_id] = future

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole before the forward (sync) or before the request runs (async)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves are queued once per step, in `wait_for_save`, from the registered caches."""

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Before the forward: a preempted request's blocks may be written this step."""
        if isinstance(kv_connector_metadata, KvtierMetadata) and kv_connector_metadata.flush:
            self.saving.flush()

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvtierMetadata) or not meta.saves:
            return
        device = self._layers[0].device if self._layers else torch.device("cpu")
        unfilled = self._unfilled if self.rank == self.tp_rank else None  # None: `tp_rank`
        cut = (plans.cut_before(job, unfilled, self.block_size) for job in meta.saves)
        self.saving.run([job for job in cut if job is not None], not meta.save_async, device)
        self.stats["skipped_saves"] = self.saving.skipped

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._worker_lock:
            ready = {r for r, f in self._inflight.items() if f.done()}
            for req_id in ready:
                self._finish_load(req_id, self._inflight.pop(req_id).result())
            done, self._done = self._done, set()
        return self.saving.take_sent() or None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._worker_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_events(self) -> list[Any]:
        return self.relay.take(self.stats) if self.relay is not None else []

    def shutdown(self) -> None:
        if self.relay is not None:
            self.relay.close()
        self.saving.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._clients.close()
        self._lookups.close()

    # ---- inside -------------------------------------------------------------------------

    def _save(self, job: SaveJob) -> None:
        """Store the job's blocks (`saving.py` runs it, inline or on its thread)."""
        try:
            sent, stored = store_job(
                self._clients.client(job.key), self._layers, job, self.block_size
            )
            self.stats.add("sent_tokens", sent)
            self.stats.add("saved_tokens", stored)
            self.stats.add("decode_tokens", min(stored, job.output))  # stored from the end
        except Exception as e:  # a save that fails is a later miss, never a crash
            self._clients.failed(e)  # unanswered: none tried for a while (`lookups.Clients`)
            count_error(self.stats, "store", e)

    def _lookup(self, request: Any, key: str) -> Planned:
        """A request to follow, with kvtier's prefix of its prompt (none if the sidecar fails)."""
        planned = Planned(tuple(request.prompt_token_ids or ()), key, save=self.first_save)
        if not self.loads:  # a producer's requests are followed for their saves, never asked
            return planned
        if not self._lookups.open():  # a lookup failed just now (`lookups.py`): a miss
            self.stats.add("skipped_lookups")
            return planned
        try:
            found = self._lookups.client(key).lookup(list(planned.tokens)).num_tokens
            planned.found, planned.asked = found - found % self.block_size, True
        except Exception as e:  # a miss, never an exception in vLLM's scheduling loop
            self._lookups.failed(e)
            count_error(self.stats, "lookup", e)
        return planned

    def _load(self, job: LoadJob) -> list[int]:
        """Copy the job's blocks from kvtier; the vLLM block ids it could not fill (all of them,
        untried, for a while after a call went unanswered: `lookups.Clients`)."""
        if not self._clients.open():  # a call went unanswered just now: vLLM recomputes
            return list(job.blocks)
        try:
            filled = load_job(self._clients.client(job.key), self._layers, job, self.block_size)
        except Exception as e:  # a load that fails is vLLM's to recompute, never a crash
            self._clients.failed(e)
            count_error(self.stats, "load", e)
            return list(job.blocks)
        self.stats.add("loaded_tokens", filled * self.block_size)
        return list(job.blocks[filled:])

    def _finish_load(self, req_id: str, missing: list[int], report: bool = True) -> None:
        """A load ended (the worker lock held): an asynchronous one is reported in
        `get_finished`; the blocks it did not fill, in `get_block_ids_with_load_errors`."""
        if report:
            self._done.add(req_id)
        if missing:
            self.stats.add("failed_loads")
            self._load_errors.update(missing)
