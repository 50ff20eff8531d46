"""The superblock's later keys, and how a recorded superblock differs from a tier's geometry.

    {format, slot_bytes, header_region, slots_per_slab, layout, itemsize}   always (slabs.py)
    quant                                      a quantized tier's (slabs.py)
    hashing, model                             written since they were added (here)

A store whose `hashing.algorithm` differs from the one recorded would find none of the
directory's copies (their ids were hashed with the other), so it is refused at start like a
changed model. `model` spells out what `layout` fingerprints (name, layers, KV heads, head_dim,
dtype, block_tokens), so that the refusal names the field that changed (`differences`). A
superblock written before these keys is not compared on them (`LATER`): `model` is compared on
`layout` alone, and `hashing` not at all, since it cannot tell which algorithm its copies were
hashed with (refusing all but the default would refuse, at upgrade, a directory kept under
another); copies of another algorithm are then recovered as namespaces the config does not
know, which a clear or reset retires. An older kvtier refuses a superblock with these keys as
damaged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.blocks import DTYPES

MODEL_KEYS = {"name": str, "num_layers": int, "num_kv_heads": int, "head_dim": int}
MODEL_KEYS |= {"dtype": str, "block_tokens": int}
MODEL_NAME_CHARS = 256
"""The most characters of `model.name` recorded (the superblock is at most 4 KiB)."""

LATER_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "hashing": (
        lambda v: isinstance(v, str) and 0 < len(v) <= 32,
        "the name of a hash algorithm",
    ),
    "model": (
        lambda v: (
            isinstance(v, dict)
            and set(v) == set(MODEL_KEYS)
            and all(type(v[k]) is t and (t is str or v[k] > 0) for k, t in MODEL_KEYS.items())
            and len(v["name"]) <= MODEL_NAME_CHARS
        ),
        f"an object of {', '.join(MODEL_KEYS)}",
    ),
}
"""What `slabs.read_superblock` accepts for each later key."""

DEFAULT_HASHING = "blake2b-128"
"""`hashing.algorithm`'s default (a tier made without saying)."""
LATER = ("hashing", "model")
"""Keys a superblock written before them lacks: not compared then (module doc)."""
READABLE = ("model",)
"""Later keys that spell out what `layout` fingerprints; a superblock written before them is
compared on `layout` alone."""


def block_shape(model: dict[str, Any]) -> list[int]:
    """The block shape `[layers, 2, block_tokens, kv_heads, head_dim]` of a superblock's
    `model` entry (checked well-formed), as a `quant` entry records it."""
    return [model["num_layers"], 2, model["block_tokens"], model["num_kv_heads"], model["head_dim"]]


def quant_disagreement(geometry: dict[str, Any]) -> str | None:
    """How a superblock's `quant` entry (the block shape and dtype `kvtier check` decodes a
    quantized tier's copies by; already checked well-formed) contradicts the rest of it: its
    dtype against `itemsize`, its shape and dtype against `model` where recorded. None when it
    agrees or is absent. Unchecked, a `quant` of another shape had `kvtier check` find every
    copy's payload corrupt and `--fix` retire them all, where the store, which refuses such a
    superblock (it is not the tier's geometry), would have served them."""
    quant, model = geometry.get("quant"), geometry.get("model")
    if quant is None:
        return None
    if DTYPES[quant["dtype"]].itemsize != geometry["itemsize"]:
        return f"quant.dtype {quant['dtype']!r} is not of itemsize {geometry['itemsize']}"
    if model is None:
        return None
    shape = block_shape(model)
    if quant["block_shape"] != shape or quant["dtype"] != model["dtype"]:
        found = f"{quant['block_shape']} {quant['dtype']}"
        return f"quant is {found}, not the model's blocks, {shape} {model['dtype']}"
    return None


def differences(have: dict[str, Any], geometry: dict[str, Any]) -> list[str]:
    """Where the recorded superblock `have` differs from `geometry`, each as `key: recorded X,
    now Y` (a `model` field as `model.<field>`); the readable fields alone when they differ
    (`layout` is their fingerprint), else every key. Nothing: the same geometry."""
    recorded = have
    keys = [k for k in geometry if k in recorded or k not in LATER]
    keys += [k for k in recorded if k not in geometry]
    found: list[str] = []
    for key in keys:
        old, new = recorded.get(key), geometry.get(key)
        if isinstance(old, dict) and isinstance(new, dict) and key in READABLE:
            found += [
                f"{key}.{k}: recorded {old.get(k)!r}, now {new.get(k)!r}"
                for k in new
                if old.get(k) != new.get(k)
            ]
        elif old != new:
            found.append(f"{key}: recorded {old!r}, now {new!r}")
    readable = [line for line in found if line.split(":")[0].split(".")[0] in READABLE]
    return readable or found
