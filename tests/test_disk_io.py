"""Disk I/O layer: aligned buffers, O_DIRECT probe, slab files on real files, the I/O pool."""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from conftest import mounted_tmpfs

from kvtier.errors import ClosedError, StorageError
from kvtier.tiers.disk.io import ALIGN, SlabFile, align_up, aligned_buffer, probe_direct
from kvtier.tiers.disk.io_pool import IOPool

MIB = 1 << 20


def address(buf: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def filled(nbytes: int, seed: int) -> memoryview:
    """An aligned buffer of `nbytes` whose bytes are `(seed + i) % 251`."""
    buf = aligned_buffer(nbytes)
    buf[:] = bytes((seed + i) % 251 for i in range(nbytes))
    return buf


@pytest.fixture
def direct_ok(tmp_path: Path) -> None:
    if not probe_direct(tmp_path):
        pytest.skip(reason=f"the filesystem of {tmp_path} refuses O_DIRECT")


def test_align_up() -> None:
    assert [align_up(n) for n in (1, 4095, 4096, 4097, 8192)] == [4096] * 3 + [8192] * 2


@pytest.mark.parametrize("nbytes", [1, 4096, 5000, 2 * MIB + 1])
def test_aligned_buffer_is_aligned_zeroed_and_rounded_up(nbytes: int) -> None:
    buf = aligned_buffer(nbytes)
    assert address(buf) % ALIGN == 0
    assert len(buf) == align_up(nbytes)
    assert not buf.readonly
    assert buf.tobytes() == bytes(len(buf))


def test_probe_direct_is_true_on_tmp_path_and_leaves_nothing(tmp_path: Path) -> None:
    if not probe_direct(tmp_path):
        pytest.skip(reason=f"the filesystem of {tmp_path} refuses O_DIRECT")
    assert list(tmp_path.iterdir()) == []


def test_probe_direct_is_false_for_a_missing_directory(tmp_path: Path) -> None:
    assert probe_direct(tmp_path / "absent") is False


@pytest.mark.parametrize("direct", [True, False])
def test_create_allocates_every_block_with_mode_0600(
    tmp_path: Path, direct: bool, request: pytest.FixtureRequest
) -> None:
    if direct:
        request.getfixturevalue("direct_ok")
    path = tmp_path / "slab-0"
    with SlabFile(path, 8 * MIB, direct=direct, create=True) as slab:
        assert (slab.size, slab.direct, slab.path) == (8 * MIB, direct, path)
    st = os.stat(path)
    assert st.st_size == 8 * MIB
    assert st.st_blocks * 512 >= 8 * MIB
    assert stat.S_IMODE(st.st_mode) == 0o600


def test_create_refuses_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "slab-0"
    SlabFile(path, 4 * ALIGN, direct=False, create=True).close()
    with pytest.raises(FileExistsError):
        SlabFile(path, 4 * ALIGN, direct=False, create=True)
    assert os.stat(path).st_size == 4 * ALIGN


def test_open_without_create_keeps_the_size_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "slab-0"
    SlabFile(path, 3 * ALIGN, direct=False, create=True).close()
    with SlabFile(path, 99, direct=False, create=False) as slab:
        assert slab.size == 3 * ALIGN
    with pytest.raises(FileNotFoundError):
        SlabFile(tmp_path / "absent", ALIGN, direct=False, create=False)


@pytest.mark.parametrize("direct", [True, False])
def test_several_buffers_round_trip_at_nonzero_offsets(
    tmp_path: Path, direct: bool, request: pytest.FixtureRequest
) -> None:
    if direct:
        request.getfixturevalue("direct_ok")
    header, payload = filled(ALIGN, seed=1), filled(3 * ALIGN, seed=2)
    path = tmp_path / "slab-0"
    with SlabFile(path, 16 * ALIGN, direct=direct, create=True) as slab:
        slab.write(4 * ALIGN, [header, payload])
        slab.write(12 * ALIGN, [payload, header])
        slab.sync()
        back = aligned_buffer(4 * ALIGN)
        assert slab.read_into(4 * ALIGN, back) == 4 * ALIGN
        assert back.tobytes() == header.tobytes() + payload.tobytes()
        assert slab.read_into(12 * ALIGN, back) == 4 * ALIGN
        assert back.tobytes() == payload.tobytes() + header.tobytes()
        # Untouched slots read back as the zeros that fallocate guarantees.
        assert slab.read_into(0, back) == 4 * ALIGN
        assert back.tobytes() == bytes(4 * ALIGN)
    with SlabFile(path, 0, direct=direct, create=False) as again:
        single = aligned_buffer(ALIGN)
        assert again.read_into(5 * ALIGN, single) == ALIGN
        assert single.tobytes() == payload[:ALIGN].tobytes()


def test_buffered_slab_takes_unaligned_bytes_and_reads_short_at_the_end(tmp_path: Path) -> None:
    with SlabFile(tmp_path / "slab-0", 100, direct=False, create=True) as slab:
        slab.write(7, [b"abc", memoryview(b"defg")])
        out = memoryview(bytearray(10))
        assert slab.read_into(5, out) == 10
        assert out.tobytes() == b"\0\0abcdefg\0"
        tail = memoryview(bytearray(10))
        assert slab.read_into(95, tail) == 5
        assert tail.tobytes() == bytes(10)


def test_direct_slab_refuses_unaligned_io(tmp_path: Path, direct_ok: None) -> None:
    # a typed OSError that fails that I/O alone (test_disk_audit2.py), never an AssertionError
    with SlabFile(tmp_path / "slab-0", 4 * ALIGN, direct=True, create=True) as slab:
        with pytest.raises(StorageError, match="offset 512"):
            slab.write(512, [aligned_buffer(ALIGN)])
        with pytest.raises(StorageError, match=r"buffers \[4096, 100\]"):
            slab.write(0, [aligned_buffer(ALIGN), b"x" * 100])
        with pytest.raises(StorageError, match=r"buffers \[100\]"):
            slab.read_into(0, aligned_buffer(ALIGN)[:100])


def test_write_past_the_end_is_refused(tmp_path: Path) -> None:
    with (
        SlabFile(tmp_path / "slab-0", 2 * ALIGN, direct=False, create=True) as slab,
        pytest.raises(StorageError, match="outside"),
    ):
        slab.write(ALIGN, [bytes(ALIGN + 1)])


def test_close_is_idempotent_and_later_io_is_refused(tmp_path: Path) -> None:
    slab = SlabFile(tmp_path / "slab-0", ALIGN, direct=False, create=True)
    slab.close()
    slab.close()
    with pytest.raises(ClosedError):
        slab.write(0, [b"x"])
    with pytest.raises(ClosedError):
        slab.sync()


def test_pool_runs_n_jobs_at_once() -> None:
    n = 6
    barrier = threading.Barrier(n, timeout=10)

    def job(i: int) -> int:
        barrier.wait()  # raises BrokenBarrierError unless all n jobs are running together
        return i * i

    with IOPool(workers=n) as pool:
        assert pool.run([partial(job, i) for i in range(n)]) == [i * i for i in range(n)]


def test_pool_returns_os_errors_in_place_and_in_order(tmp_path: Path) -> None:
    def fail(code: int) -> int:
        raise OSError(code, os.strerror(code))

    jobs: list[Callable[[], int]] = [
        lambda: 0,
        partial(fail, errno.ENOSPC),
        lambda: 2,
        partial(fail, errno.EIO),
        lambda: 4,
    ]
    with IOPool(workers=2) as pool:
        results = pool.run(jobs)
        assert pool.run([]) == []
    assert [r if isinstance(r, int) else r.errno for r in results] == [
        0,
        errno.ENOSPC,
        2,
        errno.EIO,
        4,
    ]


class Occupied:
    """Every worker thread of a pool held by a job of its own call until `release()`."""

    def __init__(self, pool: IOPool) -> None:
        self.gate = threading.Event()
        self.results: list[list[object]] = []
        started = threading.Semaphore(0)

        def held() -> str:
            started.release()
            assert self.gate.wait(10), "the test never opened the gate"
            return "held"

        def call() -> None:
            self.results.append(pool.run([held, lambda: "own"]))

        self.threads = [threading.Thread(target=call) for _ in range(pool.workers)]
        for thread in self.threads:
            thread.start()
        for _ in self.threads:
            assert started.acquire(timeout=10), "a worker never took its job"

    def release(self) -> None:
        self.gate.set()
        for thread in self.threads:
            thread.join(10)
        assert self.results == [["held", "own"]] * len(self.threads)


def wait_for(pool: IOPool, waiting: tuple[int, int]) -> None:
    deadline = time.monotonic() + 10
    while pool.waiting() != waiting:
        assert time.monotonic() < deadline, f"queued: {pool.waiting()}, expected {waiting}"
        time.sleep(0.001)


def test_an_urgent_call_goes_ahead_of_plain_lanes_queued_before_it() -> None:
    """Reads are urgent (`IOPool`): with every worker busy, a plain call's lane queued first
    and an urgent call's lane queued second, the next free worker takes the urgent one; both
    calls still get every result, in job order."""
    order: list[str] = []

    def mark(name: str) -> str:
        order.append(name)
        return name

    results: dict[str, list[object]] = {}

    def call(name: str, urgent: bool) -> None:
        jobs = [partial(mark, name), partial(mark, name + "-own")]
        results[name] = pool.run(jobs, urgent=urgent)

    with IOPool(workers=2) as pool:
        occupied = Occupied(pool)
        plain = threading.Thread(target=call, args=("plain", False))
        plain.start()
        wait_for(pool, (0, 1))  # the plain lane queued first
        urgent = threading.Thread(target=call, args=("urgent", True))
        urgent.start()
        wait_for(pool, (1, 1))
        occupied.release()
        plain.join(10)
        urgent.join(10)
    assert order.index("urgent") < order.index("plain"), order
    assert results == {"plain": ["plain", "plain-own"], "urgent": ["urgent", "urgent-own"]}
    assert pool.waiting() == (0, 0)


def test_close_lets_queued_lanes_run_then_refuses_calls() -> None:
    pool = IOPool(workers=2)
    occupied = Occupied(pool)
    results: list[object] = []
    queued = threading.Thread(target=lambda: results.extend(pool.run([lambda: 2, lambda: 3])))
    queued.start()
    wait_for(pool, (0, 1))  # its lane waits for a busy worker
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(0.05)
    assert closer.is_alive(), "close() returned while lanes were still running"
    occupied.release()
    for thread in (closer, queued):
        thread.join(10)
    assert not closer.is_alive()
    assert results == [2, 3]  # the queued lane ran
    with pytest.raises(ClosedError):
        pool.run([lambda: 4])
    pool.close()  # twice is allowed


def test_a_pool_dropped_without_close_lets_its_workers_end() -> None:
    pool = IOPool(workers=3)
    assert pool.run([lambda: 0, lambda: 1, lambda: 2]) == [0, 1, 2]
    threads = list(pool._threads)
    assert len(threads) == 3 and all(t.is_alive() for t in threads)
    del pool
    gc.collect()
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads)


def test_pool_raises_other_errors_only_after_every_job_finished() -> None:
    finished: list[int] = []

    def slow(i: int) -> int:
        threading.Event().wait(0.2)
        finished.append(i)
        return i

    def bug() -> int:
        raise ValueError("our bug")

    jobs: list[Callable[[], int]] = [partial(slow, 0), bug, partial(slow, 2), partial(slow, 3)]
    with IOPool(workers=4) as pool:
        with pytest.raises(ValueError, match="our bug"):
            pool.run(jobs)
        assert sorted(finished) == [0, 2, 3]
    pool.close()
    with pytest.raises(ClosedError):
        pool.run([lambda: 1])


def test_pool_reads_and_writes_one_slab_in_parallel(tmp_path: Path) -> None:
    direct = probe_direct(tmp_path)
    chunks = [filled(4 * ALIGN, seed=i) for i in range(8)]
    with (
        SlabFile(tmp_path / "slab-0", 32 * ALIGN, direct=direct, create=True) as slab,
        IOPool(workers=4) as pool,
    ):
        writes: list[Callable[[], None]] = [
            partial(slab.write, i * 4 * ALIGN, [c]) for i, c in enumerate(chunks)
        ]
        assert pool.run(writes) == [None] * 8
        slab.sync()
        backs = [aligned_buffer(4 * ALIGN) for _ in chunks]
        sizes = pool.run([partial(slab.read_into, i * 4 * ALIGN, b) for i, b in enumerate(backs)])
    assert sizes == [4 * ALIGN] * 8
    assert [b.tobytes() for b in backs] == [c.tobytes() for c in chunks]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted on a fresh directory, unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "small", "1m") as mount_point:
        yield mount_point


def test_create_on_a_full_filesystem_raises_enospc_and_leaves_no_file(small_tmpfs: Path) -> None:
    path = small_tmpfs / "slab-0"
    with pytest.raises(OSError) as caught:
        SlabFile(path, 4 * MIB, direct=probe_direct(small_tmpfs), create=True)
    assert caught.value.errno == errno.ENOSPC
    assert not path.exists()


def in_a_child(work: Callable[[], None]) -> None:
    """Run `work` in a forked child and wait for it; the child's failure fails the test."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            work()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_forked_child_writes_a_staging_buffer_of_its_own() -> None:
    # a buffer inherited over fork is the child's copy: `kvtier replay --jobs` forks workers
    # whose I/O reuses the staging buffer of the thread that forked them
    buffer = aligned_buffer(ALIGN)
    buffer[:6] = b"parent"

    def scribble() -> None:
        buffer[:6] = b"child!"

    in_a_child(scribble)
    assert bytes(buffer[:6]) == b"parent"


class SlowSyncs:
    """`os.fdatasync` made slow (the real one runs, then `delay_s`), counting its calls and
    their start times; while `fail` is set, the calls that begin raise EIO after syncing."""

    def __init__(self, delay_s: float) -> None:
        self.real = os.fdatasync
        self.delay_s = delay_s
        self.starts: list[float] = []
        self.fail = False
        self.began = threading.Event()

    def __call__(self, fd: int) -> None:
        self.starts.append(time.monotonic())
        self.began.set()
        fail = self.fail
        self.real(fd)
        time.sleep(self.delay_s)
        if fail:
            raise OSError(errno.EIO, "injected writeback error")


def behind_a_running_sync(
    slab: SlabFile,
    syncs: SlowSyncs,
    callers: int,
    *,
    write: bool = False,
    began: Callable[[], None] | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> list[BaseException | None]:
    """One sync started; once its `fdatasync` runs (then `began()`), `callers` threads that
    each write slot k (with `write`) and sync, `meanwhile()` while they wait. What each caller
    raised, or None."""
    first = threading.Thread(target=slab.sync)
    first.start()
    assert syncs.began.wait(5)
    if began is not None:
        began()
    outcomes: list[BaseException | None] = [None] * callers

    def sync(k: int) -> None:
        if write:
            slab.write(k * ALIGN, [filled(ALIGN, seed=k)])
        try:
            slab.sync()
        except BaseException as exc:
            outcomes[k] = exc

    threads = [threading.Thread(target=sync, args=(k,)) for k in range(callers)]
    for thread in threads:
        thread.start()
    if meanwhile is not None:
        meanwhile()
    for thread in [first, *threads]:
        thread.join(10)
    return outcomes


def test_concurrent_syncs_share_a_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit: eight threads syncing at once cost two `fdatasync`s (the one running when
    they call, which may have missed their writes, and one for all of them), not eight."""
    syncs = SlowSyncs(delay_s=0.2)
    monkeypatch.setattr(os, "fdatasync", syncs)
    with SlabFile(tmp_path / "slab-0", 16 * ALIGN, direct=False, create=True) as slab:
        assert behind_a_running_sync(slab, syncs, 8, write=True) == [None] * 8
        assert len(syncs.starts) == 2, syncs.starts
        back = aligned_buffer(ALIGN)
        for k in range(8):
            slab.read_into(k * ALIGN, back)
            assert back.tobytes() == filled(ALIGN, seed=k).tobytes()


def test_a_sync_running_when_called_does_not_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that finds a sync running waits for one that begins after its call: the one
    running may have started before the caller's writes completed."""
    syncs = SlowSyncs(delay_s=0.3)
    monkeypatch.setattr(os, "fdatasync", syncs)
    with SlabFile(tmp_path / "slab-0", 16 * ALIGN, direct=False, create=True) as slab:
        first = threading.Thread(target=slab.sync)
        first.start()
        assert syncs.began.wait(5)
        called = time.monotonic()
        slab.sync()
        returned = time.monotonic()
        first.join(10)
        assert len(syncs.starts) == 2
        assert syncs.starts[1] >= called  # its own sync began after its call
        assert returned - syncs.starts[1] >= 0.3  # and it waited for that one to end


def test_a_failed_sync_fails_every_caller_it_covered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux reports a failed writeback to one `fdatasync`: every caller that sync covered gets
    the error, and a later sync that succeeds does not repeat it."""
    syncs = SlowSyncs(delay_s=0.2)
    monkeypatch.setattr(os, "fdatasync", syncs)

    def fail_from_now() -> None:  # the first sync (running) succeeds; the shared second fails
        syncs.fail = True

    with SlabFile(tmp_path / "slab-0", 16 * ALIGN, direct=False, create=True) as slab:
        outcomes = behind_a_running_sync(slab, syncs, 4, began=fail_from_now)
        assert len(syncs.starts) == 2
        assert all(isinstance(o, OSError) and o.errno == errno.EIO for o in outcomes), outcomes
        syncs.fail = False
        slab.sync()  # a new sync, and it succeeded
        assert len(syncs.starts) == 3


def test_callers_behind_a_sync_that_could_not_run_see_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file closed while callers wait for a shared sync: that sync cannot run, and none of
    the callers it was for may take their writes as durable."""
    syncs = SlowSyncs(delay_s=0.3)
    monkeypatch.setattr(os, "fdatasync", syncs)
    slab = SlabFile(tmp_path / "slab-0", 16 * ALIGN, direct=False, create=True)

    def close_while_they_wait() -> None:  # the first sync already has its descriptor
        time.sleep(0.05)
        slab.close()

    outcomes = behind_a_running_sync(slab, syncs, 3, meanwhile=close_while_they_wait)
    assert len(syncs.starts) == 1
    assert all(isinstance(o, ClosedError) for o in outcomes), outcomes
