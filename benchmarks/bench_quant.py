"""What a quantized tier costs in accuracy, and what it saves in bytes (issue 17).

Model: SmolLM2-135M-Instruct (`kvtier.reference`, fp32 on the CPU); the engine keeps its KV in
bf16 (the store's dtype), so the baseline is a bf16 prefix, the copy `none` serves. Text: the
Python documentation shipped with the standard library (`pydoc_data.topics`), tokenized once.
`--prompts` prompts (default 64), each a prefix of 512-2048 tokens (whole 16-token blocks) at a
random place in the text, then `CONT` = 64 tokens of the text after it, computed:

    prefix (P tokens)  ── served from the tier ──  the KV the codec's copy decodes to
    continuation C     ── computed over it ──────  perplexity of C[1:], relative to `none`
    greedy g (32)      ── `none`'s greedy tokens, then fed to every codec (teacher-forced):
                          agreement = share of the 32 positions whose argmax is g's token

Per codec: bytes per block against bf16, perplexity change (over all prompts' tokens), greedy
agreement, max and mean |logit - logit(none)| over C and g, and encode and decode speed of a
batch of blocks (GB/s of raw bf16, median of `--repeat`) against a raw copy of the same bytes in
the same run (torch on the CPU; the Triton decoder's speed is `benchmarks/gpu/`).

Targets: int8 >= 1.9x smaller, perplexity within +0.5 %, agreement >= 99 %; int4 >= 3.5x and
+3 %; fp8 +1 %. Run: `python benchmarks/bench_quant.py [--prompts N] [--json FILE]`.
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvtier.quant import QuantCodec, QuantSpec
from kvtier.reference import Llama, load_smollm2, load_smollm2_tokenizer

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


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    n, L, _, _, H, D = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(L, 2, n * BT, H, D)


def served(codec: QuantCodec | None, kv: torch.Tensor) -> torch.Tensor:
    """The prefix KV a tier with `codec` hands back for `kv` (bf16)."""
    if codec is None:
        return kv
    return from_blocks(codec.decode(codec.encode(as_blocks(kv))))


def greedy(model: Llama, logits: torch.Tensor, kv: torch.Tensor) -> list[int]:
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < GREEDY:
        step, kv = model.forward(torch.tensor(tokens[-1:]), kv)
        tokens.append(int(step[-1].argmax()))
    return tokens


def speed(fn: Callable[[], object], nbytes: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


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
    for prompt in range(args.prompts):
        P = rng.randrange(512 // BT, 2048 // BT + 1) * BT
        start = rng.randrange(0, len(ids) - P - CONT)
        prefix = torch.tensor(ids[start : start + P])
        cont = torch.tensor(ids[start + P : start + P + CONT])
        _, kv = model.forward(prefix)
        kv = kv.to(layout.dtype)
        logits, full = model.forward(cont, kv)
        g = greedy(model, logits, full)
        fed = torch.cat([cont, torch.tensor(g[:-1])])
        reference = None
        for name, codec in codecs.items():
            rows, _ = model.forward(fed, served(codec, kv))
            if reference is None:
                reference = rows
            nll[name] += torch.nn.functional.cross_entropy(
                rows[: CONT - 1], cont[1:], reduction="none"
            ).tolist()
            agree[name] += (rows[CONT - 1 :].argmax(-1) == torch.tensor(g)).tolist()
            errors[name].append((rows - reference).abs().flatten())
        if prompt % 8 == 7:
            print(f"  {prompt + 1} prompts, {time.perf_counter() - started:.0f} s", flush=True)
    blocks = as_blocks(kv)  # the last prompt's prefix: 32-128 blocks
    raw = blocks.numel() * 2
    copy = speed(lambda: blocks.clone(), raw, args.repeat)
    base_ppl = math.exp(statistics.fmean(nll["none"]))
    table = []
    for name, codec in codecs.items():
        err = torch.cat(errors[name])
        encode = decode = copy
        size = layout.block_bytes
        if codec is not None:
            payload = codec.encode(blocks)
            encode = speed(lambda c=codec: c.encode(blocks), raw, args.repeat)  # type: ignore[misc]
            decode = speed(lambda c=codec, p=payload: c.decode(p), raw, args.repeat)  # type: ignore[misc]
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
