"""The sidecar (`kvtier serve`) against the embedded store, on this machine's CPU pools.

It starts its own server process on a free port (gpu 512 MiB and host 1 GiB, both CPU pools in
/dev/shm; 32 layers, 8 kv heads, head_dim 64, bf16, 16 tokens a block: 1 MiB blocks) and:

(b) stores then loads 256 MiB (4096 tokens) through the shared-memory path (`Client`: reserve,
    write into the mapped pool, commit; prefetch, copy the pages out, release) and through an
    in-process `KVStore` of the same config, in the same run, clearing between runs; medians
    of `--repeat` runs after `WARMUP` untimed ones, bit-exact checked;
(a) looks up an 8192-token prompt (its first 4096 tokens cached) over HTTP with a `Client`
    (msgpack; one that maps nothing) and over the local lane (one that maps the pools), the
    two alternated, `--calls` times each after 100 untimed calls: p50 and p99 of each;
(c) runs `--clients` threads, each with its own `Client`, for `--seconds`, mixing lookup,
    prefetch + release, store and load of 128-token sequences (a 64-token prefix shared by
    each group of 4 clients); every call must succeed; throughput (client calls and HTTP requests
    per second, from the server's own counters) and p50/p99 per call.
The last lines are the ratios to the targets: lookup p50 <= 1 ms and p99 <= 3 ms; shared-memory
store+load >= 0.7x the in-process bandwidth; zero errors under concurrency.
Run: `python benchmarks/bench_service.py [--quick]`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml

from kvtier import KVStore, parse_config
from kvtier.client import Client

MIB = 1 << 20
BT = 16
ADMIN_KEY = "bench-admin-key-0123456789"
CONFIG: dict[str, Any] = {
    "model": {
        "name": "bench-1MiB-blocks",
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 64,
        "dtype": "bfloat16",
    },
    "block_tokens": BT,
    "tiers": {
        "gpu": {"capacity": "512MiB", "device": "cpu"},
        "host": {"capacity": "1GiB", "pinned": False},
    },
    "service": {"admin_key": ADMIN_KEY},
}
BLOCK_BYTES = 32 * 2 * BT * 8 * 64 * 2
WARMUP = 3
"""Untimed runs first: the copy planners (store and mover) time their candidate strategies on
the first copies of each kind before they settle on the fastest."""
SHARED, OWN, SEQS = 64, 64, 8
"""(c): each client's 8 sequences are 64 tokens shared by its group of 4 clients, then 64 of
its own: 8 MiB each, 528 distinct blocks over 16 clients, beyond the gpu tier's 512."""


def kv_of(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((32, 2, num_tokens, 8, 64), generator=gen).to(torch.bfloat16)


def tokens_of(base: int, num_tokens: int) -> list[int]:
    return list(range(base, base + num_tokens))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def server(work: Path, settings: dict[str, Any] = CONFIG) -> Iterator[str]:
    """`kvtier serve` of `settings` (with a `service` section) on a free port; its URL once
    /readyz is 200; SIGTERM (exit 0) after. Also `bench_datapath.py`'s server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = work / "bench.yaml"
    config.write_text(
        yaml.safe_dump({**settings, "service": {**settings["service"], "state_dir": str(work)}})
    )
    log = (work / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config), "--port",
         str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {(work / 'server.log').read_text()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/readyz").status_code == 200:
                    break
            time.sleep(0.05)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        status = process.wait(60)
        log.close()
        if status != 0:
            raise SystemExit(f"the server exited with {status}")


def admin(url: str, path: str) -> None:
    response = httpx.post(url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    response.raise_for_status()


def requests_served(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvtier_request_seconds_count")
    )


def timed(
    run: Callable[[], object], repeat: int, setup: Callable[[], object] = lambda: None
) -> float:
    """Median seconds of `repeat` runs of `run`, after `WARMUP` untimed ones; `setup` runs
    before each, untimed (a store's clear)."""
    for _ in range(WARMUP):
        setup()
        run()
    seconds = []
    for _ in range(repeat):
        setup()
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def part_b(url: str, mib: int, repeat: int) -> float:
    tokens = tokens_of(0, mib * MIB // BLOCK_BYTES * BT)
    kv = kv_of(len(tokens), seed=1)
    nbytes = kv.numel() * kv.element_size()
    seconds: dict[str, tuple[float, float]] = {}
    with Client(url) as client:
        assert client.pool_buffer("gpu") is not None, "the pools are not mapped"

        seconds["shared memory"] = (
            timed(lambda: client.store(tokens, kv), repeat, lambda: admin(url, "/v1/admin/clear")),
            timed(lambda: client.load(tokens), repeat),
        )
        assert client.lookup(tokens).num_tokens == len(tokens)
        assert torch.equal(client.load(tokens).kv, kv), "shared memory: not bit-exact"
    with KVStore(parse_config(CONFIG)) as store:
        seconds["in-process"] = (
            timed(lambda: store.store(tokens, kv), repeat, store.clear),
            timed(lambda: store.load(tokens, device="cpu"), repeat),
        )
        assert torch.equal(store.load(tokens, device="cpu").kv, kv), "in-process: not bit-exact"
    print(f"(b) store then load of {nbytes / MIB:.0f} MiB, medians of {repeat} runs")
    bandwidth = {}
    for name, (store_s, load_s) in seconds.items():
        bandwidth[name] = 2 * nbytes / (store_s + load_s) / 1e9
        print(
            f"    {name:<14} store {store_s * 1e3:7.1f} ms ({nbytes / store_s / 1e9:5.2f} GB/s), "
            f"load {load_s * 1e3:7.1f} ms ({nbytes / load_s / 1e9:5.2f} GB/s); "
            f"both {bandwidth[name]:5.2f} GB/s"
        )
    return bandwidth["shared memory"] / bandwidth["in-process"]


def part_a(url: str, calls: int) -> tuple[float, float]:
    """Lookups over HTTP (a client that maps nothing) and over the local lane (a client that
    maps the pools, `kvtier/service/lane.py`), alternated call by call; returns HTTP's p50 and
    p99, which the targets name."""
    prompt = tokens_of(0, 8192)  # (b) left its sequence cached: the prompt's first part
    seconds: dict[str, list[float]] = {"HTTP": [], "the local lane": []}
    with Client(url, shared_memory=False) as http, Client(url) as near:
        clients = {"HTTP": http, "the local lane": near}
        cached = http.lookup(prompt).num_tokens
        for _ in range(100):
            http.lookup(prompt)
            near.lookup(prompt)
        for call in range(calls):
            for name in sorted(clients, reverse=call % 2 == 1):
                start = time.perf_counter()
                clients[name].lookup(prompt)
                seconds[name].append(time.perf_counter() - start)
        assert near._lane is not None and near._lane.calls > calls, "the lane was not taken"
    for name, taken in seconds.items():
        print(
            f"(a) lookup of an 8192-token prompt ({cached} cached), {calls} calls over {name}: "
            f"p50 {quantile(taken, 0.5) * 1e3:.2f} ms, p99 {quantile(taken, 0.99) * 1e3:.2f} ms"
        )
    lane_p50 = quantile(seconds["the local lane"], 0.5)
    print(f"    p50 HTTP / lane: {quantile(seconds['HTTP'], 0.5) / lane_p50:.2f}")
    return quantile(seconds["HTTP"], 0.5), quantile(seconds["HTTP"], 0.99)


def sequences(index: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Client `index`'s sequences for (c) and their KV (the shared prefix's KV depends on the
    prefix alone, as in a model)."""
    shared = tokens_of(1_000_000 + index // 4 * 1000, SHARED)
    seqs = [[*shared, *tokens_of(2_000_000 + (index * SEQS + i) * 1000, OWN)] for i in range(SEQS)]
    kvs = [kv_of(SHARED + OWN, seed=index * SEQS + i) for i in range(SEQS)]
    for kv in kvs:
        kv[:, :, :SHARED] = kv_of(SHARED, seed=10_000 + index // 4)
    return seqs, kvs


def part_c(url: str, clients: int, seconds: float) -> int:
    ops = ("lookup", "prefetch+release", "store", "load")
    latencies: dict[str, list[float]] = {op: [] for op in ops}
    errors: list[str] = []
    lock = threading.Lock()
    data = [sequences(index) for index in range(clients)]  # made before the clock starts
    ready = threading.Barrier(clients + 1)

    def worker(index: int) -> None:
        rng = random.Random(index)
        seqs, kvs = data[index]
        mine: dict[str, list[float]] = {op: [] for op in ops}
        try:
            with Client(url) as client:
                ready.wait()
                stop = time.monotonic() + seconds
                while time.monotonic() < stop:
                    i = rng.randrange(SEQS)
                    op = rng.choice(("lookup", "lookup", "prefetch+release", "store", "load"))
                    start = time.perf_counter()
                    if op == "lookup":
                        client.lookup(seqs[i])
                    elif op == "prefetch+release":
                        client.release(client.prefetch(seqs[i]))
                    elif op == "store":
                        client.store(seqs[i], kvs[i])
                    else:
                        loaded = client.load(seqs[i])
                        if not torch.equal(loaded.kv, kvs[i][:, :, : loaded.num_tokens]):
                            raise AssertionError(f"load of sequence {i}: not bit-exact")
                    mine[op].append(time.perf_counter() - start)
        except Exception as exc:
            with lock:
                errors.append(f"client {index}: {type(exc).__name__}: {exc}")
            ready.abort()
        with lock:
            for op, values in mine.items():
                latencies[op].extend(values)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        ready.wait()
    before = requests_served(url)
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    served = requests_served(url) - before - 1  # less the scrape itself
    total = sum(len(values) for values in latencies.values())
    everything = [s for values in latencies.values() for s in values]
    print(
        f"(c) {clients} clients for {elapsed:.1f} s: {total / elapsed:.0f} calls/s, "
        f"{served / elapsed:.0f} HTTP requests/s, p50 {quantile(everything, 0.5) * 1e3:.1f} "
        f"ms, p99 {quantile(everything, 0.99) * 1e3:.1f} ms, {len(errors)} errors"
    )
    for op, values in latencies.items():
        print(
            f"    {op:<17}{len(values):>7} calls, p50 {quantile(values, 0.5) * 1e3:6.2f} ms, "
            f"p99 {quantile(values, 0.99) * 1e3:6.2f} ms"
        )
    for error in errors[:5]:
        print(f"    {error}")
    return len(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 500 lookups, 5 s of (c)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    mib, calls, seconds = (64, 500, 5.0) if args.quick else (256, args.calls, args.seconds)
    print(f"{os.cpu_count()} CPUs; torch {torch.__version__}; 1 MiB blocks (bf16, {BT} tokens)")
    with tempfile.TemporaryDirectory(prefix="bench-service-") as work, server(Path(work)) as url:
        ratio = part_b(url, mib, args.repeat)
        p50, p99 = part_a(url, calls)
        errors = part_c(url, args.clients, seconds)
    print(f"ratio, lookup p50 / 1 ms target: {p50 / 1e-3:.2f}; p99 / 3 ms target: {p99 / 3e-3:.2f}")
    print(f"ratio, shared-memory / in-process store+load bandwidth: {ratio:.2f} (target >= 0.7)")
    print(f"errors under {args.clients} concurrent clients: {errors} (target 0)")


if __name__ == "__main__":
    main()
