"""Audit AE of the disk tier's codecs and recovery: real stores on real slab files.

- int8 / int4 keep every value within half a quantization step of its group: a group of small
  values all of one sign, far from 0, whose fp16 scale is subnormal and rounds up by a large
  part, had its smallest values clipped to code 0, up to 22 steps off (19 % of the value).
- `kvtier check` reads the superblock's `quant` entry (the block shape it decodes quantized
  copies by) only where it agrees with the recorded model: one of another shape made every
  valid copy a corrupt payload, which `--fix` retired, where the store refuses that superblock.
- `kvtier check` decodes a lossless tier's quantized copies by the recorded model, as the store
  does when it serves them: it called them corrupt payloads, and `--fix` retired them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvtier import KVStore, parse_config
from kvtier.quant import QuantCodec
from kvtier.tiers.disk.check import DiskCheckReport, check_directory
from kvtier.tiers.disk.slabs import DamagedDiskError

BT = 16
L, H, D = 2, 2, 32  # a bf16 block: 8 KiB raw, so an int8 slot and a plain one are both 12 KiB


def config(path: Path, codec: str) -> dict[str, object]:
    return {
        "model": {"name": "ae", "num_layers": L, "num_kv_heads": H, "head_dim": D,
                  "dtype": "bfloat16"},
        "block_tokens": BT,
        "tiers": {
            "gpu": {"capacity": "64KiB"},
            "host": {"capacity": "128KiB"},
            "disk": {"capacity": "2MiB", "path": str(path), "codec": codec},
        },
        "policy": {"write": "write_back", "disk_admission_hits": 0},
    }  # fmt: skip


def tokens(seq: int, blocks: int = 2) -> list[int]:
    return [seq * 1000 + j for j in range(blocks * BT)]


def kv(seq: int, blocks: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seq)
    return torch.randn((L, 2, blocks * BT, H, D), generator=g).to(torch.bfloat16)


def persisted(path: Path, codec: str, seqs: range) -> None:
    """A store on `path` that stores `seqs` and gives each a durable disk copy, then closes."""
    store = KVStore(parse_config(config(path, codec)))
    try:
        for seq in seqs:
            store.store(tokens(seq), kv(seq))
        assert store.persist().left_blocks == 0
    finally:
        store.close()


def test_int8_disk_copy_of_a_small_far_group_is_within_half_a_step(tmp_path: Path) -> None:
    # V rows of 128 values all in [2.53e-5, 7.07e-5]: positive and far from 0 for their spread
    small = torch.linspace(2.53e-5, 7.07e-5, H * D).reshape(1, 1, 1, H, D)
    block = kv(1, 1)
    block[:, 1] = small.expand(L, 1, BT, H, D)[:, 0]
    store = KVStore(parse_config(config(tmp_path / "d", "int8")))
    try:
        store.store(tokens(1, 1), block)
        assert store.persist().left_blocks == 0
    finally:
        store.close()
    store = KVStore(parse_config(config(tmp_path / "d", "int8")))  # served from the disk copy
    try:
        got = store.load(tokens(1, 1))
        assert got.num_tokens == BT
        codec: QuantCodec = store.disk.codec.quant  # type: ignore[union-attr]
    finally:
        store.close()
    payload = codec.encode(block.unsqueeze(0))
    groups = L * (codec.k_groups + codec.v_groups)
    scales = payload[0, codec.code_nbytes : codec.code_nbytes + 2 * groups].view(torch.float16)
    v_step = scales[L * codec.k_groups :].float().max().item()
    error = (got.kv[:, 1].float() - block[:, 1].float()).abs().max().item()
    ulp = 7.07e-5 * 2**-8  # the result rounded to bf16
    assert error <= v_step / 2 + ulp, f"{error:.3g} off, a step is {v_step:.3g}"


def test_check_refuses_a_quant_entry_that_is_not_the_models_blocks(tmp_path: Path) -> None:
    path = tmp_path / "d"
    persisted(path, "int8", range(3))
    superblock = path / "kvtier-disk.json"
    geometry = json.loads(superblock.read_text())
    tampered = dict(geometry, quant=dict(geometry["quant"], block_shape=[4, 2, BT, H, D]))
    superblock.write_text(json.dumps(tampered))
    with pytest.raises(DamagedDiskError, match="quant is"):
        check_directory(path, fix=True)  # before: every copy a corrupt payload, retired
    superblock.write_text(json.dumps(geometry))
    report = check_directory(path)
    assert (report.valid, report.problems) == (6, 0)  # nothing retired


def test_check_takes_a_lossless_tiers_quantized_copies_as_the_store_does(tmp_path: Path) -> None:
    quantized, plain = tmp_path / "int8", tmp_path / "none"
    persisted(quantized, "int8", range(3))
    persisted(plain, "none", range(10, 11))
    os.replace(quantized / "slab-00000.kvt", plain / "slab-00000.kvt")  # same slot size
    report = check_directory(plain, fix=True)
    assert (report.valid, report.corrupt_payloads, report.retired) == (6, 0, 0)
    store = KVStore(parse_config(config(plain, "none")))
    try:
        assert store.load(tokens(2)).num_tokens == 2 * BT  # the store serves them
    finally:
        store.close()


def test_check_exits_1_while_bad_slots_are_left_a_fix_included() -> None:
    """`kvtier check --fix` exited 0 when some retires failed (an I/O error on the slab), while
    the README says it exits 1 when it found problems it leaves: `left` counts them."""
    found = DiskCheckReport(corrupt_headers=2, orphans=1, bad_slots=[3, 9, 11])
    assert found.problems == found.left == 3  # without --fix: all there
    found.retired = 2  # --fix, one retire failed
    assert found.left == 1
    found.retired = 3
    assert found.left == 0
    unread = DiskCheckReport(corrupt_headers=1)  # a slot whose read failed (EIO): no retire
    assert unread.left == 1  # so `kvtier check` exits 1, with --fix or without
