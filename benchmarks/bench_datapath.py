"""The data path at memory speed (issue 19): `KVStore.load` and `store`, in process and through
the sidecar's shared memory, each against raw copies of the same bytes measured in the same run.

Two block shapes, bf16, 16 tokens a block: 1 MiB blocks (32 layers, 8 kv heads, head_dim 64:
rows of 16 KiB per layer and K|V) and 64 KiB blocks (4 layers, 4 kv heads, head_dim 64: rows of
8 KiB); prompts of `--sizes` MiB (default 16, 256, 1024). The gpu and host tiers are CPU pools
(no disk), each of `HEADROOM` times the prompt: it fills 80% of a tier, under the watermarks,
so nothing is demoted; every timed store lands in free slots (the store is cleared, untimed,
before each one). Per block shape and prompt, each figure against its baseline:

  load out=layers|blocks   into a preallocated, touched `out`   one raw `dst.copy_(src)` of two
                                                                preallocated, touched contiguous
                                                                tensors of the same bytes
  load start=80% out=...   `load(start=)` of the last fifth     one raw contiguous copy of the
                           into the head of `out`               tail's bytes (counts toward the
                                                                `out` point: a partial `out`)
  load (allocating)        into a tensor it allocates           `clone()` of the same bytes (both
                                                                pay first-touch page faults)
  store write_through      writes gpu and host                  2 raw copies
  store write_back         writes gpu                           1 raw copy
  sidecar store, load      a `Client` through /dev/shm, against the in-process call on a
                           `kvtier serve` of the same config (load into `out` where the client
                           takes `out=`; else allocating, on both sides)

Timing: rounds that run the figure and its baseline once each, which goes first alternating,
after `WARMUP` untimed rounds (`PLANNER_WARMUP` for the sidecar store); medians of `--repeat`
rounds; the ratio is the baseline's median seconds over the figure's. Each load is checked byte
for byte against the stored KV (into a zeroed `out`) once per prompt, outside the timing.

Per block shape, the sidecar's round trip: a one-block lookup through the client after a raw
copy of 16 MiB each round, what a sidecar call pays besides its copies (a load makes one, a
store two: at 16 MiB this bounds the sidecar figures, not the copies).

Then `CLIENTS` concurrent clients (threads, a `Client` each) store then load their own 16 MiB
prompts through the sidecar, `--rounds` each, against one client doing the same work alone:
aggregate GB/s and p50/p99 per call; no client starves when p99 < `STARVATION` x p50.

Prints a table (figure, GB/s, baseline GB/s, ratio, target, met/missed) and, last, each of
issue 19's acceptance points met or missed; `--json PATH` writes every figure. GB/s = 1e9 B/s.
Memory: about 7 GiB at a 1 GiB prompt (the prompt and `out`, the in-process store's and the
server's pools, one transient result).
Run: `python benchmarks/bench_datapath.py [--quick] [--sizes 16,256] [--json PATH]`.
Exit status 1 when a load was not bit-exact.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_service import ADMIN_KEY, admin, quantile, server

from kvtier import KVStore, parse_config
from kvtier.blocks import KVLayout, blocks_of
from kvtier.client import Client
from kvtier.results import LoadResult
from kvtier.transfer.planner import SAMPLES

MIB = 1 << 20
TARGET = 0.8
"""Every figure's floor, as a share of its baseline's bandwidth."""
STARVATION = 4.0
"""Under concurrency, no client starves while each call's p99 is under this many p50s."""
HEADROOM = 1.25
"""Pool capacity per tier over the bytes it must hold: they fill 80%, under every watermark."""
WARMUP = 2
PLANNER_WARMUP = 2 * SAMPLES
"""The sidecar's commit makes the write_through host copy through the copy planner, which times
`SAMPLES` copies of each candidate strategy (slices, gather) before it settles."""
CLIENTS, CLIENT_MIB = 16, 16
LOADER = Callable[..., LoadResult]
"""`KVStore.load` or `Client.load`: (tokens, *, out=None, layout="layers") -> LoadResult."""

POINTS = {
    "load_out": "load into a preallocated out >= 0.8 of one raw copy",
    "load_alloc": "load allocating its result >= 0.8 of clone()",
    "store": "store >= 0.8 of the raw copies its write policy needs",
    "sidecar": "sidecar shared-memory store and load >= 0.8 of in-process",
    "concurrency": f"{CLIENTS} clients: no client starves (p99 < {STARVATION:.0f}x p50)",
}


@dataclass(frozen=True)
class Geometry:
    """A block shape: bf16, 16 tokens a block, head_dim 64."""

    name: str
    num_layers: int
    num_kv_heads: int

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.name, self.num_layers, self.num_kv_heads, 64, "bfloat16", 16)

    def config(self, capacity_mib: int, write: str) -> dict[str, Any]:
        """gpu and host as CPU pools of `capacity_mib` each, no disk, policy `write`."""
        layout = self.layout
        capacity = f"{capacity_mib}MiB"
        return {
            "model": {
                "name": self.name,
                "num_layers": layout.num_layers,
                "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim,
                "dtype": layout.dtype_name,
            },
            "block_tokens": layout.block_tokens,
            "tiers": {
                "gpu": {"capacity": capacity, "device": "cpu"},
                "host": {"capacity": capacity, "pinned": False},
            },
            "policy": {"write": write},
            "service": {"admin_key": ADMIN_KEY},
        }


GEOMETRIES = (Geometry("1MiB", 32, 8), Geometry("64KiB", 4, 4))


def capacity_mib(mib: int) -> int:
    """A tier's capacity for `mib` MiB of blocks (`HEADROOM`)."""
    return math.ceil(mib * HEADROOM)


@dataclass
class Prompt:
    """A prompt of whole blocks, its KV (random bits) and a touched destination of its size."""

    layout: KVLayout
    tokens: np.ndarray[Any, Any]
    kv: torch.Tensor  # [L, 2, tokens, H, D], contiguous
    out: torch.Tensor  # the same shape, touched

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_blocks(self) -> int:
        return len(self.tokens) // self.layout.block_tokens

    @property
    def pages(self) -> torch.Tensor:
        """`out`'s memory seen as pages `[blocks, *block_shape]` (layout "blocks")."""
        return self.out.view(self.num_blocks, *self.layout.block_shape)

    def expected_pages(self) -> torch.Tensor:
        """The KV as pages: a strided view of `kv`, no copy."""
        return blocks_of(self.kv, self.layout.block_tokens, 0, self.num_blocks)


def prompt_of(layout: KVLayout, mib: int, first_token: int, seed: int) -> Prompt:
    blocks = mib * MIB // layout.block_bytes
    num_tokens = blocks * layout.block_tokens
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    tokens = np.arange(first_token, first_token + num_tokens, dtype=np.int64)
    return Prompt(
        layout, tokens, bits.view(layout.dtype), torch.zeros_like(bits).view(layout.dtype)
    )


# ---- timing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One timed call, and what must run untimed just before it (a clear before a store)."""

    run: Callable[[], object]
    before: Callable[[], object] | None = None


def medians(ops: Sequence[Op], repeat: int, warmup: int = WARMUP) -> list[float]:
    """Median seconds of each op over `repeat` rounds, after `warmup` untimed ones. A round runs
    every op once, the order rotated by one each round, so that no op always runs first; what
    an op returns is freed after its clock stops."""
    samples: list[list[float]] = [[] for _ in ops]
    for r in range(warmup + repeat):
        for k in range(len(ops)):
            i = (r + k) % len(ops)
            before, run = ops[i].before, ops[i].run
            if before is not None:
                before()
            start = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - start
            del result
            if r >= warmup:
                samples[i].append(elapsed)
    return [statistics.median(s) for s in samples]


@dataclass(frozen=True)
class Figure:
    """One measured figure against its baseline (bandwidths of `nbytes`, the prompt's size)."""

    block: str
    prompt_mib: int
    name: str
    point: str  # the acceptance point it counts toward (`POINTS`)
    nbytes: int
    seconds: float
    baseline: str
    baseline_seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def baseline_gbps(self) -> float:
        return self.nbytes / self.baseline_seconds / 1e9

    @property
    def ratio(self) -> float:
        return self.baseline_seconds / self.seconds

    @property
    def met(self) -> bool:
        return self.ratio >= TARGET

    def as_json(self) -> dict[str, Any]:
        derived = {"gbps": self.gbps, "baseline_gbps": self.baseline_gbps, "ratio": self.ratio}
        return {**dataclasses.asdict(self), **derived, "target": TARGET, "met": self.met}


HEADER = (
    f"{'block':<6}{'prompt':>8}  {'figure':<26}{'GB/s':>7}  {'baseline':<22}{'GB/s':>7}"
    f"{'ratio':>7}{'target':>8}  result"
)


def row(figure: Figure) -> str:
    return (
        f"{figure.block:<6}{figure.prompt_mib:>5}MiB  {figure.name:<26}{figure.gbps:>7.2f}  "
        f"{figure.baseline:<22}{figure.baseline_gbps:>7.2f}{figure.ratio:>7.3f}"
        f"{'>=' + str(TARGET):>8}  {'met' if figure.met else 'MISSED'}"
    )


class Figures:
    """The figures of one prompt, printed as they come."""

    def __init__(self, geometry: Geometry, prompt: Prompt, repeat: int) -> None:
        self.geometry, self.prompt, self.repeat = geometry, prompt, repeat
        self.done: list[Figure] = []

    def add(
        self,
        point: str,
        measured: tuple[str, Op],
        baseline: tuple[str, Op],
        warmup: int = WARMUP,
        nbytes: int | None = None,
    ) -> None:
        """`nbytes`: the bytes both sides move, when not the whole prompt's."""
        seconds, baseline_seconds = medians([measured[1], baseline[1]], self.repeat, warmup)
        figure = Figure(
            self.geometry.name,
            self.prompt.nbytes // MIB,
            measured[0],
            point,
            self.prompt.nbytes if nbytes is None else nbytes,
            seconds,
            baseline[0],
            baseline_seconds,
        )
        print(row(figure), flush=True)
        self.done.append(figure)


# ---- checks -----------------------------------------------------------------------------------


def check_load(name: str, loaded: LoadResult, want: torch.Tensor) -> list[str]:
    """What is wrong with `loaded` for a KV that should be `want` (same layout), compared bit
    for bit (int16 views: every bf16 pattern, NaNs included, equals only itself); [] when it is
    exact."""
    tokens = want.shape[2] if want.dim() == 5 else want.shape[0] * want.shape[3]
    if loaded.num_tokens != tokens or loaded.kv.shape != want.shape:
        return [
            f"{name}: loaded {loaded.num_tokens} tokens of shape {tuple(loaded.kv.shape)}, "
            f"expected {tokens} of {tuple(want.shape)}"
        ]
    got, expected = loaded.kv.view(torch.int16), want.view(torch.int16)
    bad = sum(not torch.equal(g, w) for g, w in zip(got, expected, strict=True))
    return [f"{name}: {bad} of {len(want)} slices along dim 0 differ"] if bad else []


def check_loads(name: str, load: LOADER, prompt: Prompt, into_out: bool) -> list[str]:
    """Load `prompt` into its zeroed `out` in both layouts (when `into_out`) and allocating;
    every mismatch (`check_load`)."""
    problems = []
    if into_out:
        prompt.out.zero_()
        loaded = load(prompt.tokens, out=prompt.out)
        problems += check_load(f"{name} load out=layers", loaded, prompt.kv)
        prompt.out.zero_()
        loaded = load(prompt.tokens, out=prompt.pages, layout="blocks")
        problems += check_load(f"{name} load out=blocks", loaded, prompt.expected_pages())
    problems += check_load(f"{name} load (allocating)", load(prompt.tokens), prompt.kv)
    return problems


# ---- in process -------------------------------------------------------------------------------


def raw_copies(prompt: Prompt, copies: int) -> Op:
    """`copies` raw copies of the prompt's bytes between two touched contiguous tensors."""

    def run() -> None:
        for _ in range(copies):
            prompt.out.copy_(prompt.kv)

    return Op(run)


def store_op(store: KVStore, prompt: Prompt) -> Op:
    """A store of the whole prompt into free slots: the store is cleared, untimed, first."""
    return Op(lambda: store.store(prompt.tokens, prompt.kv), store.clear)


def measure_in_process(figures: Figures, store: KVStore, mismatches: list[str]) -> None:
    """The loads of one prompt and its store, on a write_through `store` (module doc); the
    loads checked first."""
    prompt = figures.prompt
    store.clear()
    store.store(prompt.tokens, prompt.kv)
    mismatches += check_loads("in-process", store.load, prompt, into_out=True)
    raw = ("raw copy", raw_copies(prompt, 1))
    for kind, out in (("layers", prompt.out), ("blocks", prompt.pages)):
        op = Op(partial(store.load, prompt.tokens, out=out, layout=kind))
        figures.add("load_out", (f"load out={kind}", op), raw)
    measure_start(figures, store, mismatches)
    allocating = Op(partial(store.load, prompt.tokens))
    figures.add("load_alloc", ("load (allocating)", allocating), ("clone", Op(prompt.kv.clone)))
    both = ("2 raw copies", raw_copies(prompt, 2))
    figures.add("store", ("store write_through", store_op(store, prompt)), both)


def measure_start(figures: Figures, store: KVStore, mismatches: list[str]) -> None:
    """`load(start=)` of the last fifth of the prompt (an engine holding the rest) into the head
    of `out`, against one raw contiguous copy of the same bytes; checked first."""
    prompt = figures.prompt
    start = prompt.num_blocks * 4 // 5 * prompt.layout.block_tokens
    tail = len(prompt.tokens) - start
    out = prompt.out[:, :, :tail]
    prompt.out.zero_()
    loaded = store.load(prompt.tokens, start=start, out=out)
    if loaded.num_tokens != len(prompt.tokens) or not torch.equal(
        loaded.kv.view(torch.int16), prompt.kv[:, :, start:].view(torch.int16)
    ):
        mismatches.append(f"in-process load start={start}: not the prompt's tail")
    count = prompt.kv[:, :, start:].numel()
    flat_out, flat_kv = prompt.out.view(-1)[:count], prompt.kv.view(-1)[:count]
    op = Op(partial(store.load, prompt.tokens, start=start, out=out))
    raw = Op(lambda: flat_out.copy_(flat_kv))
    nbytes = count * prompt.kv.element_size()
    figures.add(
        "load_out", ("load start=80% out=layers", op), ("raw copy (tail)", raw), nbytes=nbytes
    )


def measure_write_back(figures: Figures, config: dict[str, Any]) -> None:
    """The store of one prompt on a write_back store of `config`, made for it and closed."""
    with KVStore(parse_config(config)) as store:
        one = ("1 raw copy", raw_copies(figures.prompt, 1))
        figures.add("store", ("store write_back", store_op(store, figures.prompt)), one)


# ---- the sidecar ------------------------------------------------------------------------------


def takes_out(client: Client) -> bool:
    """Whether this `Client.load` can load into the caller's `out` (issue 19)."""
    return "out" in inspect.signature(client.load).parameters


def measure_sidecar(
    figures: Figures, store: KVStore, client: Client, url: str, mismatches: list[str]
) -> None:
    """The sidecar's store and loads of one prompt against the in-process ones (`store` has the
    server's config), in the same rounds; the client's loads checked first."""
    prompt = figures.prompt
    assert client.pool_buffer("gpu") is not None, "the server's pools are not mapped here"
    admin(url, "/v1/admin/clear")
    client.store(prompt.tokens, prompt.kv)
    store.clear()
    store.store(prompt.tokens, prompt.kv)
    into_out = takes_out(client)
    remote: LOADER = client.load
    mismatches += check_loads("sidecar", remote, prompt, into_out)
    kinds = (("layers", prompt.out), ("blocks", prompt.pages)) if into_out else ()
    for kind, out in kinds:
        mine = Op(partial(store.load, prompt.tokens, out=out, layout=kind))
        theirs = Op(partial(remote, prompt.tokens, out=out, layout=kind))
        figures.add("sidecar", (f"sidecar load out={kind}", theirs), ("in-process load", mine))
    if not into_out:
        mine, theirs = Op(lambda: store.load(prompt.tokens)), Op(lambda: remote(prompt.tokens))
        figures.add("sidecar", ("sidecar load (alloc.)", theirs), ("in-process load", mine))
    remote_store = Op(
        lambda: client.store(prompt.tokens, prompt.kv), lambda: admin(url, "/v1/admin/clear")
    )
    figures.add(
        "sidecar",
        ("sidecar store", remote_store),
        ("in-process store", store_op(store, prompt)),
        PLANNER_WARMUP,
    )


@dataclass(frozen=True)
class Concurrency:
    """`clients` clients, each storing then loading its own prompts, `rounds` each."""

    clients: int
    rounds: int
    seconds: float  # wall time, from all starting together to the last one done
    nbytes: int  # stored plus loaded, all clients
    store_s: list[float]
    load_s: list[float]
    client_s: list[float]  # each client's own time

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    def p(self, op: str, q: float) -> float:
        return quantile(self.store_s if op == "store" else self.load_s, q)

    @property
    def starved(self) -> bool:
        return any(self.p(op, 0.99) >= STARVATION * self.p(op, 0.5) for op in ("store", "load"))

    def line(self) -> str:
        spans = [
            f"{op} p50 {self.p(op, 0.5) * 1e3:6.1f} p99 {self.p(op, 0.99) * 1e3:6.1f} ms"
            for op in ("store", "load")
        ]
        return (
            f"  {self.clients:>2} client{'s' if self.clients > 1 else ' '} x {self.rounds:>2} "
            f"rounds: {self.gbps:6.2f} GB/s; {'; '.join(spans)}; each client "
            f"{min(self.client_s):.2f}-{max(self.client_s):.2f} s"
        )

    def as_json(self) -> dict[str, Any]:
        quantiles = {
            f"{op}_p{round(q * 100)}_s": self.p(op, q)
            for op in ("store", "load")
            for q in (0.5, 0.99)
        }
        return {
            "clients": self.clients,
            "rounds": self.rounds,
            "seconds": self.seconds,
            "gbps": self.gbps,
            **quantiles,
            "client_s": self.client_s,
            "starved": self.starved,
        }


def run_clients(
    url: str, kv: torch.Tensor, clients: int, rounds: int, mismatches: list[str]
) -> Concurrency:
    """`clients` threads, a `Client` each, started together; each stores then loads `rounds`
    prompts of its own (the KV `kv` under fresh tokens each round: free slots), into its own
    `out` where the client takes one; its last load checked bit for bit, untimed."""
    tokens_each = kv.shape[2]
    store_s: list[float] = []
    load_s: list[float] = []
    client_s = [0.0] * clients
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def worker(index: int) -> None:
        out = torch.zeros_like(kv)
        mine: tuple[list[float], list[float]] = ([], [])
        try:
            with Client(url) as client:
                load: LOADER = client.load
                into = {"out": out} if takes_out(client) else {}
                start.wait()
                began = time.perf_counter()
                for r in range(rounds):
                    first = (index * rounds + r) * tokens_each
                    tokens = np.arange(first, first + tokens_each, dtype=np.int64)
                    t0 = time.perf_counter()
                    client.store(tokens, kv)
                    t1 = time.perf_counter()
                    loaded = load(tokens, **into)
                    t2 = time.perf_counter()
                    mine[0].append(t1 - t0)
                    mine[1].append(t2 - t1)
                client_s[index] = time.perf_counter() - began
                problems = check_load(f"client {index} of {clients}", loaded, kv)
        except Exception as exc:  # reported; the others go on
            start.abort()
            problems = [f"client {index} of {clients}: {type(exc).__name__}: {exc}"]
        with lock:
            store_s.extend(mine[0])
            load_s.extend(mine[1])
            mismatches.extend(problems)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    nbytes = (len(store_s) + len(load_s)) * kv.numel() * kv.element_size()
    return Concurrency(clients, rounds, seconds, nbytes, store_s, load_s, client_s)


def measure_concurrency(
    url: str, client: Client, layout: KVLayout, rounds: int, mismatches: list[str]
) -> tuple[Concurrency, Concurrency]:
    """One client alone doing `CLIENTS` x `rounds` rounds, then `CLIENTS` clients doing
    `rounds` each (after one untimed round of them), each run on a cleared server whose pools
    are resident (zeroed through the mapping first, as pools in use are)."""
    for tier in ("gpu", "host"):
        buffer = client.pool_buffer(tier)
        if buffer is not None:
            buffer.zero_()
    kv = prompt_of(layout, CLIENT_MIB, 0, seed=1).kv
    runs = []
    for clients, each in ((CLIENTS, 1), (1, CLIENTS * rounds), (CLIENTS, rounds)):
        admin(url, "/v1/admin/clear")
        runs.append(run_clients(url, kv, clients, each, mismatches))
    admin(url, "/v1/admin/clear")
    return runs[1], runs[2]


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything measured, for the summary and the JSON."""

    figures: list[Figure] = dataclasses.field(default_factory=list)
    concurrency: dict[str, tuple[Concurrency, Concurrency]] = dataclasses.field(
        default_factory=dict
    )
    mismatches: list[str] = dataclasses.field(default_factory=list)
    sidecar_out: bool | None = None  # whether the client loaded into `out` (None: not run)
    round_trips: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds, by block

    def verdicts(self) -> dict[str, bool | None]:
        """Each acceptance point: met, missed, or None when nothing measured it."""
        verdicts: dict[str, bool | None] = {}
        for point in POINTS:
            rows = [f for f in self.figures if f.point == point]
            verdicts[point] = all(f.met for f in rows) if rows else None
        runs = self.concurrency.values()
        verdicts["concurrency"] = not any(many.starved for _, many in runs) if runs else None
        return verdicts

    def as_json(self) -> dict[str, Any]:
        return {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "target": TARGET,
            "figures": [f.as_json() for f in self.figures],
            "concurrency": {
                block: {"alone": one.as_json(), "together": many.as_json()}
                for block, (one, many) in self.concurrency.items()
            },
            "sidecar_load_into_out": self.sidecar_out,
            "sidecar_round_trip_s": self.round_trips,
            "acceptance": self.verdicts(),
            "mismatches": self.mismatches,
        }


def measure_prompt(
    figures: Figures, config: dict[str, Any], client: Client | None, url: str, run: Run
) -> None:
    """The in-process figures of one prompt on a write_through store of `config`, made for
    it and closed, and the sidecar's against it through `client` (when given) at `url`."""
    with KVStore(parse_config(config)) as store:
        measure_in_process(figures, store, run.mismatches)
        if client is not None:
            measure_sidecar(figures, store, client, url, run.mismatches)


def round_trip(client: Client, layout: KVLayout) -> float:
    """Median seconds of a one-block lookup through `client`, each round after a raw copy of
    `CLIENT_MIB` MiB (the state a sidecar call of the figures meets: caches full of other
    bytes): what a sidecar call pays besides its copies."""
    prompt = prompt_of(layout, CLIENT_MIB, 1 << 31, 7)  # token ids no figure's prompt uses
    tokens = prompt.tokens[: layout.block_tokens]
    lookup, copy = Op(partial(client.lookup, tokens)), raw_copies(prompt, 1)
    return medians([lookup, copy], 9)[0]


def measure_geometry(
    run: Run, geometry: Geometry, sizes: Sequence[int], repeat: int, rounds: int, sidecar: bool
) -> None:
    """Every figure of one block shape (module doc); the sidecar's too when `sidecar`."""
    capacity = capacity_mib(max(*sizes, CLIENTS * rounds * CLIENT_MIB if sidecar else 0))
    with contextlib.ExitStack() as stack:
        client, url = None, ""
        if sidecar:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-dp-")))
            url = stack.enter_context(server(work, geometry.config(capacity, "write_through")))
            client = stack.enter_context(Client(url))
            run.sidecar_out = takes_out(client)
        for i, mib in enumerate(sizes):
            figures = Figures(geometry, prompt_of(geometry.layout, mib, i << 24, i), repeat)
            measure_prompt(figures, geometry.config(capacity, "write_through"), client, url, run)
            gc.collect()  # a closed store's pools stay mapped until it is collected
            measure_write_back(figures, geometry.config(capacity, "write_back"))
            gc.collect()
            run.figures += figures.done
            del figures  # the prompt: the next one's memory
        if client is not None:
            run.round_trips[geometry.name] = seconds = round_trip(client, geometry.layout)
            print(
                f"sidecar round trip (a one-block lookup, between {CLIENT_MIB} MiB copies): "
                f"{seconds * 1e3:.2f} ms; a sidecar load makes one, a store two (reserve, commit)"
            )
            print(
                f"{CLIENTS} concurrent clients through the sidecar, {geometry.name} blocks, "
                f"{CLIENT_MIB} MiB prompts, store then load each round:"
            )
            one, many = measure_concurrency(url, client, geometry.layout, rounds, run.mismatches)
            print(one.line())
            print(many.line())
            print(f"  aggregate, {CLIENTS} clients / 1 client: {many.gbps / one.gbps:.2f}")
            run.concurrency[geometry.name] = (one, many)


def summary(run: Run) -> list[str]:
    """The closing lines: mismatches, then each acceptance point met or missed."""
    lines = [f"MISMATCH {problem}" for problem in run.mismatches]
    for point, verdict in run.verdicts().items():
        state = "not measured" if verdict is None else "met" if verdict else "MISSED"
        missed = [
            f"{f.block} {f.prompt_mib}MiB {f.name} {f.ratio:.3f}"
            for f in run.figures
            if f.point == point and not f.met
        ]
        if point == "concurrency":
            missed = [
                f"{block} {op} p99/p50 {many.p(op, 0.99) / many.p(op, 0.5):.1f}"
                for block, (_, many) in run.concurrency.items()
                for op in ("store", "load")
                if many.p(op, 0.99) >= STARVATION * many.p(op, 0.5)
            ]
        lines.append(
            f"{state}: {POINTS[point]}" + (f" (missed: {', '.join(missed)})" if missed else "")
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="16 and 64 MiB, 3 rounds: a smoke run")
    parser.add_argument("--sizes", help="prompt sizes in MiB, comma-separated (16,256,1024)")
    parser.add_argument("--blocks", default="1MiB,64KiB", help="block shapes: 1MiB, 64KiB")
    parser.add_argument("--repeat", type=int, help="timed rounds per figure (5; --quick 3)")
    parser.add_argument(
        "--rounds", type=int, help="rounds per client under concurrency (4; --quick 2)"
    )
    parser.add_argument("--no-sidecar", action="store_true", help="in-process figures only")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    args = parser.parse_args()
    default_sizes = "16,64" if args.quick else "16,256,1024"
    sizes = [int(s) for s in (args.sizes or default_sizes).split(",")]
    repeat = args.repeat or (3 if args.quick else 5)
    rounds = args.rounds or (2 if args.quick else 4)
    geometries = {g.name: g for g in GEOMETRIES}
    wanted = [geometries[name] for name in args.blocks.split(",")]
    print(
        f"{os.cpu_count()} CPUs; torch {torch.__version__}; prompts of {sizes} MiB; medians of "
        f"{repeat} rounds; GB/s = 1e9 B/s of the prompt's bytes"
    )
    print(HEADER)
    run = Run()
    for geometry in wanted:
        measure_geometry(run, geometry, sizes, repeat, rounds, not args.no_sidecar)
    if run.sidecar_out is False:
        print(
            "the sidecar's Client.load takes no out= here: its loads allocate, and so do the "
            "in-process ones they are set against"
        )
    for line in summary(run):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(run.as_json(), indent=2) + "\n")
    return 1 if run.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
