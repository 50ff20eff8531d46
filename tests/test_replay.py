"""`kvtier replay`: trace parsing, the ceiling, exact scenarios on tiny traces, the real trace.

Tiny traces use 512-token store blocks of 2 KiB (head_dim 1) and the inline mover, so every
count below follows from the store's placement rules."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from kvtier.cli import main
from kvtier.errors import InvalidArgumentError, TraceError
from kvtier.replay import (
    ReplayOptions,
    Sizing,
    capacity_blocks,
    ceiling,
    format_result,
    parse_line,
    read_trace,
    replay,
    replay_config,
)

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason=f"no trace at {TRACE}")
B = 512  # tokens per trace block
TINY = ReplayOptions(block_bytes=2048)

# 4 requests, 6 unique blocks; hits: r2 (0, 1), r3 (0), r4 (0, 1, 2): 6 of 12 references
SHARED = [[0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2, 5]]


def write_trace(path: Path, hash_ids: list[list[int]]) -> Path:
    lines = []
    for i, ids in enumerate(hash_ids):
        record = {"timestamp": 10 * i, "input_length": len(ids) * B - 7, "output_length": 3}
        lines.append(json.dumps({**record, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tokens_are_a_distinct_run_per_hash_id() -> None:
    request = parse_line('{"timestamp": 0, "input_length": 600, "output_length": 1, '
                         '"hash_ids": [7, 3]}')  # fmt: skip
    tokens = request.tokens()
    assert request.num_tokens == len(tokens) == 2 * B
    assert tokens[0] == 7 * B and tokens[B - 1] == 7 * B + B - 1 and tokens[B] == 3 * B


def test_ceiling_counts_leading_ids_seen_before(tmp_path: Path) -> None:
    limit = ceiling(read_trace(write_trace(tmp_path / "t.jsonl", SHARED)))
    assert (limit.requests, limit.references, limit.unique_blocks) == (4, 12, 6)
    assert limit.prefix_hits == limit.seen_hits == 6
    assert limit.hit_rate == 0.5


def test_a_cache_larger_than_the_trace_serves_the_ceiling_from_gpu(tmp_path: Path) -> None:
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    result = replay(requests, ceiling(requests), Sizing("big", 2.0, 2.0, 0.0), TINY)
    assert result.served == {"gpu": 6 * B, "host": 0, "recomputed": 6 * B}  # no disk tier
    assert result.ceiling_tokens == 6 * B
    assert result.ratio == 1.0
    assert result.prefetches == 0 and result.dropped_tokens == 0
    assert result.missed_tokens == 6 * B and result.recomputed_after_drop == 0


def test_a_one_block_gpu_serves_from_host(tmp_path: Path) -> None:
    # gpu holds 1 block, which leaves it only when its slot is needed (the replay's mover is
    # inline): one hit finds its block still on gpu, the others on host; r3's one-block prefix
    # is prefetched, r2's and r4's do not fit on gpu
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    result = replay(requests, ceiling(requests), Sizing("host", 0.1, 2.0, 0.0), TINY)
    assert result.capacity_bytes["gpu"] == 2048
    assert result.served == {"gpu": B, "host": 5 * B, "recomputed": 6 * B}
    assert (result.prefetches, result.prefetch_refused) == (1, 2)
    assert result.ratio == 1.0


def test_a_disk_tier_keeps_what_memory_cannot(tmp_path: Path) -> None:
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    tiered = replay(requests, ceiling(requests), Sizing("disk", 0.1, 0.7, 2.0), TINY)
    alone = replay(requests, ceiling(requests), Sizing("gpu-only", 0.1, 0.0, 0.0), TINY)
    assert tiered.ratio == 1.0 and tiered.served["disk"] > 0
    assert tiered.path_bytes["host->disk"] > 0
    assert alone.hit_tokens < tiered.hit_tokens
    assert list(alone.served) == ["gpu", "recomputed"]


def test_the_gpu_only_run_has_no_host_tier(tmp_path: Path) -> None:
    # gpu holds 3 blocks and nothing is below it: its victims are dropped, never copied. r2
    # evicts block 2 for 3, r3 block 3 for 4; r4's blocks 2 and 5 do not fit beside its
    # pinned prefix 0, 1 and block 4: dropped
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    alone = replay(requests, ceiling(requests), Sizing("gpu-only", 0.5, 0.0, 0.0), TINY)
    assert alone.capacity_bytes == {"gpu": 3 * 2048} and alone.capacity_blocks == {"gpu": 3}
    assert alone.path_bytes == {}
    assert alone.served == {"gpu": 5 * B, "recomputed": 7 * B}
    assert alone.evictions == {"gpu": 2} and alone.demotions == {"gpu": 0}
    assert alone.dropped_tokens == 2 * B and alone.missed_tokens == 7 * B
    report = format_result(alone)
    assert "host" not in report.replace("host none", "")
    assert "(gpu 6KiB)" in report and "bytes moved: none" in report


# r1 and r2 send 3 new blocks to a 2-block gpu with nothing below: dropped whole. r3 stores
# blocks 0, 1. r4 hits them and its block 2 is dropped (0, 1 are pinned while room is made).
# r5 evicts block 1 for block 3; r6 hits block 0 and misses the evicted block 1.
DROPS = [[0, 1, 2], [0, 1, 2], [0, 1], [0, 1, 2], [3], [0, 1]]


def test_dropped_stores_are_told_apart_from_misses(tmp_path: Path) -> None:
    requests = read_trace(write_trace(tmp_path / "t.jsonl", DROPS))
    result = replay(requests, ceiling(requests), Sizing("g", 0.5, 0.0, 0.0), TINY)
    assert result.capacity_blocks == {"gpu": 2}
    assert result.dropped_tokens == (3 + 3 + 1) * B  # what the stores reported dropped
    assert result.served == {"gpu": 3 * B, "recomputed": 11 * B}
    assert sum(result.served.values()) == result.tokens == 14 * B
    # after a drop: r2's 3 blocks, r3's 2, r4's block 2; missed: r1's 3, r5's 1, r6's 1
    assert result.recomputed_after_drop == 6 * B and result.missed_tokens == 5 * B
    assert result.hit_tokens + result.missed_tokens + result.recomputed_after_drop == 14 * B
    assert "recomputed (tokens): 2,560 missed (never stored, or evicted), 3,072 after their " \
        "store was dropped" in format_result(result)  # fmt: skip


def test_a_store_dropped_in_blocks_of_a_trace_block_is_told_apart(tmp_path: Path) -> None:
    # 128-token store blocks, 4 per trace block: the same drops, each four times
    requests = read_trace(write_trace(tmp_path / "t.jsonl", DROPS))
    options = ReplayOptions(block_tokens=128, block_bytes=2048)
    result = replay(requests, ceiling(requests), Sizing("g", 0.5, 0.0, 0.0), options)
    assert result.capacity_blocks == {"gpu": 8}
    assert result.dropped_tokens == 7 * B and result.recomputed_after_drop == 6 * B
    assert result.missed_tokens == 5 * B


def test_sizes_become_capacities_of_scaled_blocks(tmp_path: Path) -> None:
    options = ReplayOptions(block_tokens=16, block_bytes=4096)
    config = replay_config(Sizing("s", 0.01, 0.1, 0.0), 1000, options, str(tmp_path))
    assert config.layout.block_bytes == 4096 // 32  # a 512-token block is 32 store blocks
    assert config.tiers.gpu.capacity.nbytes == 320 * 128  # 1 % of 32,000 store blocks
    assert config.tiers.host is not None and config.tiers.host.capacity.nbytes == 3200 * 128
    assert config.tiers.disk is None
    assert config.policy.disk_admission_hits == 0 and config.mover.background is False


def test_a_run_is_compared_with_one_cache_of_its_blocks() -> None:
    big = ReplayOptions(block_tokens=16)  # a 512-token block is 32 store blocks
    assert capacity_blocks(Sizing("g", 0.5, 0.0, 0.0), 6, TINY) == 3
    assert capacity_blocks(Sizing("t", 0.1, 0.7, 2.0), 6, TINY) == 1 + 4 + 12
    assert capacity_blocks(Sizing("g", 0.5, 0.0, 0.0), 6, big) == 96


def test_a_paced_replay_keeps_its_clock(tmp_path: Path) -> None:
    # 10 ms apart at speed 0.1: 100 ms between requests, far more than a tiny store needs
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    # A sleep that ends over 10 ms late counts as late (true, and it happens on a machine busy
    # with other work), so the clock is kept on one of three runs; every run's count agrees
    # with its worst lag
    paced = ReplayOptions(block_bytes=2048, speed=0.1)
    runs = []
    for _ in range(3):
        pacing = replay(requests, ceiling(requests), Sizing("g", 2.0, 0.0, 0.0), paced).pacing
        assert pacing is not None and pacing.requests == 4
        assert pacing.schedule_s == pytest.approx(0.3) and pacing.ran_s >= 0.3
        assert (pacing.late > 0) == pacing.fell_behind == (pacing.max_lag_s > pacing.late_s)
        runs.append(pacing)
        if not pacing.fell_behind:
            break
    assert runs[-1].late == 0, runs
    assert replay(requests, ceiling(requests), Sizing("g", 2.0, 0.0, 0.0), TINY).pacing is None


def test_a_paced_replay_says_when_it_fell_behind(tmp_path: Path) -> None:
    # each request takes over 30 ms (the progress callback sleeps) but is due 10 ms after the
    # one before: request k starts at least 20 k ms late
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    paced = ReplayOptions(block_bytes=2048, speed=1.0)
    result = replay(
        requests, ceiling(requests), Sizing("g", 2.0, 0.0, 0.0), paced, lambda _: time.sleep(0.03)
    )
    pacing = result.pacing
    assert pacing is not None and pacing.fell_behind
    assert (pacing.requests, pacing.late) == (4, 3)
    assert pacing.max_lag_s >= 0.06 and pacing.ran_s >= pacing.schedule_s + 0.06


def test_the_replay_runs_on_one_torch_thread_and_restores_it(tmp_path: Path) -> None:
    requests = read_trace(write_trace(tmp_path / "t.jsonl", SHARED))
    threads = torch.get_num_threads()
    seen: list[int] = []
    replay(
        requests,
        ceiling(requests),
        Sizing("g", 2.0, 0.0, 0.0),
        TINY,
        lambda _: seen.append(torch.get_num_threads()),
    )
    assert seen == [1, 1, 1, 1]
    assert torch.get_num_threads() == threads


def test_bad_options_and_sizes_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="block_tokens: got 100"):
        ReplayOptions(block_tokens=100)
    with pytest.raises(InvalidArgumentError, match="block_bytes: got 1000"):
        ReplayOptions(block_bytes=1000)
    with pytest.raises(InvalidArgumentError, match="--gpu: got 0"):
        Sizing("s", 0.0, 0.1, 1.0)
    with pytest.raises(InvalidArgumentError, match=r"--host: got 0 \(no host tier\) with --disk 1"):
        Sizing("s", 0.1, 0.0, 1.0)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "got list, expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing hash_ids"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "timestamp: got -1"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}',
         "hash_ids: got \\[\\]"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}',
         "hash_ids\\[1\\]: got 'a'"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, '
         '"hash_ids": [18446744073709551616]}',
         "hash_ids\\[0\\]: got 18446744073709551616, expected an int in \\[0, 2\\*\\*64\\)"),
        ('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}',
         "hash_ids: got 1 ids for input_length 513"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "timestamp: got 0, expected >= 10"),
    ],
)  # fmt: skip
def test_a_bad_line_is_a_typed_error_naming_it(tmp_path: Path, line: str, problem: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[0], [0, 1]])
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(TraceError, match=f"t.jsonl:3: {problem}") as info:
        read_trace(path)
    assert info.value.line == 3


def test_a_missing_or_empty_trace_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot be read"):
        read_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no request"):
        read_trace(tmp_path / "empty.jsonl")


def test_cli_prints_both_runs_and_the_ratio_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path / "t.jsonl", SHARED)
    args = ["replay", str(path), "--gpu", "0.1", "--host", "0.7", "--disk", "2", "--block-bytes",
            "2048", "--dir", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"trace {path}: 4 requests, 12 block references, 6 unique")
    assert lines[-1].startswith("ratio to the infinite-cache ceiling (tiered): 1.000 (gpu-only")
    # gpu-only holds 1 block: a one-block cache keeps block 0, the first of every request
    sims = [line for line in lines if "simulated: LRU of leaves" in line]
    assert sims[0].startswith("  one cache of the same 17 blocks, simulated: LRU of leaves 50.0%")
    assert sims[1].startswith("  one cache of the same 1 blocks, simulated: LRU of leaves 25.0%")
    assert not any("paced" in line for line in lines)
    assert list(tmp_path.iterdir()) == [path]  # the disk tier's directory is gone


def test_cli_json_and_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", SHARED)
    assert (
        main(
            [
                "replay",
                str(path),
                "--json",
                "--no-baseline",
                "--host",
                "0.7",
                "--block-bytes",
                "2048",
            ]
        )
        == 0
    )
    document = json.loads(capsys.readouterr().out)
    assert document["ceiling"]["prefix_hits"] == 6
    assert [run["sizing"]["label"] for run in document["runs"]] == ["tiered"]
    assert document["ratio_to_ceiling"] == 1.0
    # gpu 1 %, host 70 %, disk 100 % of 6 blocks: 1 + 4 + 6 blocks hold the whole trace
    run = document["runs"][0]
    assert run["yardsticks"]["lru"] == {"capacity": 11, "requests": 4, "references": 12,
                                        "hits": 6}  # fmt: skip
    assert run["simulated_hit_rates"] == {"lru": 0.5, "furthest": 0.5}
    assert run["ratio_to_lru"] == 1.0 and run["pacing"] is None
    path.write_text("{}\n")
    assert main(["replay", str(path)]) == 2
    assert "t.jsonl:1: missing timestamp" in capsys.readouterr().err


def test_sweep_table_compares_each_size_with_its_simulations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path / "t.jsonl", SHARED)
    args = ["replay", str(path), "--sweep", "--gpu", "0.5", "--host", "0", "--disk", "0",
            "--block-bytes", "2048"]  # fmt: skip
    assert main(args) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("x")}  # fmt: skip
    # gpu-only of 3 blocks (x1): LRU of leaves serves 5 of 12 blocks (test_simulate's rules),
    # 1 block (x0.02 ... x0.2): 3 of 12, block 0 of every request after the first
    assert rows["x1"][10:12] == ["41.7%", "41.7%"]
    assert rows["x0.02"][10:12] == ["25.0%", "25.0%"]


def test_sweep_plots_hit_rate_by_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the optional extra `plot` is not installed")
    path = write_trace(tmp_path / "t.jsonl", SHARED)
    image = tmp_path / "sweep.png"
    args = ["replay", str(path), "--sweep", "--plot", str(image), "--block-bytes", "2048"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("\nx") == 6  # one table row per scale
    assert "LRU sim furthest  st/LRU" in out
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_trace
def test_the_first_requests_of_the_real_trace() -> None:
    requests = read_trace(TRACE, limit=400)
    limit = ceiling(requests)
    assert limit.prefix_hits == limit.seen_hits  # the ids are chained
    tiered = replay(requests, limit, Sizing("tiered", 0.01, 0.10, 1.0), ReplayOptions())
    alone = replay(requests, limit, Sizing("gpu-only", 0.01, 0.0, 0.0), ReplayOptions())
    assert tiered.ceiling_tokens == limit.prefix_hits * B
    assert tiered.ratio >= 0.95
    assert alone.ratio < 0.5 * tiered.ratio


@needs_trace
@pytest.mark.slow
def test_acceptance_on_the_whole_trace() -> None:
    requests = read_trace(TRACE)
    limit = ceiling(requests)
    assert (limit.requests, limit.references, limit.unique_blocks) == (12031, 288500, 182790)
    assert round(limit.hit_rate, 3) == 0.366
    tiered = replay(requests, limit, Sizing("tiered", 0.01, 0.10, 1.0), ReplayOptions())
    alone = replay(requests, limit, Sizing("gpu-only", 0.01, 0.0, 0.0), ReplayOptions())
    assert tiered.ratio >= 0.95
    assert alone.ratio < 0.5
    assert tiered.wall_s + alone.wall_s < 600


def test_hashed_ids_replay_as_the_same_trace_numbered_in_order(tmp_path: Path) -> None:
    """Traces of the format that name blocks by 64-bit or 32-bit hashes (LMCache's and Dynamo's
    generators) replay: `read_trace` renumbers ids in the order they first appear, so the same
    requests share the same blocks and the figures are those of the trace numbered 0, 1, ..."""
    rng = random.Random(5)
    dense = [[0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2, 5], [6, 7], [0, 4, 8]]
    for bits in (64, 32):
        names = list({rng.getrandbits(bits): None for _ in range(9)})  # in no order, past 2**23
        assert len(names) == 9
        hashed = [[names[i] for i in ids] for ids in dense]
        requests = read_trace(write_trace(tmp_path / f"h{bits}.jsonl", hashed))
        assert [r.hash_ids for r in requests] == [tuple(ids) for ids in dense]
    plain = read_trace(write_trace(tmp_path / "d.jsonl", dense))
    assert replay(requests, ceiling(requests), Sizing("s", 0.5, 0.5, 0.0), TINY).served == (
        replay(plain, ceiling(plain), Sizing("s", 0.5, 0.5, 0.0), TINY).served
    )
    line = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [8388608]}'
    with pytest.raises(TraceError, match=r"hash_ids\[0\]: got 8388608, .* not renumbered"):
        parse_line(line)  # a line alone keeps its ids: its tokens must fit in 32 bits


def _trace_of(path: Path, hash_ids: list[list[int]], block_tokens: int) -> Path:
    """`write_trace` for ids of `block_tokens` tokens."""
    lines = []
    for i, ids in enumerate(hash_ids):
        record = {"timestamp": 10 * i, "input_length": len(ids) * block_tokens - 7}
        lines.append(json.dumps({**record, "output_length": 3, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trace_of_16_token_ids_replays_as_the_same_trace_of_512(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Alibaba's Bailian traces name 16-token blocks: `--trace-block-tokens 16`. SHARED with
    each 512-token id written as 32 ids of 16 tokens is the same trace: the same tokens served
    from the same tiers, the same ceiling, in stores of the same sizes."""
    fine = [[h * 32 + j for h in ids for j in range(32)] for ids in SHARED]
    small = read_trace(_trace_of(tmp_path / "t16.jsonl", fine, 16), block_tokens=16)
    large = read_trace(write_trace(tmp_path / "t512.jsonl", SHARED))
    assert small[0].num_tokens == large[0].num_tokens == 3 * B
    sizing = Sizing("s", 0.4, 0.5, 0.0)
    runs = [
        replay(reqs, ceiling(reqs), sizing, ReplayOptions(16, 2048, trace_block_tokens=bt))
        for reqs, bt in ((small, 16), (large, B))
    ]
    assert runs[0].served == runs[1].served and runs[0].served["gpu"] > 0
    assert runs[0].ceiling_tokens == runs[1].ceiling_tokens == 6 * B
    assert runs[0].capacity_blocks == runs[1].capacity_blocks
    with pytest.raises(InvalidArgumentError, match="trace_block_tokens: got 512, expected the"):
        replay(small, ceiling(small), sizing, ReplayOptions(16, 2048))  # not told: refused
    args = ["replay", str(tmp_path / "t16.jsonl"), "--gpu", "1", "--host", "0", "--disk", "0",
            "--block-bytes", "2048", "--no-baseline"]  # fmt: skip
    assert main(args) == 2  # read as 512-token ids: the lengths do not match
    assert "ids of blocks of another size: --trace-block-tokens" in capsys.readouterr().err
    assert main([*args, "--trace-block-tokens", "16"]) == 0
    assert "ratio to the infinite-cache ceiling (tiered): 1.000" in capsys.readouterr().out


def test_timestamps_in_seconds_are_read_to_the_nearest_millisecond(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bailian's timestamps are float seconds: `--trace-time-unit s` keeps them as the nearest
    millisecond, so the trace is the same as one written in milliseconds; without it a float
    is refused with the flag named, and so is a bad number of seconds."""
    stamps = [0, 0.0004, 1.1115, 61.25, 61.2504, 360]
    lines = [
        json.dumps({"timestamp": t, "input_length": 9, "output_length": 1, "hash_ids": [i]})
        for i, t in enumerate(stamps)
    ]
    path = tmp_path / "seconds.jsonl"
    path.write_text("\n".join(lines) + "\n")
    requests = read_trace(path, block_tokens=16, seconds=True)
    assert [r.timestamp_ms for r in requests] == [0, 0, 1112, 61250, 61250, 360_000]
    with pytest.raises(TraceError, match=r":2: timestamp: got 0.0004, .*--trace-time-unit s"):
        read_trace(path, block_tokens=16)  # milliseconds: a float is no integer
    for bad in ("NaN", "-1.5", "1e300", '"7"', "true"):
        line = f'{{"timestamp": {bad}, "input_length": 9, "output_length": 1, "hash_ids": [1]}}'
        (tmp_path / "bad.jsonl").write_text(line + "\n")
        with pytest.raises(TraceError, match=r":1: timestamp: got .*expected seconds"):
            read_trace(tmp_path / "bad.jsonl", block_tokens=16, seconds=True)
    args = ["replay", str(path), "--trace-block-tokens", "16", "--gpu", "1", "--host", "0",
            "--disk", "0", "--block-bytes", "2048", "--no-baseline", "--speed", "1000"]  # fmt: skip
    assert main(args) == 2
    assert "--trace-time-unit s" in capsys.readouterr().err
    started = time.monotonic()
    assert main([*args, "--trace-time-unit", "s"]) == 0  # 360 s of trace at 1000x: 0.36 s
    assert time.monotonic() - started >= 0.35  # read as milliseconds, it would take 0.36 ms
    assert "6 requests" in capsys.readouterr().out
