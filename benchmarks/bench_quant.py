"""What a quantized tier costs in accuracy, and what it saves in bytes (issue 17).

Model: SmolLM2-135M-Instruct (`kvtier.reference`, fp32 on the CPU), run by the reference engine
(`Engine`) over a real `KVStore` whose KV is bf16, one store per codec, each with a disk tier
keeping its copies in that codec (`tiers.disk.codec`); `none` is the baseline, a bf16 prefix.
Text: the Python documentation shipped with the standard library (`pydoc_data.topics`),
tokenized once. `--prompts` prompts (default 64), each a prefix of 512-2048 tokens (whole
16-token blocks) at a random place in the text, then `CONT` = 64 tokens of the text after it:

    prefix (P tokens)  stored, written to disk, evicted from gpu and host: the prefill finds it
                       on disk only, and the engine attends over what the copy decodes to
    continuation C     computed over it: perplexity of C[1:], relative to `none`
    greedy g (32)      the model's greedy continuation (plain `Llama.forward` over the bf16
                       prefix), fed to every codec's store (teacher-forced): agreement = share of
                       the 32 positions where the codec's argmax is `none`'s (the same engine
                       path, the prefix unquantized)

Per codec: bytes per block against bf16, perplexity change (over all prompts' tokens), greedy
agreement, max and mean |logit - logit(none)| over C and g, and encode and decode speed of the
last prompt's blocks (GB/s of raw bf16, median of `--repeat` after `bench_mover.WARMUP` untimed
runs) against a raw copy of the same bytes into a buffer allocated once, in the same run (torch
on the CPU; the Triton decoder's speed is `benchmarks/gpu/`).

Targets: int8 >= 1.9x smaller, perplexity within +0.5 %, agreement >= 99 %; int4 >= 3.5x and
+3 %; fp8 +1 %. Run: `python benchmarks/bench_quant.py [--prompts N] [--json FILE]`.
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from bench_mover import median_gbps

from kvtier.blocks import KVLayout
from kvtier.config import KVTierConfig, parse_config
from kvtier.quant import QuantCodec, QuantSpec
from kvtier.reference import Llama, load_smollm2, load_smollm2_tokenizer
from kvtier.reference.engine import Engine
from kvtier.store import KVStore

BT = 16
CONT = 64
GREEDY = 32
CODECS: dict[str, QuantSpec | None] = {
    "none": None,
    "fp8": QuantSpec("fp8"),
    "int8": QuantSpec("int8"),
    "int4": QuantSpec("int4"),
    "int4 keys/channel": QuantSpec("int4", keys="channel"),
}


@dataclass
class Row:
    codec: str
    block_bytes: int
    ratio: float
    ppl: float
    ppl_change: float
    agreement: float
    max_logit_err: float
    mean_logit_err: float
    encode_gbs: float
    decode_gbs: float
    copy_gbs: float


def text_tokens() -> list[int]:
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return load_smollm2_tokenizer().encode(text)


def as_blocks(kv: torch.Tensor) -> torch.Tensor:
    """`[L, 2, P, H, D]` -> `[P / BT, L, 2, BT, H, D]`, the store's block layout."""
    L, _, P, H, D = kv.shape
    return kv.reshape(L, 2, P // BT, BT, H, D).permute(2, 0, 1, 3, 4, 5).contiguous()


def store_config(layout: KVLayout, spec: QuantSpec | None, disk: Path) -> KVTierConfig:
    """The model's `layout`; gpu and host of 512 MiB (1456 SmolLM2 blocks); a disk tier in
    `spec`."""
    codec: dict[str, Any] = {"codec": "none"}
    if spec is not None:
        codec = {"codec": spec.kind, "codec_group": spec.group, "codec_keys": spec.keys}
    return parse_config(
        {
            "model": {
                "name": layout.model_name,
                "num_layers": layout.num_layers,
                "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim,
                "dtype": layout.dtype_name,
            },
            "block_tokens": layout.block_tokens,
            "tiers": {
                "gpu": {"capacity": "512MiB", "device": "cpu"},
                "host": {"capacity": "512MiB", "pinned": False},
                "disk": {"capacity": "1GiB", "path": str(disk), **codec},
            },
            "mover": {"background": False},
        }
    )


class Served:
    """A store per codec; `prefill(name, prefix, kv, fed)` stores the prefix's KV, moves it to
    disk only, and returns the logits of `fed` computed over the prefix the disk serves."""

    def __init__(self, model: Llama, layout: KVLayout, root: Path) -> None:
        self.stores = {
            name: KVStore(store_config(layout, spec, root / f"codec-{i}"))
            for i, (name, spec) in enumerate(CODECS.items())
        }
        self.engines = {name: Engine(model, store) for name, store in self.stores.items()}

    def prefill(
        self, name: str, prefix: list[int], kv: torch.Tensor, fed: list[int]
    ) -> torch.Tensor:
        store = self.stores[name]
        store.clear()
        store.store(prefix, kv)
        store.persist()
        for tier in ("gpu", "host"):
            store.evict(tier, 1 << 20)
        found = store.lookup(prefix)
        assert found.disk_tokens == len(prefix), found  # served from the codec's copies
        done = self.engines[name].prefill(prefix + fed)
        assert done.reused_tokens == len(prefix), done.reused_tokens
        logits: torch.Tensor = done.logits
        return logits

    def codecs(self) -> dict[str, str]:
        """Each store's disk codec as its status names it (`i4k20v40`, ...)."""
        return {name: s.status()["tiers"]["disk"]["codec"] for name, s in self.stores.items()}

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


def greedy(model: Llama, logits: torch.Tensor, kv: torch.Tensor) -> list[int]:
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < GREEDY:
        step, kv = model.forward(torch.tensor(tokens[-1:]), kv)
        tokens.append(int(step[-1].argmax()))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = load_smollm2(dtype=torch.float32)
    layout = model.layout(BT, "bfloat16")
    ids = text_tokens()
    codecs = {n: None if spec is None else QuantCodec(spec, layout) for n, spec in CODECS.items()}
    nll: dict[str, list[float]] = {name: [] for name in codecs}
    agree: dict[str, list[bool]] = {name: [] for name in codecs}
    errors: dict[str, list[torch.Tensor]] = {name: [] for name in codecs}
    rng = random.Random(args.seed)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="bench-quant-"))
    served = Served(model, layout, root)
    for prompt in range(args.prompts):
        P = rng.randrange(512 // BT, 2048 // BT + 1) * BT
        start = rng.randrange(0, len(ids) - P - CONT)
        prefix = torch.tensor(ids[start : start + P])
        cont = torch.tensor(ids[start + P : start + P + CONT])
        _, kv = model.forward(prefix)
        kv = kv.to(layout.dtype)
        logits, full = model.forward(cont, kv)
        g = greedy(model, logits, full)
        fed = [*cont.tolist(), *g[:-1]]
        reference = None
        for name in codecs:
            rows = served.prefill(name, prefix.tolist(), kv, fed)
            if reference is None:
                reference = rows
            nll[name] += torch.nn.functional.cross_entropy(
                rows[: CONT - 1], cont[1:], reduction="none"
            ).tolist()
            picks = rows[CONT - 1 :].argmax(-1)  # after C, then after each of g fed
            agree[name] += (picks == reference[CONT - 1 :].argmax(-1)).tolist()
            errors[name].append((rows - reference).abs().flatten())
        if prompt % 8 == 7:
            print(f"  {prompt + 1} prompts, {time.perf_counter() - started:.0f} s", flush=True)
    ids_on_disk = served.codecs()
    served.close()
    shutil.rmtree(root)
    blocks = as_blocks(kv)  # the last prompt's prefix: 32-128 blocks
    raw = blocks.numel() * 2
    target = torch.empty_like(blocks)
    copy = median_gbps(raw, lambda: target.copy_(blocks), args.repeat)
    base_ppl = math.exp(statistics.fmean(nll["none"]))
    table = []
    for name, codec in codecs.items():
        err = torch.cat(errors[name])
        encode = decode = copy
        size = layout.block_bytes
        if codec is not None:
            payload = codec.encode(blocks)
            encode = median_gbps(raw, lambda c=codec: c.encode(blocks), args.repeat)  # type: ignore[misc]
            decode = median_gbps(raw, lambda c=codec, p=payload: c.decode(p), args.repeat)  # type: ignore[misc]
            size = codec.payload_nbytes
        ppl = math.exp(statistics.fmean(nll[name]))
        table.append(
            Row(
                name,
                size,
                layout.block_bytes / size,
                ppl,
                ppl / base_ppl - 1,
                statistics.fmean(agree[name]),
                float(err.max()),
                float(err.mean()),
                encode,
                decode,
                copy,
            )
        )
    tokens = len(nll["none"])
    print(
        f"\nSmolLM2-135M, {args.prompts} prompts of 512-2048 tokens from pydoc_data, "
        f"{tokens} continuation tokens, {args.prompts * GREEDY} greedy positions; bf16 KV"
    )
    print("disk copies: " + ", ".join(f"{name} {ids_on_disk[name]}" for name in codecs))
    print(
        f"{'codec':<18} {'bytes/block':>11} {'smaller':>7} {'ppl':>8} {'change':>8} "
        f"{'greedy':>7} {'max|dl|':>8} {'mean|dl|':>8} {'encode':>12} {'decode':>12}"
    )
    for r in table:
        print(
            f"{r.codec:<18} {r.block_bytes:>11} {r.ratio:>6.2f}x {r.ppl:>8.4f} "
            f"{r.ppl_change:>+8.3%} {r.agreement:>7.2%} {r.max_logit_err:>8.3f} "
            f"{r.mean_logit_err:>8.4f} {r.encode_gbs:>5.2f} ({r.encode_gbs / r.copy_gbs:.2f})"
            f" {r.decode_gbs:>5.2f} ({r.decode_gbs / r.copy_gbs:.2f})"
        )
    print("encode / decode: GB/s of bf16 KV on the CPU (torch), and (in brackets) / a raw copy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": args.prompts, "rows": [asdict(r) for r in table]}, f, indent=1)


if __name__ == "__main__":
    main()
