"""Executors: copies land bit-exact, and a handle is done only after its copies completed.

Two real CPU pools of a 1 KiB-block layout; the slow path is a `ThreadExecutor` throttled to
4 KiB/s, so a transfer of two blocks takes half a second and can be watched in flight. The
`SteppedExecutor` copies only when stepped: its order is the test's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.blocks import KVLayout
from kvtier.errors import ClosedError, ConfigError, InvalidArgumentError
from kvtier.tiers import SlotPool
from kvtier.tiers.disk import BlockMeta, DiskTier
from kvtier.transfer import (
    CudaExecutor,
    Executor,
    InlineExecutor,
    ThreadExecutor,
    Transfer,
    TransferHandle,
)
from kvtier.transfer.stepped import SteppedExecutor

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
LAYOUT = KVLayout("t", 2, 2, 8, "float32", 4)  # 1 KiB blocks
SLOW = 4096.0  # bytes per second: one block takes 0.25 s
SENTINEL = -7.0
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (torch.cuda.is_available() is false)")


def pools(layout: KVLayout = LAYOUT, slots: int = 8) -> tuple[SlotPool, SlotPool]:
    """A `gpu` pool of random blocks and a `host` pool full of SENTINEL, every slot allocated."""
    gpu = SlotPool("gpu", layout, slots, CPU)
    host = SlotPool("host", layout, slots, CPU)
    gpu.allocate(slots)
    host.allocate(slots)
    gen = torch.Generator().manual_seed(0)
    gpu.buffer.copy_(torch.randn(gpu.buffer.shape, generator=gen).to(layout.dtype))
    host.buffer.fill_(SENTINEL)
    return gpu, host


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture
def slow() -> Iterator[ThreadExecutor]:
    executor = ThreadExecutor(throttle_bytes_per_s=SLOW)
    yield executor
    executor.close()


@pytest.fixture
def fast() -> Iterator[ThreadExecutor]:
    executor = ThreadExecutor()
    yield executor
    executor.close()


def test_every_executor_satisfies_the_protocol() -> None:
    executors: list[Executor] = [InlineExecutor(), ThreadExecutor(), SteppedExecutor()]
    for executor in executors:
        executor.close()


def test_thread_copies_land_bit_exact_scattered_and_contiguous(fast: ThreadExecutor) -> None:
    gpu, host = pools()
    scattered = fast.submit(Transfer(gpu, (5, 0, 3), host, (1, 6, 2)))
    contiguous = fast.submit(Transfer(gpu, (1, 2), host, (3, 4)))
    assert scattered.wait(5) and contiguous.wait(5)
    assert scattered.result() == [True] * 3 and contiguous.result() == [True] * 2
    for s, d in [(5, 1), (0, 6), (3, 2), (1, 3), (2, 4)]:
        assert same_bits(host.buffer[d], gpu.buffer[s])
    assert bool((host.buffer[[0, 5, 7]] == SENTINEL).all())  # untouched slots
    assert fast.bytes_moved == {("gpu", "host"): 5 * LAYOUT.block_bytes}


def test_throttled_handle_is_done_only_after_its_copy(slow: ThreadExecutor) -> None:
    gpu, host = pools()
    start = time.monotonic()
    handle = slow.submit(Transfer(gpu, (0, 1), host, (4, 5)))  # 2 KiB at 4 KiB/s: 0.5 s
    assert not handle.done()
    assert bool((host.buffer[4:6] == SENTINEL).all())  # nothing has landed yet
    with pytest.raises(RuntimeError, match=r"gpu->host of 2 blocks is still in flight"):
        handle.result()
    assert handle.wait(timeout=0.05) is False
    while True:  # whenever done() says True, the data is complete
        done = handle.done()
        snapshot = host.buffer[4:6].clone()
        if done:
            break
        time.sleep(0.01)
    assert same_bits(snapshot, gpu.buffer[0:2])
    assert time.monotonic() - start >= 0.45
    assert handle.wait(timeout=0) is True
    assert handle.result() == [True, True]


def test_wait_returns_false_on_timeout_then_true(slow: ThreadExecutor) -> None:
    gpu, host = pools()
    handle = slow.submit(Transfer(gpu, (0,), host, (0,)))  # 0.25 s
    assert handle.wait(timeout=0.01) is False
    assert handle.wait(timeout=5) is True
    assert same_bits(host.buffer[0], gpu.buffer[0])


@pytest.mark.parametrize("workers", [1, 3])
def test_transfers_of_one_path_complete_in_submission_order(workers: int) -> None:
    big = SlotPool("gpu", LAYOUT, 2048, CPU)
    host = SlotPool("host", LAYOUT, 2048, CPU)
    executor = ThreadExecutor(workers_per_path=workers)
    handles = []
    for i in range(12):  # 2 MiB copies, each followed by copies that fail at once
        if i % 4 == 0:
            transfer = Transfer(big, tuple(range(2048)), host, tuple(range(2048)))
        else:
            transfer = Transfer(big, (4096,), host, (0,))  # slot 4096 of 2048
        handles.append(executor.submit(transfer))
    assert all(h.wait(10) for h in handles)
    executor.close()
    assert executor.poll() == handles


def test_a_throttled_path_does_not_delay_another_path(slow: ThreadExecutor) -> None:
    gpu, host = pools()
    up = slow.submit(Transfer(host, (0, 1, 2, 3), gpu, (4, 5, 6, 7)))  # 4 KiB: 1 s
    down = slow.submit(Transfer(gpu, (0,), host, (4,)))  # 1 KiB: 0.25 s
    assert down.wait(timeout=0.8), "gpu->host waited behind host->gpu"
    assert not up.done()
    assert up.wait(timeout=5)
    assert slow.bytes_moved == {
        ("host", "gpu"): 4 * LAYOUT.block_bytes,
        ("gpu", "host"): LAYOUT.block_bytes,
    }


def test_await_handle_inside_asyncio_run_does_not_block_the_loop(slow: ThreadExecutor) -> None:
    gpu, host = pools()

    async def main() -> tuple[list[bool], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        handle = slow.submit(Transfer(gpu, (2,), host, (3,)))  # 0.25 s
        result = await handle
        task.cancel()
        return result, ticks

    result, ticks = asyncio.run(main())
    assert result == [True]
    assert ticks >= 5  # the loop ran other tasks while the copy (0.25 s) was in flight
    assert same_bits(host.buffer[3], gpu.buffer[2])


def test_poll_returns_each_completed_handle_exactly_once(fast: ThreadExecutor) -> None:
    gpu, host = pools()
    handles = [fast.submit(Transfer(gpu, (i,), host, (i,))) for i in range(3)]
    seen: list[TransferHandle] = []
    deadline = time.monotonic() + 5
    while len(seen) < 3 and time.monotonic() < deadline:
        for handle in fast.poll():
            assert handle.done()
            seen.append(handle)
    assert seen == handles
    assert fast.poll() == []


def test_done_callback_runs_once_from_the_worker_or_at_once_when_done(
    slow: ThreadExecutor,
) -> None:
    gpu, host = pools()
    calls: list[tuple[TransferHandle, str]] = []
    handle = slow.submit(Transfer(gpu, (0,), host, (0,)))
    handle.add_done_callback(lambda h: calls.append((h, threading.current_thread().name)))
    assert handle.wait(5)
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:  # callbacks run just after done
        time.sleep(0.005)
    assert calls == [(handle, "kvtier-gpu-host-0")]
    handle.add_done_callback(lambda h: calls.append((h, threading.current_thread().name)))
    assert calls[1] == (handle, threading.current_thread().name)
    time.sleep(0.05)
    assert len(calls) == 2


def test_a_failing_callback_is_raised_by_poll_and_the_worker_survives(
    slow: ThreadExecutor,
) -> None:
    gpu, host = pools()
    slow.submit(Transfer(gpu, (0,), host, (0,)))  # 0.25 s, ahead of the next on the path
    failing = slow.submit(Transfer(gpu, (1,), host, (1,)))
    failing.add_done_callback(lambda _: 1 / 0)
    assert failing.wait(5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            slow.poll()
        except ZeroDivisionError:
            break
        time.sleep(0.005)
    else:
        pytest.fail("the callback's ZeroDivisionError was not raised by poll()")
    after = slow.submit(Transfer(gpu, (2,), host, (2,)))
    assert after.wait(5) and after.result() == [True]


def test_close_waits_for_work_in_flight_then_submit_raises(slow: ThreadExecutor) -> None:
    gpu, host = pools()
    handle = slow.submit(Transfer(gpu, (0,), host, (0,)))  # 0.25 s
    slow.close()
    assert handle.done() and handle.result() == [True]
    with pytest.raises(ClosedError, match="closed"):
        slow.submit(Transfer(gpu, (1,), host, (1,)))
    slow.close()  # idempotent


def test_a_failing_copy_surfaces_from_result(fast: ThreadExecutor) -> None:
    gpu, host = pools()
    bad = fast.submit(Transfer(gpu, (99,), host, (0,)))  # slot 99 of 8
    assert bad.wait(5)
    with pytest.raises(
        InvalidArgumentError, match=r"source slots 99\.\.99 are out of range"
    ) as raised:
        bad.result()
    assert "in flight" not in str(raised.value)
    assert bool((host.buffer[0] == SENTINEL).all())
    good = fast.submit(Transfer(gpu, (1,), host, (1,)))
    assert good.wait(5) and good.result() == [True]


def test_thread_executor_refuses_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="workers_per_path: got 0"):
        ThreadExecutor(workers_per_path=0)
    with pytest.raises(InvalidArgumentError, match="throttle_bytes_per_s: got -1"):
        ThreadExecutor(throttle_bytes_per_s=-1)


def test_disk_round_trip_through_threads(tmp_path: Path, fast: ThreadExecutor) -> None:
    layout = KVLayout("tiny", 2, 2, 64, "float16", 4)  # 4 KiB blocks, as the disk tests use
    gen = torch.Generator().manual_seed(1)
    host = SlotPool("host", layout, 8, CPU)
    host.allocate(8)
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=gen).to(layout.dtype))
    disk = DiskTier(layout, tmp_path / "disk", 1 << 20)
    try:
        slots = tuple(disk.allocate(3))
        metas = tuple(
            BlockMeta(bytes([i]) * 16, b"\0" * 16, b"\1" * 16, "t", b"\0" * 16) for i in range(3)
        )
        down = fast.submit(Transfer(host, (0, 1, 2), disk, slots, metas))
        assert down.wait(10) and down.result() == [True] * 3
        up = fast.submit(Transfer(disk, slots, host, (5, 6, 7), metas))
        assert up.wait(10) and up.result() == [True] * 3
        assert torch.equal(host.buffer[5:8].view(torch.int16), host.buffer[0:3].view(torch.int16))
        wrong = metas[1:] + metas[:1]  # ids that the copies on disk do not carry
        mismatch = fast.submit(Transfer(disk, slots, host, (5, 6, 7), wrong))
        assert mismatch.wait(10) and mismatch.result() == [False] * 3
        assert fast.bytes_moved == {
            ("host", "disk"): 3 * layout.block_bytes,
            ("disk", "host"): 3 * layout.block_bytes,
        }
    finally:
        disk.close()


def test_inline_submit_is_done_at_once_and_polled_once() -> None:
    gpu, host = pools()
    inline = InlineExecutor()
    handle = inline.submit(Transfer(gpu, (0, 1), host, (2, 3)))
    assert handle.done() and handle.wait(0) and handle.result() == [True, True]
    assert same_bits(host.buffer[2:4], gpu.buffer[0:2])
    calls: list[TransferHandle] = []
    handle.add_done_callback(calls.append)
    assert calls == [handle]
    bad = inline.submit(Transfer(gpu, (99,), host, (0,)))
    with pytest.raises(InvalidArgumentError, match=r"source slots 99\.\.99 are out of range"):
        bad.result()
    assert inline.poll() == [handle, bad] and inline.poll() == []
    inline.close()
    with pytest.raises(ClosedError):
        inline.submit(Transfer(gpu, (0,), host, (0,)))
    assert inline.run(Transfer(gpu, (4,), host, (4,))) == [True]  # run is unchanged


def test_stepped_copies_nothing_until_stepped_then_runs_the_oldest_first() -> None:
    gpu, host = pools()
    stepped = SteppedExecutor()
    first, second, third = (stepped.submit(Transfer(gpu, (i,), host, (i,))) for i in range(3))
    assert stepped.queued() == 3 and stepped.poll() == []
    assert not any(h.done() for h in (first, second, third)) and first.wait(0.01) is False
    assert bool((host.buffer == SENTINEL).all())  # nothing has landed
    assert stepped.step() == 1
    assert first.done() and first.result() == [True] and not second.done()
    assert same_bits(host.buffer[0], gpu.buffer[0]) and bool((host.buffer[1:] == SENTINEL).all())
    assert stepped.queued() == 2 and stepped.poll() == [first]
    assert stepped.step(5) == 2  # the queue runs out after two
    assert stepped.queued() == 0 and stepped.poll() == [second, third] and stepped.poll() == []
    assert same_bits(host.buffer[:3], gpu.buffer[:3])
    assert stepped.step() == 0 and stepped.run_all() == 0  # nothing queued: nothing runs
    assert stepped.bytes_moved == {("gpu", "host"): 3 * LAYOUT.block_bytes}
    with pytest.raises(InvalidArgumentError, match="n: got -1"):
        stepped.step(-1)


def test_stepped_callbacks_run_on_the_stepping_thread_and_their_submits_queue_last() -> None:
    gpu, host = pools()
    stepped = SteppedExecutor()
    seen: list[tuple[str, int]] = []  # (thread, queued() inside the callback)
    later: list[TransferHandle] = []

    def then_submit(handle: TransferHandle) -> None:
        seen.append((threading.current_thread().name, stepped.queued()))
        later.append(stepped.submit(Transfer(gpu, (7,), host, (7,))))

    head = stepped.submit(Transfer(gpu, (0,), host, (0,)))
    head.add_done_callback(then_submit)
    queued = stepped.submit(Transfer(gpu, (1,), host, (1,)))
    assert stepped.step() == 1
    assert seen == [(threading.current_thread().name, 1)]  # `queued` was still waiting
    assert stepped.queued() == 2 and not queued.done() and not later[0].done()
    assert stepped.step() == 1 and queued.done() and not later[0].done()  # oldest first
    assert stepped.run_all() == 1 and later[0].result() == [True]
    assert stepped.poll() == [head, queued, later[0]]


def test_stepped_a_waiting_thread_wakes_when_another_steps() -> None:
    gpu, host = pools()
    stepped = SteppedExecutor()
    handle = stepped.submit(Transfer(gpu, (2,), host, (3,)))
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(handle.wait(10)))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and not woke  # pending until someone steps
    stepped.step()
    waiter.join(10)
    assert woke == [True] and same_bits(host.buffer[3], gpu.buffer[2])


def test_stepped_a_failing_copy_is_kept_and_a_failing_callback_stops_the_step() -> None:
    gpu, host = pools()
    stepped = SteppedExecutor()
    bad = stepped.submit(Transfer(gpu, (99,), host, (0,)))  # slot 99 of 8
    failing = stepped.submit(Transfer(gpu, (1,), host, (1,)))
    failing.add_done_callback(lambda _: 1 / 0)
    after = stepped.submit(Transfer(gpu, (2,), host, (2,)))
    assert stepped.step() == 1
    with pytest.raises(
        InvalidArgumentError, match=r"source slots 99\.\.99 are out of range"
    ) as raised:
        bad.result()
    assert "in flight" not in str(raised.value)
    assert bool((host.buffer[0] == SENTINEL).all())
    with pytest.raises(ZeroDivisionError):
        stepped.step(2)
    assert failing.result() == [True] and not after.done() and stepped.queued() == 1
    assert stepped.step() == 1 and after.result() == [True]


def test_stepped_close_completes_what_is_queued_then_submit_raises() -> None:
    gpu, host = pools()
    stepped = SteppedExecutor()
    refused: list[Exception] = []

    def submit_more(_: TransferHandle) -> None:
        try:
            stepped.submit(Transfer(gpu, (5,), host, (5,)))
        except ClosedError as exc:
            refused.append(exc)

    handles = [stepped.submit(Transfer(gpu, (i,), host, (i,))) for i in range(2)]
    handles[0].add_done_callback(submit_more)
    stepped.close()
    assert [h.result() for h in handles] == [[True], [True]] and stepped.queued() == 0
    assert same_bits(host.buffer[:2], gpu.buffer[:2])
    assert len(refused) == 1 and bool((host.buffer[5] == SENTINEL).all())
    with pytest.raises(ClosedError, match="closed"):
        stepped.submit(Transfer(gpu, (3,), host, (3,)))
    stepped.close()  # idempotent
    assert stepped.poll() == handles


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_executor_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'cuda'"):
        CudaExecutor()


# ---- CUDA ---------------------------------------------------------------------------------------


def cuda_pools(slots: int = 64) -> tuple[SlotPool, SlotPool]:
    layout = KVLayout("t", 4, 8, 128, "bfloat16", 16)  # 256 KiB blocks
    gpu = SlotPool("gpu", layout, slots, torch.device("cuda"))
    host = SlotPool("host", layout, slots, CPU, pin_memory=True)
    gpu.allocate(slots)
    host.allocate(slots)
    return gpu, host


@pytest.mark.gpu
@gpu_only
def test_cuda_round_trip_scattered_and_contiguous() -> None:
    gpu, host = cuda_pools()
    executor = CudaExecutor()
    source = torch.randint(-(2**15), 2**15, host.buffer.shape, dtype=torch.int16)
    host.buffer.view(torch.int16).copy_(source)
    gpu.buffer.zero_()
    up = executor.submit(Transfer(host, tuple(range(32)), gpu, tuple(range(32))))
    scattered = (40, 3, 63, 17)
    up2 = executor.submit(Transfer(host, scattered, gpu, (33, 35, 37, 39)))
    assert up.wait(10) and up2.wait(10)
    assert up.result() == [True] * 32 and up2.result() == [True] * 4
    back = executor.submit(Transfer(gpu, (33, 35, 37, 39), host, (0, 1, 2, 3)))
    assert back.wait(10) and back.result() == [True] * 4
    assert torch.equal(gpu.buffer[:32].view(torch.int16).cpu(), source[:32])
    assert torch.equal(host.buffer[:4].view(torch.int16), source[list(scattered)])
    assert set(executor.poll()) == {up, up2, back}
    executor.close()


@pytest.mark.gpu
@gpu_only
def test_cuda_copy_is_ordered_after_the_engine_stream() -> None:
    gpu, host = cuda_pools(4)
    executor = CudaExecutor()
    host.buffer.zero_()
    gpu.buffer.zero_()
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(100):  # long work on the current (engine) stream ...
        torch.matmul(x, x)
    source = gpu.buffer[0].view(256, 512)  # ... and last, a matmul that writes the source slot
    torch.matmul(x[:256], x[:, :512], out=source)
    handle = executor.submit(Transfer(gpu, (0,), host, (0,)))
    assert handle.wait(30) and handle.result() == [True]
    expected = source.cpu()  # ordered after the matmul on the current stream
    assert bool(expected.view(torch.int16).ne(0).any())
    assert torch.equal(host.buffer[0].view(256, 512).view(torch.int16), expected.view(torch.int16))
    executor.close()
