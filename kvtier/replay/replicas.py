"""`kvtier replay TRACE --replicas N [--remote]`: a fleet of N stores behind a round-robin router,
alone and sharing a remote tier (issue 14), in the same run.

A router that sends request i to replica i mod N scatters a conversation's turns over the
fleet, so each replica recomputes what a neighbour holds: the cross-replica loss. Each replica
is a `KVStore` sized as one `replay` run (`runner.replay_config`), inline mover. Two runs over
the same requests:

- **alone**: N stores, each with only its own tiers;
- **shared**: the same N stores, each with `tiers.remote` on one Redis Cluster (the one named by
  `nodes`, or one started on loopback for the run, `tiers/remote/local.py`), one cluster secret
  and a key prefix of the run's own. Per request the replica looks up (local tiers, then the
  cluster's run past them), prefetches what is not on its gpu (bringing the cluster's blocks
  in), and stores; its writer's backlog is drained after each store, so that the next request,
  on another replica, sees it (a router would wait no less for a neighbour's KV).

Per run: tokens served by each tier (the lookup's split, `remote` included) and recomputed, the
hit rate, its ratio to the trace's ceiling, the prefetches the gpu tier was too small for (their
tokens count in the lookup's tiers, as in `runner.replay`), and the wall time; the gain is
shared - alone.
"""

from __future__ import annotations

import contextlib
import secrets
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig, parse_config
from kvtier.errors import CapacityError, InvalidArgumentError
from kvtier.replay.fleet_router import FleetRouter, events_config
from kvtier.replay.memory import check_memory
from kvtier.replay.report import Sizing
from kvtier.replay.runner import ReplayOptions, replay_config, zero_kv
from kvtier.replay.trace import Ceiling, TraceRequest
from kvtier.store import KVStore
from kvtier.tiers.remote.local import LocalCluster, have_redis

TIERS = ("gpu", "host", "disk", "remote")


@dataclass(frozen=True)
class FleetRun:
    """The figures of one run of a fleet (module doc); `assigned` has one entry per replica."""

    label: str
    served: dict[str, int]  # tier (or "recomputed") -> tokens
    ceiling_tokens: int
    wall_s: float
    assigned: tuple[int, ...]  # requests per replica
    remote: dict[str, int] | None = None  # the replicas' remote counters, summed
    policy: str | None = None  # the router's (`routed.py`); None: round robin without events
    prefetch_refused: int = 0  # prefetches the gpu tier was too small for

    @property
    def replicas(self) -> int:
        return len(self.assigned)

    @property
    def imbalance(self) -> float:
        """Requests of the busiest replica over the mean (1.0: even)."""
        total = sum(self.assigned)
        return max(self.assigned) * len(self.assigned) / total if total else 1.0

    @property
    def computed(self) -> float:
        """The share of the prompts' tokens prefilled (not served by a tier)."""
        return self.served["recomputed"] / self.tokens if self.tokens else 0.0

    @property
    def tokens(self) -> int:
        return sum(self.served.values())

    @property
    def hit_tokens(self) -> int:
        return self.tokens - self.served["recomputed"]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def ratio(self) -> float:
        """The share of the infinite-cache ceiling served (1.0 with nothing to hit), as
        `ReplayResult.ratio`."""
        return self.hit_tokens / self.ceiling_tokens if self.ceiling_tokens else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "replicas": self.replicas,
            "served": self.served,
            "hit_rate": self.hit_rate,
            "ratio_to_ceiling": self.ratio,
            "wall_s": self.wall_s,
            "remote": self.remote,
            "policy": self.policy,
            "assigned": list(self.assigned),
            "imbalance": self.imbalance,
            "computed": self.computed,
            "prefetch_refused": self.prefetch_refused,
        }


def check_cluster(nodes: Sequence[str] | None) -> None:
    """`InvalidArgumentError` unless `cluster_nodes(nodes)` has a cluster to give: `nodes`, or
    redis-server and redis-cli on PATH to start one (checked before any run)."""
    if not nodes and not have_redis():
        raise InvalidArgumentError(
            "--remote: got no --remote-nodes and no redis-server / redis-cli on PATH; expected "
            "--remote-nodes host:port,... or Debian's redis-server (apt-get install "
            "redis-server) to start a cluster"
        )


@contextlib.contextmanager
def cluster_nodes(nodes: Sequence[str] | None) -> Iterator[list[str]]:
    """`nodes`, or those of a cluster started on loopback for the block (`check_cluster`
    first)."""
    if nodes:
        yield list(nodes)
        return
    check_cluster(nodes)
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-replay-redis-") as tmp,
        LocalCluster(Path(tmp), primaries=3) as cluster,
    ):
        yield cluster.nodes


def replay_fleet(
    requests: Sequence[TraceRequest],
    ceiling: Ceiling,
    sizing: Sizing,
    options: ReplayOptions,
    replicas: int,
    nodes: Sequence[str] | None,
    policy: str | None = None,
    scale: int = 1,
) -> FleetRun:
    """One run of `replicas` stores (module doc); shared through the cluster of `nodes` when
    it is not None; routed by `policy` on the stores' KV events when it is given
    (`routed.py`), else round robin without events. Each store has `scale` times the slots of
    every tier `sizing` gives one replay (`routed.py`'s one big store: exactly N times a
    replica's, which scaling the fractions would round otherwise, and past their bound of 100).
    A prefetch that the gpu tier is too small for is counted (`FleetRun.prefetch_refused`);
    its tokens count in the tiers the lookup found them in, as in `runner.replay`."""
    options.check_trace(requests)
    served = dict.fromkeys((*TIERS, "recomputed"), 0)
    longest = max(r.num_tokens for r in requests)
    prefix = f"replay-{secrets.token_hex(6)}"  # this run's keys only
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-", dir=options.directory) as tmp:
        # every replica open at once: their memory tiers together, before any is mapped
        check_memory(
            _config(sizing, ceiling, options, tmp, nodes, prefix, None, 0, scale), replicas
        )
        stores = [
            KVStore(
                _config(sizing, ceiling, options, f"{tmp}/{i}", nodes, prefix, policy, i, scale)
            )
            for i in range(replicas)
        ]
        router = FleetRouter(stores, policy, options.block_tokens) if policy else None
        assigned = [0] * replicas
        refused = 0
        try:
            kv = zero_kv(stores[0].layout, longest)
            started = time.perf_counter()
            for i, request in enumerate(requests):
                tokens = request.tokens()
                chosen = router.choose(tokens) if router is not None else i % replicas
                assigned[chosen] += 1
                store = stores[chosen]
                hit = store.lookup(tokens)
                for tier in TIERS:
                    served[tier] += getattr(hit, f"{tier}_tokens")
                served["recomputed"] += len(tokens) - hit.num_tokens
                if hit.num_tokens > hit.gpu_tokens:
                    try:
                        store.release(store.prefetch(tokens))
                    except CapacityError:
                        refused += 1
                store.store(tokens, kv[:, :, : len(tokens)])
                if nodes is not None:
                    store.drain()
                if router is not None:
                    router.settle(chosen)  # the next request is routed on this one's events
            wall_s = time.perf_counter() - started
            remote = None
            if nodes is not None:
                figures = [store.status()["remote"] for store in stores]
                remote = {
                    name: sum(f[name] for f in figures)
                    for name in ("hits", "misses", "filled_blocks", "puts", "errors")
                }
            for store in stores:
                store.check()
            if router is not None:
                router.check()
        finally:
            if router is not None:
                router.close()
            for store in stores:
                store.close()
    label = f"{replicas} replicas" + (", shared remote" if nodes is not None else ", alone")
    if policy is not None:
        label = f"{replicas} replicas, {policy}" + (", shared remote" if nodes else "")
    if scale > 1:
        named = "1 store" if replicas == 1 else f"{replicas} stores"
        label = f"{named} x{scale} capacity" + (", shared remote" if nodes else "")
    return FleetRun(
        label, served, ceiling.prefix_tokens, wall_s, tuple(assigned), remote, policy, refused
    )


def _config(
    sizing: Sizing,
    ceiling: Ceiling,
    options: ReplayOptions,
    directory: str,
    nodes: Sequence[str] | None,
    prefix: str,
    policy: str | None = None,
    replica: int = 0,
    scale: int = 1,
) -> KVTierConfig:
    """A replica's config: one replay's, every tier `scale` times its slots, with the shared
    remote tier when `nodes` is given, and events on loopback when a `policy` routes on them."""
    base = replay_config(sizing, ceiling.unique_blocks, options, directory)
    config = base.to_dict()
    for tier in ("gpu", "host", "disk"):
        found = getattr(base.tiers, tier)
        if found is not None:  # replay_config sizes tiers in bytes: a whole number of slots
            config["tiers"][tier]["capacity"] = found.capacity.nbytes * scale
    if policy is not None:
        config["events"] = events_config(replica)
    if nodes is not None:
        config["tiers"]["remote"] = {
            "nodes": list(nodes),
            "key_prefix": prefix,
            "secret": "replay-fleet-shared-secret",
        }
    return parse_config(config, "<replay --replicas>")


def format_fleet(runs: Sequence[FleetRun]) -> str:
    lines = []
    for run in runs:
        parts = ", ".join(f"{t} {run.served[t] / run.tokens:.1%}" for t in TIERS if run.served[t])
        by_tier = f" ({parts})" if parts else ""  # none when nothing was served
        remote = f"; remote {run.remote}" if run.remote else ""
        refused = (
            f"; {run.prefetch_refused:,} prefetches refused (gpu too small; their tokens count "
            "as hits)"
            if run.prefetch_refused
            else ""
        )
        lines.append(
            f"== {run.label}: hit rate {run.hit_rate:.1%}{by_tier}, {run.ratio:.3f} of the "
            f"ceiling, {run.wall_s:.1f} s{remote}{refused}"
        )
    if len(runs) == 2:
        lines.append(
            f"gain from the shared remote tier: {runs[1].hit_rate - runs[0].hit_rate:+.1%} of "
            f"tokens ({runs[0].ratio:.3f} -> {runs[1].ratio:.3f} of the ceiling)"
        )
    return "\n".join(lines)
