"""The reference engine refuses a cache that holds another model's KV (audit K, item 5): the
cache's layout is compared whole (model name, layers, KV heads, head_dim, tensor-parallel
shard), not only its block size in bytes, so a store of another geometry with the same block
bytes, or of another model's name, is a `ConfigError` naming the mismatch, embedded or through
the sidecar; the model's own layout still runs and reuses its prefix. The keyed API's scope
is any string (SGLang's backend puts the model name and every rank in it).

A tiny Llama of random weights (the layout of `service_server`'s "tiny" model) stands in for
SmolLM2: the checks read the layout only, and a run over it takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from service_server import BT, DIM, HEADS, LAYERS, running, write_config

from kvtier.client import Client
from kvtier.config import parse_config
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.keyed import KeyedPages
from kvtier.reference.engine import Engine
from kvtier.reference.llama import LayerWeights, Llama, LlamaConfig
from kvtier.store import KVStore


def tiny_llama(name: str = "tiny", heads: int = HEADS, dim: int = DIM) -> Llama:
    """A Llama of random weights whose KV is `LAYERS` x `heads` x `dim` (fp32)."""
    gen = torch.Generator().manual_seed(7)
    hidden, vocab, ffn = 2 * heads * dim, 64, 32

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.05

    config = LlamaConfig(name=name, num_layers=LAYERS, hidden_size=hidden, ffn_size=ffn,
                         num_heads=2 * heads, num_kv_heads=heads, head_dim=dim,
                         vocab_size=vocab, rope_base=10000.0, rms_eps=1e-5,
                         eos_token_id=vocab + 1)  # fmt: skip
    kv = heads * dim  # norms (1-D) are ones; linear weights [out, in] small and random
    shapes = [(hidden,), (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
              (hidden,), (ffn, hidden), (ffn, hidden), (hidden, ffn)]  # fmt: skip
    layers = [
        LayerWeights(*(w(*s) if len(s) == 2 else torch.ones(s) for s in shapes))
        for _ in range(LAYERS)
    ]
    return Llama(config, w(vocab, hidden), layers, torch.ones(hidden), w(vocab, hidden))


def store_config(**model: Any) -> Any:
    layout = {"name": "tiny", "num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM,
              "dtype": "float16", **model}  # fmt: skip
    return parse_config({
        "model": layout, "block_tokens": BT,
        "tiers": {"gpu": {"capacity": "1MiB", "device": "cpu"},
                  "host": {"capacity": "1MiB", "pinned": False}},
        "policy": {"write": "write_through"}, "mover": {"background": False},
    })  # fmt: skip


@pytest.mark.parametrize(
    "model, field",
    [
        ({"num_kv_heads": 2 * HEADS, "head_dim": DIM // 2}, "KV heads"),  # same block bytes
        ({"num_layers": 2 * LAYERS, "head_dim": DIM // 2}, "layers"),  # same block bytes
        ({"name": "another-model"}, "another-model"),  # same geometry, other weights
    ],
)
def test_a_store_of_another_layout_of_the_same_block_bytes_is_refused(
    model: dict[str, Any], field: str
) -> None:
    with KVStore(store_config(**model)) as store:
        assert store.layout.block_bytes == store_config().layout.block_bytes
        with pytest.raises(ConfigError, match="'model'") as caught:
            Engine(tiny_llama(), store)
        assert field in str(caught.value) and "tiny" in str(caught.value)


@pytest.mark.slow  # run by `.ci/run` (`pytest -m slow`), out of the default suite (10 min)
def test_a_model_of_another_geometry_or_name_is_refused_by_the_sidecar_layout(
    tmp_path: Path,
) -> None:
    with running(write_config(tmp_path)) as server, Client(server.url) as client:
        Engine(tiny_llama(), client)  # the sidecar's own model: accepted
        for model in (tiny_llama("other-weights"), tiny_llama(heads=2 * HEADS, dim=DIM // 2)):
            with pytest.raises(ConfigError, match=r"'model'.*'tiny'"):
                Engine(model, client)


def test_the_models_own_layout_runs_and_reuses_its_prefix() -> None:
    model = tiny_llama()
    prompt = list(range(3, 3 + 4 * BT + 1))
    with KVStore(store_config()) as store:
        first = Engine(model, store).generate(prompt, 2)
        again = Engine(model, store).generate(prompt, 2)
    assert first.prefill.reused_tokens == 0 and again.prefill.reused_tokens == 4 * BT
    assert again.tokens == first.tokens


def test_a_scope_may_be_longer_than_blake2b_person_and_scopes_keep_apart() -> None:
    key = "ab" * 32
    long = 'model="org/a-long-model-name" tp1/2 pp0/2'
    assert KeyedPages(8, long).page(key) == KeyedPages(8, long).page(key)
    assert KeyedPages(8, long).page(key) != KeyedPages(8, long.replace("tp1", "tp0")).page(key)
    assert KeyedPages(8, "x" * 17).page(key) != KeyedPages(8, "x" * 16).page(key)
    with pytest.raises(InvalidArgumentError, match="scope"):
        KeyedPages(8, b"tp0/1")  # type: ignore[arg-type]
