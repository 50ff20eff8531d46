"""What concurrent loads through the body cost `kvtier serve` in memory, with the in-flight budget
(`service.max_inflight_bytes`) and without one, in the same run.

Two server processes of one config (64 KiB blocks: 4 layers, 4 kv heads, head_dim 64, bf16, 16
tokens a block; CPU pools sized for the prefix) differ only in the budget: `--budget-mib` (256)
against 1 TiB, which nothing here reaches (the server before the budget held every call's bytes
at once; this is that server's behaviour, not its code). Each stores a `--mib` prefix (128: past
malloc's largest mmap threshold, so a freed reply leaves the process and the peak RSS shows what
was held at once) through the body, then, per round, its peak RSS is reset
(`/proc/PID/clear_refs`) and `--loads` clients (8) load the whole prefix through the body at
once, each checked bit-exact; the rounds alternate which server goes first. Printed: medians over
`--rounds` of the peak RSS growth and the wall time of a round, for each server, and the ratios.
Run: `python benchmarks/bench_inflight.py [--quick]`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
import yaml

from kvtier.client import Client

MIB = 1 << 20
MODEL = {"name": "bench", "num_layers": 4, "num_kv_heads": 4, "head_dim": 64, "dtype": "bfloat16"}
TOKEN_BYTES = 4 * 2 * 4 * 64 * 2  # 4 KiB


@contextlib.contextmanager
def server(work: Path, mib: int, budget: int, port: int) -> Iterator[tuple[str, int]]:
    pool = mib * MIB + 64 * 65536
    config = {
        "model": MODEL,
        "block_tokens": 16,
        "tiers": {"gpu": {"capacity": pool, "device": "cpu"},
                  "host": {"capacity": pool, "pinned": False}},
        "service": {"state_dir": str(work / "state"), "max_body_bytes": mib * MIB + MIB,
                    "max_inflight_bytes": budget},
    }  # fmt: skip
    path = work / "kvtier.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [
        sys.executable,
        "-m",
        "kvtier.cli",
        "serve",
        "--config",
        str(path),
        "--port",
        str(port),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/readyz").status_code == 200:
                    break
            time.sleep(0.1)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(30)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def round_of(
    url: str, pid: int, tokens: list[int], kv: torch.Tensor, loads: int
) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of `loads` concurrent loads of the prefix."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = peak_rss_mib(pid)
    ok: list[bool] = []

    def load() -> None:
        with Client(url, shared_memory=False, timeout_s=300) as client:
            got = client.load(tokens)
            ok.append(got.num_tokens == len(tokens) and torch.equal(got.kv, kv))

    threads = [threading.Thread(target=load) for _ in range(loads)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if ok != [True] * loads:
        raise RuntimeError(f"a load came back wrong or short: {ok}")
    return peak_rss_mib(pid) - before, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="64 MiB prefix, 3 rounds")
    args = parser.parse_args()
    mib, rounds = (64, 3) if args.quick else (args.mib, args.rounds)
    budget = max(args.budget_mib, mib + 1) * MIB
    tokens = list(range(1000, 1000 + mib * MIB // TOKEN_BYTES))
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((4, 2, len(tokens), 4, 64), generator=gen).to(torch.bfloat16)
    figures: dict[str, list[tuple[float, float]]] = {"budget": [], "unbounded": []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        servers = {}
        for i, (name, limit) in enumerate((("budget", budget), ("unbounded", 1 << 40))):
            work = Path(tmp) / name
            work.mkdir()
            servers[name] = stack.enter_context(server(work, mib, limit, 18760 + i))
            with Client(servers[name][0], shared_memory=False, timeout_s=300) as client:
                client.store(tokens, kv)
        for r in range(rounds):
            for name in ("budget", "unbounded") if r % 2 == 0 else ("unbounded", "budget"):
                url, pid = servers[name]
                figures[name].append(round_of(url, pid, tokens, kv, args.loads))
    medians = {
        name: (statistics.median(g for g, _ in rows), statistics.median(s for _, s in rows))
        for name, rows in figures.items()
    }
    print(f"{args.loads} concurrent loads of a {mib} MiB prefix through the body, {rounds} rounds")
    for name, (grown, seconds) in medians.items():
        print(f"  {name:9}: peak RSS +{grown:.0f} MiB, {seconds:.2f} s a round")
    (g_b, s_b), (g_u, s_u) = medians["budget"], medians["unbounded"]
    print(f"peak RSS growth budget / unbounded: {g_b / g_u:.2f} (budget {budget // MIB} MiB)")
    print(f"time a round budget / unbounded: {s_b / s_u:.2f}")


if __name__ == "__main__":
    main()
