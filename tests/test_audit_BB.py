"""Audit BB: leases and prefetch, the engine contract's path to the pages a kernel reads
(`transfer/leasing.py`, `transfer/prefetch.py`, `kernels/attention.py`).

- A lease turned READY before the residency view learned its slots: `LeaseBook.settle`
  woke the lease's waiters (`lease.wait()`, `await lease`) first and added its block table to
  the view after, so an engine woken in between had `PagedAttention` refuse the pages of a
  READY lease with `ResidencyError` ("not covered by a live ready lease"): 1 launch in 2000
  with `sys.setswitchinterval(1e-6)` (`wait(); decode()` in a loop). The view learns the slots
  before the lease turns READY now.
- The engine-side page copies (`integrations/paged.py`) refused a host page size of 0, -4 or
  4.0, a host buffer whose first dimension is not (K, V), ids that are None or an int, a layer
  or a `kv` that is no tensor, with ZeroDivisionError, ValueError, TypeError, AttributeError,
  or not at all (a `[3, ...]` buffer was read as its first two); each is an `InvalidKVError`
  naming it now, before a byte moves.
- A random schedule of stores, prefetches (waited for or not), releases, cancels, evictions,
  persists, clears, resets and lease expiries, on tiny tiers, against a model: every page a
  live READY lease names holds exactly the bytes stored for its block, the residency view
  covers it, and `check()` holds after each step.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from conftest import build_store, disk_config, kv_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import results
from kvtier.blocks import KVLayout
from kvtier.errors import CapacityError, InvalidKVError, LeaseError, ResidencyError
from kvtier.integrations import paged
from kvtier.kernels.attention import PagedAttention
from kvtier.results import Lease, LeaseState
from kvtier.store import KVStore
from kvtier.transfer.stepped import SteppedExecutor


def test_a_waiter_woken_by_ready_finds_the_pages_resident() -> None:
    """The thread that settles a lease pauses as `resolve(READY)` returns (it used to add the
    slots to the residency view only after that); a waiter woken there launches at once."""
    resolve = results.LeaseOwner.resolve.__code__
    leased: list[Lease] = []
    seen: list[BaseException | None] = []
    launched = threading.Event()

    def on_call(frame: FrameType, event: str, arg: object) -> Any:
        return on_return if frame.f_code is resolve else None

    def on_return(frame: FrameType, event: str, arg: object) -> Any:
        owner: Any = frame.f_locals.get("self")
        if event == "return" and leased and owner.lease is leased[0] and leased[0].ready():
            launched.wait(2)  # the waiter launches while this thread is here
        return on_return

    plain = build_store(gpu_blocks=8, host_blocks=16, layer_groups=2)
    plain.close()  # its config, for a store whose copies wait for steps
    executor = SteppedExecutor()
    threading.settrace(on_call)  # the mover's thread, started by the store, settles leases
    try:
        store = KVStore(plain.config, executor=executor)
    finally:
        threading.settrace(_any(None))
    try:
        tokens = list(range(16))
        store.store(tokens, kv_for(store, 16))
        assert store.evict("gpu", 4) == 4  # on host only: a prefetch copies it up
        leased.append(store.prefetch(tokens, wait=False))

        def waiter() -> None:
            leased[0].wait(5)
            try:
                PagedAttention(store).decode(torch.randn(1, 2, 4), 0, leased)
                seen.append(None)
            except ResidencyError as exc:
                seen.append(exc)
            launched.set()

        woken = threading.Thread(target=waiter)
        woken.start()
        executor.run_all()  # the copies land; the mover's thread publishes and settles
        woken.join(5)
        assert seen == [None], f"a READY lease's pages were refused: {seen}"
        store.release(leased[0])
        store.check()
    finally:
        closer = threading.Thread(target=store.close)
        closer.start()
        while closer.is_alive():
            executor.run_all()
            closer.join(0.001)


def _any(value: object) -> Any:
    """`value` passed where the signature wants another type (a hostile caller's)."""
    return value


HOST_CALLS = [
    ("page size 0", lambda b: paged.host_gather(b, "page_first_direct", torch.arange(4), 0)),
    ("page size -4", lambda b: paged.host_gather(b, "page_first_direct", torch.arange(4), -4)),
    (
        "page size 4.0",
        lambda b: paged.host_gather(b, "page_first_direct", torch.arange(4), _any(4.0)),
    ),
    (
        "3 halves",
        lambda b: paged.host_gather(torch.cat([b, b[:1]]), "page_first_direct", torch.arange(4), 4),
    ),
    (
        "1 half",
        lambda b: paged.host_scatter(
            b[:1], "page_first_direct", torch.arange(4), 4, torch.zeros(2, 2, 4, 2, 8)
        ),
    ),
    (
        "not a tensor",
        lambda b: paged.host_gather(_any([b]), "page_first_direct", torch.arange(4), 4),
    ),
]


@pytest.mark.parametrize("call", [c for _, c in HOST_CALLS], ids=[n for n, _ in HOST_CALLS])
def test_hostile_host_pool_arguments_are_typed_and_write_nothing(call: Any) -> None:
    buffer = torch.randn(2, 2, 2, 4, 2, 8)  # page_first_direct: [2, pages, layers, 4, heads, dim]
    before = buffer.clone()
    with pytest.raises(InvalidKVError):
        call(buffer)
    assert torch.equal(buffer, before)


LAYER_CALLS = [
    ("ids None", lambda ls: paged.gather(ls, _any(None))),
    ("ids an int", lambda ls: paged.gather(ls, _any(3))),
    ("a layer no tensor", lambda ls: paged.gather([*ls, _any(1)], [0])),
    ("kv no tensor", lambda ls: paged.scatter(ls, [0], _any([0.0]))),
]


@pytest.mark.parametrize("call", [c for _, c in LAYER_CALLS], ids=[n for n, _ in LAYER_CALLS])
def test_hostile_paged_layer_arguments_are_typed_and_write_nothing(call: Any) -> None:
    layers = [torch.randn(4, 2, 3, 8) for _ in range(2)]
    before = [layer.clone() for layer in layers]
    with pytest.raises(InvalidKVError):
        call(layers)
    assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))


def test_a_stack_of_layers_is_layers() -> None:
    stacked = torch.randn(2, 4, 2, 3, 8)  # `not stacked` raised RuntimeError
    kv = paged.gather(_any(stacked), [1, 2])
    assert torch.equal(kv, paged.gather(list(stacked), [1, 2]))


# ---- a random schedule against a model ---------------------------------------------------------


def _block(layout: KVLayout, tenant: str, prefix: tuple[int, ...]) -> torch.Tensor:
    """The KV of the last block of `prefix`, a function of the tenant and the whole prefix."""
    digest = hashlib.blake2b(repr((tenant, prefix)).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    shape = (layout.num_layers, 2, layout.block_tokens, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=gen).to(layout.dtype)


def _kv(layout: KVLayout, tenant: str, tokens: list[int]) -> torch.Tensor:
    bt = layout.block_tokens
    whole = len(tokens) // bt
    parts = [_block(layout, tenant, tuple(tokens[: (i + 1) * bt])) for i in range(whole)]
    rest = len(tokens) - whole * bt
    shape = (layout.num_layers, 2, rest, layout.num_kv_heads, layout.head_dim)
    return torch.cat([*parts, torch.zeros(shape, dtype=layout.dtype)], dim=2)


OPS = ("store", "prefetch", "pending", "release", "cancel", "evict", "persist", "clear",
       "reset", "tick", "load")  # fmt: skip


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    block_tokens=st.sampled_from([1, 4, 8]),
    gpu=st.integers(2, 4),
    host=st.integers(2, 4),
    background=st.booleans(),
    write=st.sampled_from(["write_back", "write_through"]),
    schedule=st.lists(
        st.tuples(
            st.sampled_from(OPS),
            st.integers(0, 5),
            st.sampled_from(["default", "a"]),
            st.integers(0, 99),
        ),
        min_size=10,
        max_size=60,
    ),
)
def test_leased_pages_hold_their_blocks_under_a_random_schedule(
    tmp_path_factory: Any,
    block_tokens: int,
    gpu: int,
    host: int,
    background: bool,
    write: str,
    schedule: list[tuple[str, int, str, int]],
) -> None:
    path: Path = tmp_path_factory.mktemp("disk")
    config = disk_config(
        path,
        capacity=12 * 8192 * block_tokens // 4 + 4 * 8192,
        gpu_blocks=gpu,
        host_blocks=host,
        block_tokens=block_tokens,
        write=write,
        background=background,
        tenants=("default", "a"),
    )
    now = [0.0]
    store = KVStore(config, clock=lambda: now[0])
    layout = store.layout
    base = list(range(1000, 1000 + 6 * block_tokens))
    prompts = [base[: (i + 1) * block_tokens] + [i] * (i % 3) for i in range(3)]
    prompts += [base[:block_tokens] + list(range(2000, 2000 + 3 * block_tokens)), [7], base]
    leases: list[tuple[Lease, list[int], str]] = []
    try:
        for op, which, tenant, arg in schedule:
            tokens = prompts[which]
            try:
                if op == "store":
                    store.store(tokens, _kv(layout, tenant, tokens), tenant=tenant)
                elif op in ("prefetch", "pending"):
                    ttl = (1.0, 5.0, 60.0)[arg % 3]
                    lease = store.prefetch(tokens, tenant=tenant, ttl_s=ttl, wait=op == "prefetch")
                    leases.append((lease, tokens, tenant))
                elif op in ("release", "cancel") and leases:
                    lease = leases.pop(arg % len(leases))[0]
                    (store.release if op == "release" else store.cancel)(lease)
                elif op == "evict":
                    store.evict(("gpu", "host", "disk")[arg % 3], 1 + arg % 3)
                elif op == "persist":
                    store.persist()
                elif op == "clear":
                    store.clear()
                elif op == "reset":
                    store.reset(tenant)
                elif op == "tick":
                    now[0] += (0.5, 2.0, 10.0)[arg % 3]
                elif op == "load":
                    loaded = store.load(tokens, tenant=tenant)
                    want = _kv(layout, tenant, tokens)[:, :, : loaded.num_tokens]
                    assert torch.equal(loaded.kv, want)
            except (CapacityError, LeaseError):
                pass  # refused (no room now) or already ended (expired, released): both fine
            if background and arg % 2:
                assert store.drain(5)
            covered = store.leased_slots()
            for lease, leased, owner in leases:
                if lease.state is not LeaseState.READY or lease.expires_at <= now[0]:
                    continue
                assert set(lease.block_table) <= covered
                for i, slot in enumerate(lease.block_table):
                    want = _block(layout, owner, tuple(leased[: (i + 1) * block_tokens]))
                    assert torch.equal(store.gpu_pool.buffer[slot], want), (op, i, slot)
            store.check()
    finally:
        store.close()
    assert all(lease.state is not LeaseState.READY for lease, _, _ in leases)
