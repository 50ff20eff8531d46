"""A tiny llama GGUF file written for the reference loader's tests (`gguf`'s writer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tiny_gguf(
    path: Path,
    *,
    heads: int = 2,
    shapes: dict[str, tuple[int, ...]] | None = None,
    arch: str = "llama",
    seed: int = 0,
) -> Path:
    """A llama GGUF of 1 layer, width 8, 2 heads (1 KV head of 4), vocabulary 5, fp32 weights
    of `seed` (two seeds: two models of one geometry); `shapes` changes tensors' shapes."""
    import gguf  # (the callers skip without it)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}" for i in range(5)])
    writer.add_eos_token_id(0)
    wanted = {
        "token_embd.weight": (5, 8),
        "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (4, 8),
        "blk.0.attn_v.weight": (4, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_norm.weight": (8,),
        "blk.0.ffn_gate.weight": (16, 8),
        "blk.0.ffn_up.weight": (16, 8),
        "blk.0.ffn_down.weight": (8, 16),
        **(shapes or {}),
    }
    rng = np.random.default_rng(seed)
    for name, shape in wanted.items():
        writer.add_tensor(name, rng.random(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
