"""`kvtier replay TRACE --replicas N --route POLICY[,POLICY...]`: a fleet of N stores whose
requests a router places by the stores' own KV events (issue 16), against one store with N
times the capacity (N times a replica's slots in each tier), in the same run.

Each replica is a `KVStore` sized as one `replay` run, publishing its events on a loopback ZMQ
socket (`events_config`: topic `kv@replica-<i>@replay`, a replay endpoint); one `Subscriber`
feeds one `PrefixIndex` from all of them (real sockets, real events: the router knows only what
the stores told it). Per request the `Router` picks a replica (`kvtier.routing.policies`), the
replica looks up, prefetches and stores as in `replicas.py`, and `FleetRouter.settle` waits
until the subscriber has applied every event that store published, so the next request is
routed on the fleet as it is (a gateway, serving a conversation's turns seconds apart, would
see no less).

Per policy: hit rate, tokens per tier, the share of prefill computed, requests per replica and
the imbalance (max / mean), and the ratio of the hit rate to the one big store's ("n/a" when
that store hit nothing), and the prefetches the gpu tier was too small for, if any. `--plot`
draws hit rate against N (1, 2, 4, ... N) per policy. The trace's timestamps are not kept:
requests run back to back, so a per-replica queue is not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import InvalidArgumentError, shown
from kvtier.replay.figures import save_figure
from kvtier.replay.replicas import TIERS, FleetRun, replay_fleet
from kvtier.replay.report import Sizing, pyplot
from kvtier.replay.runner import ReplayOptions
from kvtier.replay.trace import Ceiling, TraceRequest
from kvtier.routing import POLICIES

MAX_ROUTED_REPLICAS = 256
"""`--replicas` with `--route`: the router's one `Subscriber` holds three ZMQ sockets per replica
(a SUB, its monitor and the monitor's pair) in a context of ZMQ's default 1,023, so that past
341 replicas the rest were never subscribed: the run failed minutes in with a traceback ("the
router could not subscribe"). 256 routed replicas start in some 25 s on a 2-core machine."""


def check_routed_replicas(replicas: int) -> None:
    """`InvalidArgumentError` naming `--replicas` unless 1 to `MAX_ROUTED_REPLICAS`."""
    if type(replicas) is not int or not 1 <= replicas <= MAX_ROUTED_REPLICAS:
        raise InvalidArgumentError(
            f"--replicas: got {shown(replicas)} with --route, expected 1 to "
            f"{MAX_ROUTED_REPLICAS} (the router subscribes to each replica's events)"
        )


def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise InvalidArgumentError(
            f"--route: got {shown(text)}, expected a comma-separated list of {', '.join(POLICIES)}"
        )
    return list(dict.fromkeys(policies))


def replay_routed(
    requests: Sequence[TraceRequest],
    limit: Ceiling,
    sizing: Sizing,
    options: ReplayOptions,
    replicas: int,
    policies: Sequence[str],
    nodes: Sequence[str] | None = None,
) -> list[FleetRun]:
    """One store of `replicas` times the slots of each tier of `sizing` (the yardstick), then
    `replicas` stores of `sizing` per policy, in that order; shared through the cluster of
    `nodes` when given."""
    check_routed_replicas(replicas)
    runs = [replay_fleet(requests, limit, sizing, options, 1, nodes, scale=replicas)]
    for policy in policies:
        runs.append(replay_fleet(requests, limit, sizing, options, replicas, nodes, policy))
    return runs


def format_routed(runs: Sequence[FleetRun]) -> str:
    """A table: the one big store, then each policy, with its hit rate's ratio to the big one's."""
    big = runs[0]
    replicas = runs[1].replicas if len(runs) > 1 else 1
    lines = [
        f"{'run':<28}{'hit rate':>9}{'of 1 store':>11}{'gpu':>7}{'host':>7}{'disk':>7}"
        f"{'remote':>7}{'computed':>9}{'imbalance':>10}  requests per replica"
    ]
    for run in runs:
        name = f"1 store x{replicas} capacity" if run is big else run.label
        tiers = "".join(f"{run.served[t] / max(run.tokens, 1):>7.1%}" for t in TIERS)
        ratio = f"{run.hit_rate / big.hit_rate:.3f}" if big.hit_rate else "n/a"
        assigned = " / ".join(str(n) for n in run.assigned) if run.policy else "-"
        lines.append(
            f"{name:<28}{run.hit_rate:>9.1%}{ratio:>11}{tiers}{run.computed:>9.1%}"
            f"{run.imbalance if run.policy else 1.0:>10.2f}  {assigned}"
        )
    if any(run.prefetch_refused for run in runs):
        refused = ", ".join(
            f"{'1 store' if run is big else run.policy} {run.prefetch_refused:,}" for run in runs
        )
        lines.append(f"prefetches refused (gpu too small; their tokens count as hits): {refused}")
    return "\n".join(lines)


def plot_routed(by_replicas: dict[int, list[FleetRun]], path: str) -> None:
    """Hit rate against N per policy, with the one big store's, as an image at `path`."""
    plt = pyplot()
    counts = sorted(by_replicas)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(counts, [100 * by_replicas[n][0].hit_rate for n in counts], "k--",
              label="one store, N x the capacity")  # fmt: skip
    for at, run in enumerate(by_replicas[counts[0]][1:], start=1):
        axes.plot(counts, [100 * by_replicas[n][at].hit_rate for n in counts], "o-",
                  label=run.policy)  # fmt: skip
    axes.set_xscale("log", base=2)
    axes.set_xticks(counts, [str(n) for n in counts])
    axes.set_xlabel("replicas (N)")
    axes.set_ylabel("hit rate, % of tokens")
    axes.set_title("kvtier replay: routing policies")
    axes.legend(loc="lower left")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
