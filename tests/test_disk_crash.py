"""Crash consistency with real SIGKILLs (issue 3).

A writer process (`crash_writer.py`) stores and persists sequences and acknowledges each one
once it is durable. It is killed with SIGKILL at random moments (during start-up and recovery
too), 20 times. After every kill, a store opened on the same directory must recover every
acknowledged sequence bit-exact, and whatever it serves for any other sequence must be
bit-exact as well: a torn or partial block is never served. With a quantized disk tier
(`int4`), "bit-exact" is against what the codec decodes the stored KV to (every block a fresh
store serves comes from disk).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from crash_writer import BT, config, kv_of, tokens_of

from kvtier import KVStore, parse_config
from kvtier.quant import QuantCodec, QuantSpec

WRITER = Path(__file__).with_name("crash_writer.py")
KILLS = 20


def stored_kv(seq: int, codec: str) -> torch.Tensor:
    """What a disk copy of sequence `seq` decodes to under `codec`."""
    kv = kv_of(seq)
    if codec == "none":
        return kv
    layout = parse_config(config("unused", codec)).layout
    L, _, T, H, D = kv.shape
    blocks = kv.reshape(L, 2, T // BT, BT, H, D).permute(2, 0, 1, 3, 4, 5).contiguous()
    quant = QuantCodec(QuantSpec(codec), layout)
    return quant.decode(quant.encode(blocks)).permute(1, 2, 0, 3, 4, 5).reshape(kv.shape)


def run_writer_until_killed(
    disk_dir: Path, first: int, rng: random.Random, codec: str
) -> tuple[list[int], int]:
    """Start the writer, kill it after a random delay; its acknowledged sequences, and the
    highest sequence it may have started."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WRITER.parent), *sys.path]))
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(disk_dir), str(first), codec],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    acks: list[int] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ready"):
                ready.set()
            elif line.startswith("ack "):
                acks.append(int(line.split()[1]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if rng.random() < 0.15:  # sometimes kill it while it starts or recovers
        time.sleep(rng.uniform(0.0, 1.5))
    else:
        assert ready.wait(60), "the writer never became ready"
        time.sleep(rng.uniform(0.05, 0.8))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    reader.join(30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    started = (acks[-1] + 1) if acks else first
    return acks, started


def verify(
    disk_dir: Path, acked: set[int], fresh: range, rng: random.Random, codec: str
) -> dict[str, float]:
    """Every acknowledged sequence is found whole; the sequences of the last run (acknowledged
    or not) and a sample of older ones load bit-exact or not at all, block by block."""
    store = KVStore(parse_config(config(str(disk_dir), codec)))
    try:
        store.check()
        for seq in sorted(acked):
            assert store.lookup(tokens_of(seq)).num_tokens == len(tokens_of(seq)), (
                f"acknowledged sequence {seq} was not recovered"
            )
        older = sorted(acked - set(fresh))
        for seq in [*fresh, *rng.sample(older, min(40, len(older)))]:
            tokens = tokens_of(seq)
            loaded = store.load(tokens)
            want = stored_kv(seq, codec)
            if seq in acked:
                assert loaded.num_tokens == len(tokens), f"acknowledged sequence {seq} lost"
            n = loaded.num_tokens
            assert n % BT == 0
            assert torch.equal(loaded.kv.view(torch.int16), want[:, :, :n].view(torch.int16)), (
                f"sequence {seq}: served bytes differ from what was stored"
            )
        store.check()
        return store.recovery
    finally:
        store.close()


@pytest.mark.parametrize(
    ("codec", "kills"),
    [
        # all in `-m slow` (the default suite's 10 minutes: the short schedule took 8 s)
        pytest.param("none", 3, marks=pytest.mark.slow),
        pytest.param("none", KILLS, marks=pytest.mark.slow),
        pytest.param("int4", 8, marks=pytest.mark.slow),
    ],
)
def test_sigkilled_writer_loses_no_acknowledged_block_and_serves_no_torn_one(
    tmp_path: Path, codec: str, kills: int
) -> None:
    rng = random.Random(20261130)
    disk_dir = tmp_path / "disk"
    acked: set[int] = set()
    started = 0
    done = 0
    recovered_max = 0.0
    while done < kills:
        first = started
        acks, last = run_writer_until_killed(disk_dir, first, rng, codec)
        done += 1
        acked.update(acks)
        started = max(started, last)
        recovery = verify(disk_dir, acked, range(first, started + 1), rng, codec)
        recovered_max = max(recovered_max, recovery["recovered"])
        started += 1  # the next writer starts past anything a killed one may have begun
    assert done == kills
    assert len(acked) > 2.5 * kills, f"only {len(acked)} sequences acknowledged in {kills} runs"
    assert recovered_max >= len(acked)
