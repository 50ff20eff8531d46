"""`kvtier replay --codec`: host and disk at one byte budget, one run per codec, each holding the
blocks the real model's quantized copies fit in those bytes (`replay/codecs.py`); and what a
planner reads: sizes not rounded to nothing, a sweep's closing line about the sizes typed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_replay import write_trace

from kvtier.blocks import KVLayout
from kvtier.cli import main
from kvtier.config import format_size, parse_config
from kvtier.errors import InvalidArgumentError
from kvtier.replay.codecs import fit, parse_codecs
from kvtier.replay.report import share


def test_the_blocks_a_byte_budget_holds_follow_the_payloads() -> None:
    smollm2 = fit("int4")  # the default config's model: 30 layers, 3 kv heads of 64, bf16
    assert round(smollm2.host, 2) == 3.51  # 368,640 raw bytes / 105,120
    assert 3.3 < smollm2.disk < smollm2.host  # 4 KiB header regions and rounding cost a little
    assert fit("none").host == fit("none").disk == 1.0
    wide = KVLayout("wide", 80, 8, 128, "bfloat16", 16)
    assert fit("int8", wide).host == pytest.approx(2 / (1 + 3 / 128))
    for bad in ("lz4", "int3", "", "int4,int4", "none,,zstd"):
        with pytest.raises(InvalidArgumentError, match="--codec"):
            parse_codecs(bad)
    assert parse_codecs("none, int4") == ["none", "int4"]


def test_a_quantized_budget_holds_a_working_set_the_raw_one_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 8 prompts of 2 blocks each, asked in turn three times: a cyclic scan of 16 blocks, which
    # LRU serves only when all 16 fit. Host of 30 % raw: 5 blocks; in int4, 3.56x: 17
    prompts = [[2 * p, 2 * p + 1] for p in range(8)]
    path = write_trace(tmp_path / "t.jsonl", prompts * 3)
    args = ["replay", str(path), "--codec", "none,int8,int4", "--gpu", "0.01", "--host", "0.3",
            "--disk", "0", "--json", "--block-bytes", "2048"]  # fmt: skip
    assert main(args) == 0
    runs = {run["sizing"]["label"]: run for run in json.loads(capsys.readouterr().out)["runs"]}
    assert list(runs) == ["none", "int8", "int4"]
    assert runs["int4"]["sizing"]["host"] == pytest.approx(0.3 * fit("int4").host)
    assert runs["none"]["hit_rate"] == 0.0  # 6 blocks against a scan of 16
    assert runs["int8"]["hit_rate"] == 0.0  # 1 + 11
    assert runs["int4"]["hit_rate"] == pytest.approx(2 / 3)  # 1 + 17: rounds 2 and 3 hit
    assert capsys.readouterr().err == ""
    assert main(["replay", str(path), "--codec", "int2"]) == 2
    assert "--codec: got 'int2'" in capsys.readouterr().err


def test_small_sizes_are_not_rounded_to_nothing() -> None:
    assert [share(x) for x in (0, 0.5, 0.05, 0.012, 0.001, 0.00012)] == [
        "0%",
        "50%",
        "5.0%",
        "1.2%",
        "0.10%",
        "0.012%",
    ]


def test_a_sweeps_closing_line_and_json_describe_the_sizes_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[0, 1], [0, 1], [2, 3], [0, 1]])
    args = ["replay", str(path), "--sweep", "--gpu", "0.5", "--host", "0", "--disk", "0",
            "--block-bytes", "2048"]  # fmt: skip
    assert main(args) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("ratio to the infinite-cache ceiling (x1): ")
    assert main([*args, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    typed = next(run for run in document["runs"] if run["sizing"]["label"] == "x1")
    assert document["ratio_of"] == "x1"
    assert document["ratio_to_ceiling"] == typed["ratio_to_ceiling"]


def test_sizes_are_printed_in_blocks_and_bytes_of_the_configs_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 8 unique trace blocks of 512 tokens; the model's blocks are 16 tokens of 2*2*16*4*8*2 bytes
    model = tmp_path / "model.yaml"
    model.write_text(
        "model: {name: planner-model, num_layers: 2, num_kv_heads: 4, head_dim: 8, "
        "dtype: float16}\nblock_tokens: 16\n"
    )
    path = write_trace(tmp_path / "t.jsonl", [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]])
    args = ["replay", str(path), "--gpu", "0.25", "--host", "0.5", "--disk", "1",
            "--no-baseline", "--config", str(model), "--codec", "none,int4"]  # fmt: skip
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  as ")]
    # blocks of 2 * 2 * 16 * 4 * 8 * 2 bytes = 4 KiB; gpu 2 trace blocks = 64 model blocks,
    # host 4 = 128, disk 8 = 256 (raw bytes)
    assert lines[0] == (
        "  as planner-model (float16, 16-token blocks of 4KiB): gpu 64 blocks (256KiB), "
        "host 128 blocks (512KiB), disk 256 blocks (1MiB)"
    )
    int4 = fit("int4", parse_config({"model": {"name": "planner-model", "num_layers": 2,
               "num_kv_heads": 4, "head_dim": 8, "dtype": "float16"}}).layout)  # fmt: skip
    host_blocks = round(0.5 * int4.host * 8) * 32  # 3.4x the blocks in (about) the same bytes
    nbytes = format_size(round(host_blocks * 4096 / int4.host))
    assert f"host {host_blocks} blocks ({nbytes})" in lines[1] and host_blocks > 3 * 128


def test_a_size_too_large_under_a_codec_is_refused_as_typed_and_no_tier_reads_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [[0, 1], [0, 1], [2, 3]])
    ratio = fit("int4").host  # 3.51: 50 typed is 175 blocks' worth, past the bound of 100
    assert main(["replay", str(path), "--codec", "none,int4", "--host", "50", "--disk", "0"]) == 2
    err = capsys.readouterr().err
    assert "--host: got 50.0, which under --codec int4" in err
    assert f"expected at most {math.floor(100 / ratio * 100) / 100:g}" in err and "175" in err
    bound = float(err.split("expected at most ")[1].split()[0])  # rounded down: itself taken
    assert bound * ratio <= 100 < (bound + 0.01) * ratio
    assert main(["replay", str(path), "--codec", "int4", "--host", "28", "--disk", "0"]) == 0
    # a gpu-only run's host and disk are no tier at all, not a tier of 0 %
    assert main(["replay", str(path), "--gpu", "0.5", "--block-bytes", "2048"]) == 0
    only = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("gpu-only"))
    assert only.split()[1:4] == ["50%", "none", "none"]
