"""A plain-torch Llama decoder: exact, unbatched, for producing real KV on the CPU.

It is a reference, not an engine: one sequence, fp32 by default, attention written out as
matmul + softmax. What it is for is the KV it returns, in the shape kvtier stores:

    forward(tokens [T], past_kv [L, 2, P, Hkv, D] | None)
        -> logits [T, vocab], kv [L, 2, P+T, Hkv, D]          (2 = K | V; K after RoPE)

Token t of `tokens` sits at position P + t and attends to every cached position and to the new
positions up to its own (causal over past + new). The returned `kv` is the whole cache, past
included, so `forward(rest, kv_of_prefix)` gives the same logits and KV as a full prefill of
prefix + rest (up to fp32 rounding). `step(tokens, start, attend)` is the same pass with the
attention handed to the caller (paged attention over cached pages, `engine.py`).
Grouped-query attention repeats each KV head for the `num_heads // num_kv_heads` query heads
it serves (head j serves j*r .. j*r + r - 1, as in HF).

RoPE is HF's `rotate_half` form: dims (i, i + D/2) of a head are rotated together by angle
`pos * base**(-2i/D)`. Weights converted by llama.cpp have their Q/K rows permuted for its
interleaved form; `gguf_loader` undoes that, so the K here is laid out as HF's model lays it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.blocks import KVLayout

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`attend(layer, q, k, v) -> [T, H * D]`: one layer's attention for new tokens (`Llama.step`)."""


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of one Llama checkpoint; `name` becomes the KV layout's model name."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    eos_token_id: int


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block. Linear weights are `[out, in]`, as `x @ w.T` uses them."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class Llama:
    """A Llama decoder over given weights; stateless apart from them (the cache is passed in)."""

    def __init__(
        self,
        config: LlamaConfig,
        embed: torch.Tensor,
        layers: Sequence[LayerWeights],
        output_norm: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        assert len(layers) == config.num_layers
        assert embed.shape == (config.vocab_size, config.hidden_size)
        assert output.shape == (config.vocab_size, config.hidden_size)
        self.config = config
        self.embed = embed
        self.layers = list(layers)
        self.output_norm = output_norm
        self.output = output
        self.dtype = embed.dtype
        half = config.head_dim // 2
        self._inv_freq = config.rope_base ** (
            -torch.arange(half, dtype=torch.float64) * 2 / config.head_dim
        )

    def layout(self, block_tokens: int = 16, dtype_name: str = "bfloat16") -> KVLayout:
        """The kvtier layout of this model's KV in `dtype_name`, `block_tokens` per block."""
        c = self.config
        return KVLayout(
            model_name=c.name,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype_name=dtype_name,
            block_tokens=block_tokens,
        )

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, past_kv: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[T, vocab]` for each of `tokens` and the cache `[L, 2, P+T, Hkv, D]`.

        `tokens` is a 1-D int64 tensor; `past_kv` (any float dtype, cast to the model's) is the
        cache of the P tokens before them, or None for P = 0. Neither input is modified.
        """
        c = self.config
        past = 0 if past_kv is None else past_kv.shape[2]
        if past_kv is not None:
            expected = (c.num_layers, 2, past, c.num_kv_heads, c.head_dim)
            assert tuple(past_kv.shape) == expected, (tuple(past_kv.shape), expected)
            past_kv = past_kv.to(self.dtype)
        num_new = tokens.shape[0]
        # query t (position past + t) may see key s (position s) iff s <= past + t
        allowed = torch.ones(num_new, past + num_new, dtype=torch.bool).tril(diagonal=past)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if past_kv is not None:
                k = torch.cat([past_kv[layer, 0], k])
                v = torch.cat([past_kv[layer, 1], v])
            return self._attention(q, k, v, allowed)

        logits, new_kv = self.step(tokens, past, attend)
        kv = new_kv if past_kv is None else torch.cat([past_kv, new_kv], dim=2)
        return logits, kv

    @torch.inference_mode()
    def step(
        self, tokens: torch.Tensor, start: int, attend: Attend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[T, vocab]` for `tokens` at positions start .. start + T - 1 and their own KV
        `[L, 2, T, Hkv, D]` (not the past's), with attention left to the caller.

        For each layer, `attend(layer, q, k, v)` gets the new tokens' q `[T, H, D]` and k, v
        `[T, Hkv, D]` (K after RoPE) and returns `[T, H * D]`: softmax(q k^T / sqrt(D)) v over
        whatever cache it holds for positions < start, plus the new tokens causally. This is
        how an engine puts paged attention over cached pages under the model (`engine.py`).
        """
        c = self.config
        assert tokens.dim() == 1 and tokens.dtype == torch.int64, (tokens.dtype, tokens.shape)
        num_new = tokens.shape[0]
        cos, sin = self._rope(start, num_new)
        x = self.embed[tokens]
        kv_layers = []
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, c.rms_eps)
            q = _apply_rope((h @ layer.wq.T).view(num_new, c.num_heads, c.head_dim), cos, sin)
            k = _apply_rope((h @ layer.wk.T).view(num_new, c.num_kv_heads, c.head_dim), cos, sin)
            v = (h @ layer.wv.T).view(num_new, c.num_kv_heads, c.head_dim)
            kv_layers.append(torch.stack([k, v]))
            x = x + attend(i, q, k, v) @ layer.wo.T
            h = _rms_norm(x, layer.ffn_norm, c.rms_eps)
            gated = torch.nn.functional.silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)
            x = x + gated @ layer.w_down.T
        logits = _rms_norm(x, self.output_norm, c.rms_eps) @ self.output.T
        return logits, torch.stack(kv_layers)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Causal softmax attention: q `[T, H, D]`, k and v `[S, Hkv, D]` -> `[T, H * D]`."""
        repeat = self.config.num_heads // self.config.num_kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(self.config.head_dim)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        return torch.einsum("hts,shd->thd", weights, v).reshape(q.shape[0], -1)

    def _rope(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[count, 1, D]` for positions start .. start + count - 1."""
        positions = torch.arange(start, start + count, dtype=torch.float64)
        angles = torch.outer(positions, self._inv_freq)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def generate(model: Llama, tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding: up to `max_new_tokens` new ids after `tokens`, stopping before (and
    without) the model's end-of-sequence id. One prefill, then one token per step on the cache.
    """
    assert len(tokens) > 0, "generate needs at least one prompt token"
    new: list[int] = []
    step = torch.tensor(list(tokens), dtype=torch.int64)
    kv: torch.Tensor | None = None
    for _ in range(max_new_tokens):
        logits, kv = model.forward(step, kv)
        next_id = int(logits[-1].argmax())
        if next_id == model.config.eos_token_id:
            break
        new.append(next_id)
        step = torch.tensor([next_id], dtype=torch.int64)
    return new
