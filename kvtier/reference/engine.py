"""A reference engine: prefill and greedy decoding of the reference Llama, reusing cached
prefixes through kvtier (the embedded `KVStore` or the sidecar's `Client`).

    engine = Engine(load_smollm2(), store)
    out = engine.generate(prompt_ids, max_new_tokens=8)    # Generation: ids, logits, hit, ...

One request, in order:

    check the ids                  each in [0, vocab_size), before the cache is touched
    lookup(prompt[:-1])            how much is cached (and on which tier); none for one token
    prefetch -> lease              the cached prefix of P tokens on the gpu tier, locked
    step(prompt[P:], start=P)      per layer: the model's q/k/v of the new tokens; attention =
                                   paged extend over the leased pages + the new tokens, causal
    copy the prefix out, release   the lease is held only for the prefill's attention
    store(prompt, kv)              the prompt's new full blocks (cached ones are not rewritten)
    decode                         greedy, one token per step, on a local contiguous cache

Decoding keeps a local contiguous KV (the prefix copied out of its pages, then the prompt's
suffix and every generated token) and runs `Llama.forward` on it: what kvtier is for here is
the prefill, and a local cache keeps the decode steps independent of leases and their expiry.
The generated tokens' KV is not stored. A prompt with nothing cached is a plain
`Llama.forward`; a prefetch refused for lack of gpu room (`CapacityError`) is one as well, and
so is a prefill whose lease ended before it was done with the pages (its ttl passed: the pages
may hold another block by then, so what was computed over them is dropped, not served).

The cache must hold this model's KV: `Engine` compares the cache's layout with the model's
(model name, layers, KV heads, head_dim, and no tensor-parallel shard) and refuses another
with a `ConfigError` naming both; two geometries of the same block bytes, or another model's
name, are refused too. The cache's `block_tokens` and dtype are the engine's (it casts). A model
that is not a reference `Llama`, or a cache that is neither a `KVStore` nor a `Client`, is an
`InvalidArgumentError` naming it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.blocks import KVLayout, token_array
from kvtier.client import Client
from kvtier.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    InvalidTokensError,
    LeaseError,
    ResidencyError,
    shown,
)
from kvtier.reference.llama import Llama
from kvtier.reference.prefix import Cache, Prefix, open_prefix
from kvtier.results import LookupResult, StoreResult
from kvtier.store import KVStore


@dataclass(frozen=True)
class Prefill:
    """A prompt's prefill. `logits` `[len(prompt) - reused_tokens, vocab]` are those of the
    positions computed (the reused ones have none); `kv` `[L, 2, len(prompt), Hkv, D]` is the
    whole prompt's, in the model's dtype. `hit` is what `lookup` found (of `prompt[:-1]`; all
    zeros for a one-token prompt, which has nothing to reuse), `reused_tokens` what was attended
    over from cached pages, `stored` what `store` did; `seconds` is the wall time of the whole
    prefill, store included."""

    logits: torch.Tensor
    kv: torch.Tensor
    hit: LookupResult
    reused_tokens: int
    stored: StoreResult
    seconds: float


@dataclass(frozen=True)
class Generation:
    """Greedy continuation: `tokens` (without the end-of-sequence id, if it came) and
    `logits` `[steps, vocab]`, the last-position logits of each step, the prefill's first:
    row i chose `tokens[i]`; a row past `tokens` is the one that chose the end-of-sequence id
    (or, with `max_new_tokens` 0, the prefill's)."""

    prefill: Prefill
    tokens: list[int]
    logits: torch.Tensor


class Engine:
    """Runs `model` over prompts, reusing and filling `cache`. One request at a time; the
    cache may be shared with other engines (it is the store's job to keep them apart)."""

    def __init__(self, model: Llama, cache: Cache, *, tenant: str = "default") -> None:
        """`InvalidArgumentError` unless `model` is a reference `Llama` and `cache` a `KVStore`
        or a `Client`; `ConfigError` unless the cache holds this model's KV (module doc)."""
        if not isinstance(model, Llama):
            raise InvalidArgumentError(
                f"model: got {shown(model)} ({type(model).__name__}), expected a reference "
                "Llama (kvtier.reference: load_smollm2(), or a Llama of your own weights)"
            )
        if not isinstance(cache, (KVStore, Client)):
            raise InvalidArgumentError(
                f"cache: got {shown(cache)} ({type(cache).__name__}), expected a KVStore or a "
                "kvtier Client"
            )
        self.model = model
        self.cache = cache
        self.tenant = tenant
        served = served_layout(cache)
        self.layout = model.layout(served.block_tokens, served.dtype_name)
        ours = (self.layout.model_name, self.layout.num_layers, self.layout.num_kv_heads,
                self.layout.head_dim, 0, 1)  # fmt: skip
        theirs = (served.model_name, served.num_layers, served.num_kv_heads, served.head_dim,
                  served.tp_rank, served.tp_size)  # fmt: skip
        if ours != theirs:
            raise ConfigError(
                "model",
                f"{theirs} (name, layers, KV heads, head_dim, tp_rank, tp_size) in the cache",
                f"{ours}, the reference model's: another model's KV is never attended over",
            )

    def prefill(self, prompt: Sequence[int]) -> Prefill:
        """Compute the prompt, reusing its cached prefix, and store its new full blocks.

        `prompt` is one or more ids of the model's vocabulary: anything else (an empty prompt,
        a non-int, an id outside [0, vocab_size)) is refused before the cache is touched
        (`InvalidArgumentError` when empty, `InvalidTokensError` naming the id otherwise). A
        one-token prompt has no prefix to reuse: nothing is looked up, and it is computed cold."""
        if len(prompt) == 0:
            raise InvalidArgumentError("prompt: got no tokens, expected at least one")
        ids = torch.from_numpy(token_array(list(prompt)).astype(np.int64))
        vocab = self.model.config.vocab_size
        if int(ids.max()) >= vocab:
            at = int((ids >= vocab).nonzero()[0, 0])  # the first one
            raise InvalidTokensError(
                f"prompt[{at}]: got {int(ids[at])}, expected a token id of the model's "
                f"vocabulary, in [0, {vocab})"
            )
        started = time.perf_counter()
        reusable = list(prompt[:-1])  # the last token is always computed (it picks the next)
        if reusable:
            hit = self.cache.lookup(reusable, tenant=self.tenant)
        else:
            hit = LookupResult(0, 0, 0, 0)
        prefix = self._open(prompt) if hit.num_tokens else None
        computed = None if prefix is None else self._over_prefix(ids, prefix)
        if computed is None:
            logits, kv = self.model.forward(ids)
            reused = 0
        else:
            logits, kv, reused = computed
        stored = self.cache.store(list(prompt), kv.to(self.layout.dtype), tenant=self.tenant)
        return Prefill(logits, kv, hit, reused, stored, time.perf_counter() - started)

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> Generation:
        """`prefill`, then up to `max_new_tokens` greedy tokens, stopping before the model's
        end-of-sequence id."""
        if type(max_new_tokens) is not int or max_new_tokens < 0:
            raise InvalidArgumentError(
                f"max_new_tokens: got {shown(max_new_tokens)}, expected >= 0"
            )
        done = self.prefill(prompt)
        eos = self.model.config.eos_token_id
        tokens: list[int] = []
        rows = [done.logits[-1]]
        kv = done.kv
        while len(tokens) < max_new_tokens:
            next_id = int(rows[-1].argmax())
            if next_id == eos:
                break
            tokens.append(next_id)
            if len(tokens) < max_new_tokens:
                logits, kv = self.model.forward(torch.tensor([next_id], dtype=torch.int64), kv)
                rows.append(logits[-1])
        return Generation(done, tokens, torch.stack(rows))

    def _over_prefix(
        self, ids: torch.Tensor, prefix: Prefix
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Logits and KV of `ids` computed over `prefix`'s pages, and the tokens reused; None
        when its lease ended before the pages were done with (its ttl passed during a long
        prefill: `ResidencyError` from the guard, `LeaseError` from the release). Its slots may
        then hold another block, so nothing read from them is used: the caller computes cold."""
        reused = prefix.num_tokens
        try:
            try:
                logits, new_kv = self.model.step(ids[reused:], reused, prefix.attend)
                kv = torch.cat([prefix.kv().to(new_kv.dtype), new_kv], dim=2)
            finally:
                prefix.release()  # after the copy out: a release answered proves it held
        except (ResidencyError, LeaseError):
            return None
        return logits, kv, reused

    def _open(self, prompt: Sequence[int]) -> Prefix | None:
        try:
            return open_prefix(self.cache, prompt, tenant=self.tenant)
        except CapacityError:  # the gpu tier cannot lease it beside other leases: compute it
            return None


def served_layout(cache: Cache) -> KVLayout:
    """The layout of the KV `cache` holds: the store's own; the sidecar's (`Client.layout`,
    which names its model)."""
    return cache.layout if isinstance(cache, KVStore) else cache.layout()
