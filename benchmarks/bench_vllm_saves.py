"""What the vLLM connector's saves cost a step: inline in `wait_for_save` against queued to their
own thread (`kvtier.save_async`, `integrations/saving.py`), with a step that saves nothing as
the floor, all in one run.

The worker side of the real connector (vLLM's classes installed apart, as the engine tests do)
against a real `kvtier serve` (1 MiB blocks: 32 layers, 8 KV heads, head_dim 64, bf16, 16-token
blocks). Each step plays a forward (about `--forward-ms` of single-threaded matmuls, which
release the GIL as a GPU's kernels would leave the CPU free) and then saves a new prompt of
`--prompt-tokens` tokens from vLLM's paged KV, every `--every` steps. Then a chat's next turn
(`next_turn`): a save of `--history-tokens` kvtier holds and `--new-tokens` past them, sending
every block against the tail alone. The forward is a fixed
count of matmuls (calibrated alone), so a save thread that takes its core shows. Prints the
step's p50, p90 and mean (ms) per mode, the ratios, and checks that every token was stored.

    bash tests/engines/install.sh vllm
    PYTHONPATH=.engines/vllm python benchmarks/bench_vllm_saves.py [--steps 120]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_service import CONFIG, server
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtier.integrations.plans import SaveJob
from kvtier.integrations.vllm import KvtierConnector, KvtierMetadata

LAYERS, HEADS, DIM, BLOCK = 32, 8, 64, 16


def connector(url: str, save_async: bool) -> KvtierConnector:
    extra = {"kvtier.url": url, "kvtier.save_async": save_async}
    config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"),
    )  # fmt: skip
    return KvtierConnector(config, KVConnectorRole.WORKER, None)


A = torch.randn(256, 256)


def forward(matmuls: int) -> None:
    """The step's compute: a fixed amount of work, which takes longer when the saves' thread
    and the sidecar contend for the cores."""
    for _ in range(matmuls):
        torch.mm(A, A)


def calibrate(ms: float) -> int:
    """Matmuls taking about `ms` on this machine, alone."""
    start = time.perf_counter()
    forward(200)
    return max(1, round(200 * ms / 1000 / (time.perf_counter() - start)))


def paged(worker: KvtierConnector, num_blocks: int, seed: int) -> None:
    """Register `num_blocks` vLLM blocks of random KV per layer with `worker`."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, HEADS, BLOCK, 2 * DIM)
    layers = {
        f"layers.{i}": torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(LAYERS)
    }
    worker.register_kv_caches(layers)


def run(url: str, mode: str, args: argparse.Namespace, base: int) -> tuple[list[float], int]:
    """Step times (ms) of `args.steps` steps in `mode` (none, inline, queued); tokens stored."""
    worker = connector(url, save_async=mode == "queued")
    blocks = args.prompt_tokens // BLOCK
    paged(worker, blocks * 2 + 1, base)
    times = []
    for step in range(args.steps):
        saves = []
        if mode != "none" and step % args.every == 0:
            first = base + step * 10_000  # new tokens each save
            tokens = tuple(range(first, first + args.prompt_tokens))
            ids = tuple(1 + (step % 2) * blocks + b for b in range(blocks))
            saves.append(SaveJob(f"r{step}", tokens, ids, ""))
        meta = KvtierMetadata(saves=saves, save_async=mode == "queued")
        start = time.perf_counter()
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        forward(args.matmuls)
        worker.wait_for_save()
        worker.get_finished(set())
        worker.clear_connector_metadata()
        times.append((time.perf_counter() - start) * 1000)
    worker.shutdown()
    return times, worker.stats["saved_tokens"]


def next_turn(url: str, history: int, new: int, rounds: int) -> dict[str, list[float]]:
    """A chat's next turn: `history` tokens kvtier already holds, `new` past them. Inline save
    times (ms) of the turn sending every block (start 0, what the connector did before it
    knew kvtier's prefix) against sending the tail past the prefix, alternated; each stores
    the same `new` tokens."""
    worker = connector(url, save_async=False)
    blocks = (history + new) // BLOCK
    paged(worker, blocks + 1, 7)
    ids = tuple(range(1, blocks + 1))
    times: dict[str, list[float]] = {"every block": [], "the tail": []}
    for round_ in range(rounds):
        for k, label in enumerate(times if round_ % 2 else reversed(times)):
            first = 3_000_000_000 + (round_ * 2 + k) * 10_000
            tokens = tuple(range(first, first + history + new))
            for job in (
                SaveJob("head", tokens[:history], ids[: history // BLOCK], ""),  # untimed
                SaveJob("turn", tokens, ids, "", history if label == "the tail" else 0),
            ):
                worker.bind_connector_metadata(KvtierMetadata(saves=[job], save_async=False))
                stored, start = worker.stats["saved_tokens"], time.perf_counter()
                worker.wait_for_save()
                elapsed = (time.perf_counter() - start) * 1000
                worker.clear_connector_metadata()
                assert worker.stats["saved_tokens"] - stored == len(job.tokens) - (
                    0 if job.req_id == "head" else history
                ), "a save stored other than its new tokens"
            times[label].append(elapsed)
    worker.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    assert args.prompt_tokens <= 10_000 and args.steps <= 190, "token ids of runs would meet"
    torch.set_num_threads(1)
    args.matmuls = calibrate(args.forward_ms)
    config = {
        **CONFIG,
        "tiers": {"gpu": {"capacity": "2GiB", "device": "cpu"},
                  "host": {"capacity": "2GiB", "pinned": False}},
    }  # fmt: skip
    saves = len(range(0, args.steps, args.every))
    mib = args.prompt_tokens // BLOCK  # 1 MiB blocks
    print(f"steps {args.steps}, forward {args.forward_ms} ms, a {args.prompt_tokens}-token "
          f"prompt ({mib} MiB) saved every {args.every} steps ({saves} saves), "
          f"{args.rounds} rounds")  # fmt: skip
    per: dict[str, list[float]] = {"none": [], "inline": [], "queued": []}
    history, new = args.history_tokens, args.new_tokens
    with tempfile.TemporaryDirectory() as tmp, server(Path(tmp), config) as url:
        for round_ in range(args.rounds):
            order = ["none", "inline", "queued"]
            order = order[round_ % 3 :] + order[: round_ % 3]  # each mode first in turn
            for mode in order:
                base = 2_000_000 * (1 + round_ * 3 + order.index(mode))  # new tokens each run
                times, stored = run(url, mode, args, base)
                want = 0 if mode == "none" else saves * args.prompt_tokens
                assert stored == want, f"{mode}: stored {stored} tokens, expected {want}"
                per[mode] += times
        turn = next_turn(url, history, new, 10)
    floor = statistics.median(per["none"])
    for mode, times in per.items():
        p50 = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        mean = statistics.fmean(times)
        print(f"  {mode:<7} step p50 {p50:7.2f} ms  p90 {p90:7.2f} ms  mean {mean:7.2f} ms  "
              f"p50 / no saves {p50 / floor:5.2f}")  # fmt: skip
    for stat in (statistics.median, statistics.fmean):
        ratio = stat(per["queued"]) / stat(per["inline"])
        print(f"queued / inline, step {stat.__name__}: {ratio:.2f}")
    print(f"a chat's next turn, {history} tokens kvtier holds and {new} new, saved inline "
          f"(10 rounds):")  # fmt: skip
    for label, times in turn.items():
        print(f"  sending {label:<12} p50 {statistics.median(times):7.2f} ms")
    ratio = statistics.median(turn["the tail"]) / statistics.median(turn["every block"])
    print(f"the tail / every block, p50: {ratio:.2f}")


if __name__ == "__main__":
    main()
