"""The `kvtier replay` subcommand: its arguments, the runs they ask for, and the output.

    kvtier replay TRACE                  tiered (--gpu/--host/--disk) and a gpu-only baseline
    kvtier replay TRACE --sweep          the tiered sizes scaled by SWEEP_SCALES, as a table
    kvtier replay TRACE --codec none,int8,int4   host and disk at the same bytes, each run in
                                         one codec: the blocks a quantized tier fits (`codecs.py`)
    ... --plot out.png                   hit rate by tier against capacity (needs matplotlib)
    ... --json                           every figure as JSON on stdout
    kvtier replay TRACE --replicas N [--remote]   N stores behind a round-robin router, alone
                                         and sharing a remote tier (`replicas.py`)
    kvtier replay TRACE --replicas N --route round-robin,prefix,prefix-load [--plot P]
                                         N stores routed on their KV events, against one
                                         store of N times the capacity (`routed.py`)

Each run is compared with exact simulations of one cache of its capacity in blocks (LRU of
leaves, and the offline furthest-next-use leaf; `simulate.py`), and a paced run (`--speed`)
says whether it kept the trace's clock. The runs and simulations are independent: `--jobs N`
does them in N worker processes (`parallel.py`; default one per core, 1 with `--speed`), with
the same figures; the fleet and routed modes run in this process. The last line printed is the
tiered run's ratio to the infinite-cache ceiling.

Checked before the trace is read (`InvalidArgumentError`, exit 2): `--sweep` and `--codec` each
replace the sizes as typed, so they are refused together, and with `--replicas N` / `--remote`
/ `--route`, which run the sizes as typed once, unpaced (`--speed` refused with them too:
`checks.py`); `--remote` without `--remote-nodes` needs redis-server on PATH
(`replicas.check_cluster`). Every line printed goes through `say` (the JSON is as `json.dumps`
escapes it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from kvtier.blocks import KVLayout
from kvtier.config import KVTierConfig, load_config
from kvtier.replay.checks import check_modes, check_plot
from kvtier.replay.codecs import codec_sizing, fit, parse_codecs
from kvtier.replay.parallel import Workload, default_jobs, replay_all, task_count
from kvtier.replay.replicas import check_cluster, cluster_nodes, format_fleet, replay_fleet
from kvtier.replay.report import (
    ReplayResult,
    Sizing,
    format_result,
    format_table,
    model_sizes,
    plot,
)
from kvtier.replay.routed import (
    check_routed_replicas,
    format_routed,
    parse_policies,
    plot_routed,
    replay_routed,
)
from kvtier.replay.runner import ReplayOptions
from kvtier.replay.trace import Ceiling, TraceRequest, ceiling, read_trace
from kvtier.text import printable

SWEEP_SCALES = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""`--sweep`: each run's tier sizes are the given ones times one of these."""

MAX_REPLICAS = 1024
"""`--replicas`: the most stores one run builds (each is a whole `KVStore`, all open at once)."""


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "trace", help="JSONL trace: {timestamp, input_length, output_length, hash_ids}"
    )
    sizes = "fraction of the trace's unique blocks"
    cmd.add_argument("--gpu", type=float, default=0.01, help=f"gpu tier, a {sizes} (0.01)")
    cmd.add_argument("--host", type=float, default=0.10, help="host tier (0.10; 0: none)")
    cmd.add_argument("--disk", type=float, default=1.0, help="disk tier (1.0; 0: none)")
    cmd.add_argument("--no-baseline", action="store_true", help="skip the gpu-only run")
    cmd.add_argument("--sweep", action="store_true", help="run the sizes scaled, print a table")
    cmd.add_argument(
        "--codec",
        metavar="CODECS",
        help="host and disk at the same bytes, one run per codec: none,fp8,int8,int4 (any, "
        "comma-separated; the bytes are those of --config's model)",
    )
    cmd.add_argument(
        "--config",
        metavar="YAML",
        help="a kvtier config whose model the sizes are also printed in, as blocks and bytes "
        "(default: the embedded default's, SmolLM2-135M)",
    )
    cmd.add_argument("--plot", metavar="PNG", help="draw hit rate by tier against capacity")
    cmd.add_argument("--json", action="store_true", help="print the figures as JSON")
    cmd.add_argument("--limit", type=int, help="replay only the first N requests")
    cmd.add_argument("--speed", type=float, help="keep the trace's clock, x times faster")
    cmd.add_argument(
        "--block-tokens",
        type=int,
        help="store block (divides 512 and the trace's block; "
        "default: the trace's block, at most 512)",
    )
    cmd.add_argument(
        "--trace-block-tokens",
        type=int,
        default=512,
        metavar="B",
        help="tokens a hash id names (512: Mooncake's traces; 16: Alibaba's Bailian traces)",
    )
    cmd.add_argument(
        "--trace-time-unit",
        choices=("ms", "s"),
        default="ms",
        help="the unit of the trace's timestamps (ms: Mooncake's; s: Bailian's floats)",
    )
    cmd.add_argument(
        "--block-bytes", type=int, default=4096, help="bytes of one 512-token block (4096)"
    )
    cmd.add_argument("--write", default="write_through", help="policy.write (write_through)")
    cmd.add_argument(
        "--background", action="store_true", help="run the mover on threads (default: inline)"
    )
    cmd.add_argument("--dir", help="where the disk tier's temporary directory goes")
    cmd.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="runs and simulations in N worker processes, same figures (default: one per core, "
        "at most one per task; 1 with --speed). Latencies and wall times measured beside other "
        "tasks are perturbed: --jobs 1 for clean ones. --replicas and --route run in-process",
    )
    cmd.add_argument(
        "--replicas",
        type=int,
        default=1,
        help=f"N stores behind a round-robin router (1; at most {MAX_REPLICAS})",
    )
    cmd.add_argument(
        "--remote", action="store_true", help="also run the N stores sharing a remote tier"
    )
    cmd.add_argument(
        "--route",
        metavar="POLICIES",
        help="route the N stores on their KV events: round-robin,prefix,prefix-load (any of "
        "them, comma-separated), against one store of N times the capacity",
    )
    cmd.add_argument(
        "--remote-nodes", help="that tier's cluster, host:port,... (default: one started here)"
    )


def say(text: str, file: TextIO | None = None) -> None:
    """Print `text`, each of its lines with its control characters escaped (`text.printable`):
    what came from outside (a trace's path, a config's model name) is escaped where it is put in
    a line, so that it can neither forge a line nor reach the terminal as an escape."""
    for line in text.split("\n"):
        print(printable(line), file=file)


def _layout(args: argparse.Namespace) -> KVLayout:
    """The model the planner buys for: `--config`'s, or the embedded default's."""
    return (load_config(args.config) if args.config is not None else KVTierConfig()).layout


def _sizings(args: argparse.Namespace, layout: KVLayout) -> list[Sizing]:
    base = Sizing("tiered", args.gpu, args.host, args.disk)
    if args.codec is not None:
        return [codec_sizing(base, fit(codec, layout)) for codec in parse_codecs(args.codec)]
    if args.sweep:
        return [
            Sizing(f"x{scale:g}", args.gpu * scale, args.host * scale, args.disk * scale)
            for scale in SWEEP_SCALES
        ]
    runs = [base]
    if not args.no_baseline:
        runs.append(Sizing("gpu-only", args.gpu, 0.0, 0.0))
    return runs


@contextmanager
def _progress(total: int) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar on stderr when it is a terminal; nothing otherwise."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="req", file=sys.stderr) as bar:
        yield bar.update


@contextmanager
def _terminated_cleanly() -> Iterator[None]:
    """SIGTERM (`timeout`, `kill`) raises `SystemExit(143)` in the replay, as SIGINT raises
    `KeyboardInterrupt`: its stores' temporary directories in `--dir` are removed (SIGTERM's
    default action would leave them, a disk tier's slots included) and forked workers are
    stopped (`parallel.py`). The previous handler comes back after."""

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: signals are not ours to take
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def run_replay(args: argparse.Namespace) -> int:
    """`kvtier replay` (module doc); the exit status. SIGTERM ends it cleanly
    (`_terminated_cleanly`)."""
    with _terminated_cleanly():
        return _replay(args)


def _replay(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        say(f"kvtier: --limit: got {args.limit}, expected >= 1", sys.stderr)
        return 2
    trace_bt = args.trace_block_tokens
    options = ReplayOptions(
        block_tokens=math.gcd(trace_bt, 512) if args.block_tokens is None else args.block_tokens,
        block_bytes=args.block_bytes,
        trace_block_tokens=trace_bt,
        background=args.background,
        write=args.write,
        speed=args.speed,
        directory=args.dir,
    )
    if not 1 <= args.replicas <= MAX_REPLICAS:
        say(f"kvtier: --replicas: got {args.replicas}, expected 1 to {MAX_REPLICAS}", sys.stderr)
        return 2
    if args.jobs is not None and args.jobs < 1:
        say(f"kvtier: --jobs: got {args.jobs}, expected >= 1", sys.stderr)
        return 2
    if args.plot is not None:
        check_plot(args.plot, [args.trace, args.config])
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        say("kvtier: --plot: matplotlib is not installed; pip install 'kvtier[plot]'", sys.stderr)
        return 2
    check_modes(args)
    if args.remote:
        check_cluster(_remote_nodes(args))
    layout = _layout(args)  # --config read in every mode: a bad one stops before the trace
    sizings = _sizings(args, layout)  # sizes and policies are checked before the trace is read
    if args.route is not None:
        parse_policies(args.route)
        check_routed_replicas(args.replicas)
    requests = read_trace(args.trace, args.limit, trace_bt, args.trace_time_unit == "s")
    limit = ceiling(requests)
    if args.route is not None:
        return _run_routed(args, requests, limit, sizings[0], options)
    if args.replicas > 1 or args.remote:
        return _run_fleet(args, requests, limit, sizings[0], options)
    work = Workload.of(requests, limit, options)
    jobs = args.jobs or default_jobs(task_count(work, sizings), options)
    with _progress(len(requests) * len(sizings)) as progress:
        results = replay_all(work, sizings, jobs, progress)
    typed = _typed(results, args)
    if args.plot is not None:
        plot(results, args.plot)
    if args.json:
        document = {
            "trace": args.trace,
            "ceiling": {**vars(limit), "hit_rate": limit.hit_rate},
            "runs": [r.to_dict() for r in results],
            "ratio_to_ceiling": typed.ratio,
            "ratio_of": typed.sizing.label,
            "jobs": jobs,
        }
        print(json.dumps(document, indent=2))
        return 0
    say(
        f"trace {printable(args.trace)}: {limit.requests:,} requests, {limit.references:,} block "
        f"references, {limit.unique_blocks:,} unique blocks; infinite-cache prefix hit rate "
        f"{limit.hit_rate:.1%}"
    )
    if jobs > 1:
        say(
            f"runs and simulations in {jobs} worker processes (--jobs {jobs}): the same figures "
            "as --jobs 1, but latencies and wall times measured beside other tasks (--jobs 1 "
            "for clean ones)"
        )
    fits = {c: fit(c, layout) for c in parse_codecs(args.codec)} if args.codec else {}
    for result in results:
        say(format_result(result))
        found = fits.get(result.sizing.label)
        shrink = {"host": found.host, "disk": found.disk} if found is not None else None
        say(model_sizes(result, layout, shrink))
    if fits:
        shown = ", ".join(f"{f.codec} {f.host:.2f}x / {f.disk:.2f}x" for f in fits.values())
        say(
            f"blocks the same bytes hold (host / disk slots, {printable(layout.model_name)}): "
            f"{shown}"
        )
    if len(results) > 1:
        say(format_table(results))
    if args.plot is not None:
        say(f"plot: {printable(args.plot)}")
    others = ", ".join(f"{r.sizing.label} {r.ratio:.3f}" for r in results if r is not typed)
    say(
        f"ratio to the infinite-cache ceiling ({typed.sizing.label}): "
        f"{typed.ratio:.3f}" + (f" ({others})" if others else "")
    )
    return 0


def _typed(results: list[ReplayResult], args: argparse.Namespace) -> ReplayResult:
    """The run of the sizes as typed, which the closing line and the JSON's ratio describe: a
    sweep's x1 point, else the first run (the tiered one, or the first codec)."""
    if args.sweep:
        return next((r for r in results if r.sizing.label == "x1"), results[0])
    return results[0]


def _run_fleet(
    args: argparse.Namespace,
    requests: list[TraceRequest],
    limit: Ceiling,
    sizing: Sizing,
    options: ReplayOptions,
) -> int:
    """`--replicas N [--remote]` (`replicas.py`): the fleet alone, then sharing the cluster."""
    runs = [replay_fleet(requests, limit, sizing, options, args.replicas, None)]
    if args.remote:
        with cluster_nodes(_remote_nodes(args)) as cluster:
            runs.append(replay_fleet(requests, limit, sizing, options, args.replicas, cluster))
    if args.json:
        print(json.dumps({"trace": args.trace, "runs": [r.to_dict() for r in runs]}, indent=2))
        return 0
    say(
        f"trace {printable(args.trace)}: {limit.requests:,} requests over {args.replicas} "
        f"replicas (round robin), each sized gpu {sizing.gpu:g} / host {sizing.host:g} / disk "
        f"{sizing.disk:g} of the unique blocks; ceiling {limit.hit_rate:.1%}"
    )
    say(format_fleet(runs))
    return 0


def _run_routed(
    args: argparse.Namespace,
    requests: list[TraceRequest],
    limit: Ceiling,
    sizing: Sizing,
    options: ReplayOptions,
) -> int:
    """`--replicas N --route ...` (`routed.py`): per N (with `--plot`: 1, 2, 4, ... N), one
    store of N times the capacity, then the N stores under each policy."""
    policies = parse_policies(args.route)
    counts = [args.replicas]
    if args.plot is not None:
        counts = sorted({*(1 << k for k in range(args.replicas.bit_length())), args.replicas})
    with contextlib.ExitStack() as stack:
        nodes = None
        if args.remote:
            nodes = stack.enter_context(cluster_nodes(_remote_nodes(args)))
        by_count = {
            n: replay_routed(requests, limit, sizing, options, n, policies, nodes) for n in counts
        }
    if args.plot is not None:
        plot_routed(by_count, args.plot)
    runs = by_count[args.replicas]
    if args.json:
        document = {"trace": args.trace, "replicas": {n: [r.to_dict() for r in by_count[n]]
                                                      for n in counts}}  # fmt: skip
        print(json.dumps(document, indent=2))
        return 0
    shared = ", sharing a remote tier" if args.remote else ""
    say(
        f"trace {printable(args.trace)}: {limit.requests:,} requests over {args.replicas} "
        f"replicas{shared}, each sized gpu {sizing.gpu:g} / host {sizing.host:g} / disk "
        f"{sizing.disk:g} of the unique blocks; ceiling {limit.hit_rate:.1%}"
    )
    for n in counts:
        if n != args.replicas:
            rates = ", ".join(f"{r.policy} {r.hit_rate:.1%}" for r in by_count[n][1:])
            say(f"N = {n}: one store {by_count[n][0].hit_rate:.1%}; {rates}")
    say(format_routed(runs))
    if args.plot is not None:
        say(f"plot: {printable(args.plot)}")
    return 0


def _remote_nodes(args: argparse.Namespace) -> list[str] | None:
    """`--remote-nodes host:port,...`, or None: a cluster started for the run."""
    return args.remote_nodes.split(",") if args.remote_nodes else None
