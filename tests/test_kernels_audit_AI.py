"""Audit AI: hostile callers of the kernels' wrappers, hostile GGUF files and text for the
reference model, and a reference prefill whose lease ends under it.

Each test failed before its fix: a caller's bad argument to `PagedAttention` (no query head, a
softmax scale that is not a number, lengths that are strings, too few or past int64, a k_new
that is not a tensor) or to a block copy (fewer destination slots than sources, a float slot)
failed untyped inside torch or Triton, or silently (a NaN scale, a slot 1.5 read as slot 1); a
GGUF file that is truncated, names another shape or a zero head count, or holds non-UTF-8
metadata raised whatever numpy or gguf raised; a lone surrogate in text was a `TypeError` and an
id outside the vocabulary decoded to nothing; an engine whose lease expired during its prefill
failed the request instead of computing it cold.

Tiny shapes throughout: a random 2-layer Llama and synthetic GGUF files written here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_store, kv_for

from kvtier.config import parse_config
from kvtier.errors import InvalidArgumentError, InvalidTokensError
from kvtier.kernels.attention import PagedAttention
from kvtier.kernels.block_copy import copy_blocks_gather, copy_blocks_slices
from kvtier.results import Lease
from kvtier.store import KVStore

# ---- PagedAttention: arguments --------------------------------------------------------------


Leased = tuple[KVStore, Lease]


@pytest.fixture
def leased() -> Iterator[Leased]:
    """A tiny store (2 kv heads, head_dim 4, 4 tokens a block) with 12 tokens leased."""
    store = build_store(gpu_blocks=8, background=False)
    tokens = list(range(1, 13))
    store.store(tokens, kv_for(store, 12))
    lease = store.prefetch(tokens)
    yield store, lease
    store.release(lease)
    store.close()


def test_a_query_with_no_head_is_refused_typed(leased: Leased) -> None:
    store, lease = leased
    attn = PagedAttention(store)
    with pytest.raises(InvalidArgumentError, match=r"q: got .* shape \(1, 0, 4\)"):
        attn.decode(torch.zeros(1, 0, 4), 0, [lease])  # was math.log2(0): ValueError


@pytest.mark.parametrize(
    "scale", ["x", float("nan"), float("inf"), 0.0, -1.0, True, pytest.param(10**400, id="10**400")]
)
def test_a_scale_that_is_not_a_finite_positive_number_is_refused(
    leased: Leased, scale: object
) -> None:
    store, lease = leased
    attn = PagedAttention(store)
    q = torch.randn(1, 4, 4)
    with pytest.raises(InvalidArgumentError, match="scale: got"):
        attn.decode(q, 0, [lease], scale=scale)  # type: ignore[arg-type]
    k = torch.randn(1, 2, 4)
    with pytest.raises(InvalidArgumentError, match="scale: got"):
        attn.extend(q, k, k.clone(), 0, [lease], [1], scale=scale)  # type: ignore[arg-type]
    assert attn.decode(q, 0, [lease], scale=0.5).isfinite().all()  # a real one still runs


@pytest.mark.parametrize(
    ("seq_lens", "message"),
    [
        (["a"], "seq_lens: got"),
        ([], "seq_lens: got"),
        ([2**40], "seq_lens: got"),
        ([2**70], "seq_lens: got"),
        ([True], "seq_lens: got"),
    ],
)
def test_decode_lengths_of_a_caller_are_checked_typed(
    leased: Leased, seq_lens: list[object], message: str
) -> None:
    store, lease = leased
    with pytest.raises(InvalidArgumentError, match=message):
        PagedAttention(store).decode(torch.randn(1, 4, 4), 0, [lease], seq_lens)  # type: ignore[arg-type]


def test_decode_table_and_extend_lengths_and_tensors_are_checked_typed(
    leased: Leased,
) -> None:
    store, lease = leased
    attn = PagedAttention(store)
    table = torch.tensor([list(lease.block_table)])
    with pytest.raises(InvalidArgumentError, match="seq_lens: got 'ab'"):
        attn.decode_table(torch.randn(1, 4, 4), 0, table, "ab")  # type: ignore[arg-type]
    q, k = torch.randn(3, 4, 4), torch.randn(3, 2, 4)
    with pytest.raises(InvalidArgumentError, match="new_lens: got"):
        attn.extend(q, k, k, 0, [lease], ["3"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="k_new: got \\[1\\]"):
        attn.extend(q, [1], k, 0, [lease], [3])  # type: ignore[arg-type]
    assert attn.extend(q, k, k, 0, [lease], [3]).shape == (3, 4, 4)


# ---- block copy: slots ----------------------------------------------------------------------


@pytest.mark.parametrize("copy", [copy_blocks_gather, copy_blocks_slices])
def test_a_block_copy_with_unequal_slot_counts_is_refused_and_copies_nothing(copy: object) -> None:
    src = torch.arange(100 * 2, dtype=torch.float32).view(100, 2)
    dst = torch.zeros(100, 2)
    for sources, destinations in (([0, 1], [0]), (list(range(70)), list(range(69)))):
        with pytest.raises(InvalidArgumentError, match="destination slot per block"):
            copy(src, dst, sources, destinations)  # type: ignore[operator]
    assert not dst.any()


def test_a_float_or_bool_slot_is_refused_not_truncated() -> None:
    src = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    dst = torch.zeros(4, 3)
    for bad in (1.5, True):
        with pytest.raises(InvalidArgumentError, match=f"source slot {bad}"):
            copy_blocks_gather(src, dst, [bad], [0])  # type: ignore[list-item]
    assert not dst.any()  # 1.5 was index 1: slot 1 copied
    copy_blocks_gather(src, dst, [np.int64(4)], [0])  # type: ignore[list-item]  # NumPy ints stay slots
    assert torch.equal(dst[0], src[4])


def test_numpy_and_torch_integer_slots_are_slots_and_duplicates_among_them_are_found() -> None:
    """Review 1: torch integers were refused as 'out of range' (they were slots before), and a
    destination named twice as two 0-d tensors (hashed by identity) passed the check."""
    src = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    dst = torch.zeros(4, 3)
    slots: Any = [np.int32(0), torch.tensor(2)]  # (integers of other kinds)
    copy_blocks_gather(src, dst, torch.tensor([4, 1]), slots)  # type: ignore[arg-type]
    assert torch.equal(dst[0], src[4]) and torch.equal(dst[2], src[1])
    with pytest.raises(InvalidArgumentError, match="destination slot 3 is named twice"):
        copy_blocks_gather(src, dst, [0, 1], [torch.tensor(3), torch.tensor(3)])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match=r"source slot 1\.5 is not an integer"):
        copy_blocks_gather(src, dst, [1.5], [0])  # type: ignore[list-item]


def test_a_numpy_or_tensor_scale_is_a_scale(leased: Leased) -> None:
    """Review 1: a NumPy float or a 0-d tensor scale worked before the check and was refused."""
    store, lease = leased
    attn = PagedAttention(store)
    q = torch.randn(1, 4, 4)
    plain = attn.decode(q, 0, [lease], scale=0.5)
    for scale in (np.float32(0.5), torch.tensor(0.5)):
        assert torch.equal(attn.decode(q, 0, [lease], scale=scale), plain)  # type: ignore[arg-type]


# ---- the reference model: GGUF files and text -----------------------------------------------

gguf = pytest.importorskip("gguf", reason="the reference loader needs the gguf package")

from tiny_gguf import tiny_gguf  # noqa: E402

from kvtier.reference.gguf_loader import load_llama  # noqa: E402  (after the skip)
from kvtier.reference.llama import LayerWeights, Llama, LlamaConfig  # noqa: E402


def test_a_sound_tiny_gguf_loads(tmp_path: Path) -> None:
    model = load_llama(tiny_gguf(tmp_path / "ok.gguf"), "tiny")
    assert model.forward(torch.tensor([1, 2, 3]))[0].shape == (3, 5)


def test_a_truncated_gguf_is_a_typed_error_naming_the_file(tmp_path: Path) -> None:
    whole = tiny_gguf(tmp_path / "ok.gguf").read_bytes()
    for cut in (0, 3, 24, len(whole) // 2, len(whole) - 7):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(InvalidArgumentError, match=f"GGUF file .*cut{cut}.gguf"):
            load_llama(path, "tiny")


def test_hostile_gguf_metadata_and_shapes_are_typed_errors(tmp_path: Path) -> None:
    cases = {
        "shape.gguf": ({"shapes": {"blk.0.attn_q.weight": (3, 8)}}, "has shape \\(3, 8\\)"),
        "embed.gguf": ({"shapes": {"token_embd.weight": (4, 8)}}, "token_embd.weight"),
        "heads.gguf": ({"heads": 3}, "GGUF heads: embedding_length 8, head_count 3"),
        "arch.gguf": ({"arch": "qwen2"}, "architecture: got 'qwen2'"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(InvalidArgumentError, match=message):
            load_llama(tiny_gguf(tmp_path / name, **change), "tiny")  # type: ignore[arg-type]


def test_non_utf8_metadata_is_a_typed_error(tmp_path: Path) -> None:
    data = tiny_gguf(tmp_path / "ok.gguf").read_bytes()
    at = data.index(b"llama", data.index(b"general.architecture"))
    path = tmp_path / "bytes.gguf"
    path.write_bytes(data[:at] + b"\xff\xfe\xfd\xfc\xfb" + data[at + 5 :])
    with pytest.raises(InvalidArgumentError, match=r"general\.architecture"):
        load_llama(path, "tiny")


def test_the_tokenizer_refuses_lone_surrogates_and_unknown_ids_typed() -> None:
    pytest.importorskip("tokenizers", reason="the tokenizer needs the tokenizers package")
    from kvtier.reference.tokenizer import BPETokenizer

    byte_chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # byte-level's printable ASCII
    tokenizer = BPETokenizer(byte_chars, [], [], "system")
    assert tokenizer.decode(tokenizer.encode("abc")) == "abc"
    with pytest.raises(InvalidArgumentError, match="text\\[1\\]: got '\\\\ud800'"):
        tokenizer.encode("a\ud800b")
    for bad in (len(byte_chars), -1, 2**64):
        with pytest.raises(InvalidTokensError, match=f"got {bad}, expected an id in"):
            tokenizer.decode([0, bad])
    # a model's argmax, NumPy ids, a str subclass: as before the checks (review 1)
    ids = tokenizer.encode("abc")
    for same in (np.array(ids), [np.int64(i) for i in ids], torch.tensor(ids)):
        assert tokenizer.decode(same) == "abc"  # type: ignore[arg-type]
    assert tokenizer.encode(np.str_("abc")) == ids
    wrong: Any
    for wrong in (1.0, True, torch.tensor(True)):
        with pytest.raises(InvalidTokensError, match="ids\\[0\\]"):
            tokenizer.decode([wrong])


# ---- the reference engine: a lease that ends during the prefill -----------------------------


def tiny_llama() -> Llama:
    """Random weights of the tiny store layout's geometry: 2 layers, 1 KV head of 4, 2 heads."""
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.3

    config = LlamaConfig("tiny", 2, 8, 16, 2, 1, 4, 50, 10000.0, 1e-5, eos_token_id=49)
    layers = [
        LayerWeights(w(8), w(8, 8), w(4, 8), w(4, 8), w(8, 8), w(8), w(16, 8), w(16, 8), w(8, 16))
        for _ in range(2)
    ]
    return Llama(config, w(50, 8), layers, w(8), w(50, 8))


class SlowLlama(Llama):
    """`model`, whose prefill over cached pages takes 10 s of the store's clock (`now`) before
    its first layer: past the lease's ttl of 5 s."""

    def __init__(self, model: Llama, now: list[float]) -> None:
        super().__init__(model.config, model.embed, model.layers, model.output_norm, model.output)
        self.now = now

    def step(self, tokens: torch.Tensor, start: int, attend: Any) -> Any:
        if start > 0:
            self.now[0] += 10.0
        return super().step(tokens, start, attend)


def test_a_prefill_whose_lease_expires_under_it_is_computed_cold() -> None:
    from kvtier.reference import generate
    from kvtier.reference.engine import Engine

    block = 2 * 2 * 4 * 1 * 4 * 4  # layers, K|V, tokens, kv heads, head_dim, fp32
    config = parse_config(
        {
            "model": {
                "name": "tiny",
                "num_layers": 2,
                "num_kv_heads": 1,
                "head_dim": 4,
                "dtype": "float32",
            },
            "block_tokens": 4,
            "tiers": {
                "gpu": {"capacity": 8 * block, "device": "cpu"},
                "host": {"capacity": 8 * block, "pinned": False},
            },
            "policy": {"write": "write_through", "lease_ttl_s": 5},
            "mover": {"background": False},
        }
    )
    now = [0.0]
    store = KVStore(config, clock=lambda: now[0])
    model = SlowLlama(tiny_llama(), now)
    try:
        engine = Engine(model, store)
        prompt = list(range(1, 14))
        engine.prefill(prompt[:9])  # 2 blocks cached
        run = engine.generate(prompt, 3)  # was LeaseError: the lease ended during the prefill
        assert run.prefill.hit.num_tokens == 8 and run.prefill.reused_tokens == 0
        assert run.tokens == generate(model, prompt, 3)
        store.check()
    finally:
        store.close()


def test_a_one_element_tensor_of_more_dimensions_is_no_slot_and_no_scale(leased: Leased) -> None:
    """`operator.index` and `float` take `torch.tensor([3])` and `torch.tensor([[0.5]])`: a
    slot list `[torch.tensor([3])]` copied slot 3, a `[0.5]` tensor was a scale; both are
    refused as a 0-d one is not."""
    src = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    dst = torch.zeros(4, 3)
    for bad in (torch.tensor([3]), torch.tensor([[3]])):
        with pytest.raises(InvalidArgumentError, match=r"source slot .* is not an integer"):
            copy_blocks_gather(src, dst, [bad], [0])  # type: ignore[list-item]
    assert not dst.any()
    store, lease = leased
    attn = PagedAttention(store)
    for scale in (torch.tensor([0.5]), np.array([0.5])):  # (as a 1-element list is no scale)
        with pytest.raises(InvalidArgumentError, match="scale: got"):
            attn.decode(torch.randn(1, 4, 4), 0, [lease], scale=scale)  # type: ignore[arg-type]


def test_slot_arrays_and_tensors_are_checked_whole_with_the_same_refusals() -> None:
    """A 1-D integer array or tensor of slots is checked in one pass (it was 4-15 us a slot):
    the same refusals name the first slot out of range and a destination named twice."""
    src = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    dst = torch.zeros(4, 3)
    kinds: list[Any] = [np.array, torch.tensor]  # (slot arrays: the check takes them too)
    for kind in kinds:
        with pytest.raises(InvalidArgumentError, match=r"source slot 5 is out of range"):
            copy_blocks_gather(src, dst, kind([0, 5, 7]), [0, 1, 2])
        with pytest.raises(InvalidArgumentError, match=r"destination slot -1 is out of range"):
            copy_blocks_gather(src, dst, [0, 1], kind([0, -1]))
        with pytest.raises(InvalidArgumentError, match="destination slot 2 is named twice"):
            copy_blocks_gather(src, dst, [0, 1, 3], kind([2, 0, 2]))
        assert not dst.any()
    small: Any = np.array([4, 1], dtype=np.uint8)
    copy_blocks_gather(src, dst, small, torch.tensor([3, 0]))  # type: ignore[arg-type]
    assert torch.equal(dst[3], src[4]) and torch.equal(dst[0], src[1])
    with pytest.raises(InvalidArgumentError, match="is not an integer"):
        copy_blocks_gather(src, dst, torch.tensor([1.0]), [2])  # type: ignore[arg-type]
