"""The vLLM connector's counters in vLLM's own metrics (`vllm.py`): the lines vLLM logs each
interval ("KV Transfer metrics: ..."), and counters on vLLM's `/metrics`, one per engine.

- `KvtierStats.data` maps each name of `COUNTERS` to its count since the last report; reports
  add up (across an engine's workers in a step, and across steps in an interval). A
  tensor-parallel group's ranks copy the same tokens (each its own heads), so the token counts
  come from the scheduler and rank 0 alone (`gained_since` leaves them out elsewhere); failures and
  errors are each rank's own, summed.
- `gained_since(stats, reported, rank)`: what `stats` (the connector's running counts) gained since
  `reported`, which it updates; None when nothing moved, so idle steps send nothing.
- `KvtierPromMetrics`: a counter `vllm:kvtier_<name>` per name, labelled per engine as vLLM's
  own; each report is added to it.
- `StatsBuilders`: the connector's class hooks through which vLLM builds both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = {
    "lookups": "Requests vLLM admitted whose prompt kvtier was asked about (once each)",
    "hit_tokens": "Prompt tokens past vLLM's own prefix hit vLLM took from kvtier at admission",
    "loaded_tokens": "Tokens loaded from kvtier into vLLM's blocks",
    "saved_tokens": "Tokens newly stored in kvtier (prompts and outputs)",
    "sent_tokens": "Tokens whose KV saves copied out of vLLM's blocks to kvtier",
    "decode_tokens": "Tokens of finished requests' outputs newly stored (blocks past the prompt's)",
    "skipped_saves": "Saves skipped: the queue full, or the sidecar unanswering (per rank)",
    "failed_loads": "Loads that came back short; vLLM recomputed from there (per rank)",
    "errors": "Calls to the kvtier sidecar that failed (per rank)",
    "skipped_lookups": "Requests not asked about for 10 s after a lookup failed (a miss each)",
    "untrusted_names": "Requests naming kvtier_tenant without kvtier.trust_tenant_param",
    "unsalted_names": "Requests naming kvtier_tenant without a cache_salt of that tenant's own",
    "other_inputs": "Requests whose KV is not their tokens' alone (LoRA, multimodal, embeds)",
    "relayed_events": "kvtier's KV events handed to vLLM's publisher (kvtier.events_endpoint)",
    "refused_events": "kvtier's KV events not relayed: malformed, another block size, or full",
    "relay_overflows": "Times vLLM left kvtier's relayed events untaken past the relay's bound",
}
RANK_0 = ("hit_tokens", "lookups", "loaded_tokens", "saved_tokens", "sent_tokens", "decode_tokens")


@dataclass
class KvtierStats(KVConnectorStats):  # type: ignore[misc]
    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        for name, count in other.data.items():
            self.data[name] = self.data.get(name, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data[name] for name in COUNTERS if self.data.get(name)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def gained_since(stats: dict[str, int], reported: dict[str, int], rank: int) -> KvtierStats | None:
    gained = {}
    for name in COUNTERS:
        count = stats.get(name, 0)
        if rank and name in RANK_0:
            continue
        if count != reported.get(name, 0):
            gained[name] = count - reported.get(name, 0)
            reported[name] = count
    return KvtierStats(data=gained) if gained else None


class KvtierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvtier_{name}", documentation=doc,
                                  labelnames=labelnames),
                self.per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, count in transfer_stats_data.items():
            if name in self.counters and count > 0:
                self.counters[name][engine_idx].inc(count)


class StatsBuilders:
    """vLLM's class hooks that build the connector's stats and metrics (a base of
    `KvtierConnector`)."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
