"""The sidecar and the host pool SGLang registers with kvtier's HiCache storage backend
(`sglang.py`), the pool checked against the sidecar's layout before a page moves.

- `sidecar_client(url, key, timeout_s)`: the client of the sidecar at `url`, waiting
  `START_WAIT_S` for one that does not answer yet (started beside SGLang, restarting), as a
  vLLM worker does; then a `ConfigError` naming `kvtier.url`. A key it refuses is one naming
  `kvtier.api_key`.

- `host_buffer(host)`: the pool's `kv_buffer` as an MHA layout's `[2, ...]` buffer and its
  layout; only `HOST_POOLS` are taken (a pool that may keep part of a page elsewhere is a
  `ConfigError` naming its class and why, `REFUSED`).
- `registered(host, served, config)`: that buffer, as the sidecar's dtype where SGLang keeps an
  fp8 cache's bytes as uint8 (`FP8`), once the pool's layers, KV heads, head_dim and dtype,
  the tensor-parallel rank and the page size are checked against the sidecar's layout
  (`ConfigError` naming the field; SGLang's page size first, 8 to 65,536 tokens: `keyed.py`).
  A storage config that says the ranks share their KV
  (`is_mla_model`: the keys' scope names no rank) over a pool of one rank's heads (an MHA
  pool) is refused too: rank 0 would be served rank 1's heads.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvtier.blocks import KVLayout
from kvtier.client import Client, ServiceError
from kvtier.errors import ConfigError, KVTierError
from kvtier.integrations import paged
from kvtier.integrations.lookups import at_start
from kvtier.keyed import DIGEST_WORDS, MAX_PAGE_TOKENS

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The sidecar dtypes of an fp8 KV cache, whose bytes SGLang's pools keep as uint8."""

HOST_POOLS = (MHATokenToKVPoolHost, MLATokenToKVPoolHost)
"""The host pools kvtier copies: exactly these classes, whose `kv_buffer` holds the whole
page. A subclass may keep more of a page elsewhere (scales, a second buffer), which kvtier
would never move: it is refused (`host_buffer`), as is any other pool."""

REFUSED = {
    "MHATokenToKVPoolMXFP8Host": "its fp8 pages' per-page scales live outside kv_buffer "
    "(k_scale_host, v_scale_host), which kvtier would not move: a reader would dequantize "
    "with stale scales",
    "AsymmetricMHATokenToKVPoolHost": "K and V have different head dims, in two buffers "
    "(kvtier's layout has one head_dim)",
}


def sidecar_client(url: str, key: str | None, timeout_s: float) -> Client:
    """The client of the sidecar at `url` (API key `key`; each try of a call `timeout_s`),
    made as `lookups.at_start` makes a first call (SGLang's start failed at once on the bare
    connection error of `GET /v1/pools` of a sidecar not answering yet). A key the sidecar
    refuses (none given, or one it does not know: 401, 403) is a `ConfigError` naming
    `kvtier.api_key`, the key not shown (it was a bare `ServiceError` naming no setting)."""
    try:
        return at_start(
            lambda: Client(url, api_key=key, timeout_s=timeout_s), "kvtier.url", url, "SGLang"
        )
    except ServiceError as e:
        if e.status not in (401, 403):
            raise
        given = "(none)" if not key else "(a key, not shown)"
        raise ConfigError(
            "kvtier.api_key", given, f"a key of a tenant of the sidecar at {url} ({e})"
        ) from None


def registered(host: Any, served: KVLayout, config: Any) -> tuple[torch.Tensor, str]:
    """SGLang's host pool `host` (storage config `config`) checked against the sidecar's
    layout `served` (module doc): the buffer the pages move through, and its layout."""
    buffer, layout = host_buffer(host)
    if not DIGEST_WORDS <= host.page_size <= MAX_PAGE_TOKENS:  # before `block_tokens`: page 1,
        raise ConfigError(  # SGLang's default, asked the sidecar for a block of 1, then failed
            "--page-size", host.page_size, f"{DIGEST_WORDS} to {MAX_PAGE_TOKENS} tokens (a page "
            "carries 248 bits of its key; then a multiple of kvtier's block_tokens)"
        )  # fmt: skip
    dtype = host.kv_buffer.dtype
    if dtype == torch.uint8 and served.dtype in FP8:  # SGLang keeps fp8 KV's bytes as uint8
        buffer, dtype = buffer.view(served.dtype), served.dtype
    mla = isinstance(host, MLATokenToKVPoolHost)  # a latent: one head of its halves
    if config.is_mla_model and not mla:  # the scope would name no rank over per-rank heads
        raise ConfigError(
            "is_mla_model", True, f"False for {type(host).__name__}, whose ranks hold their heads"
        )
    heads, dim = (1, host.kv_cache_dim // 2) if mla else (host.head_num, host.head_dim)
    ours = (host.layer_num, heads, dim, dtype)
    theirs = (served.num_layers, served.num_kv_heads, served.head_dim, served.dtype)
    if ours != theirs or getattr(host, "v_head_dim", dim) != dim:
        raise ConfigError(
            "model", f"{theirs} (layers, KV heads, head_dim, dtype)", f"{ours}, as SGLang's"
        )
    rank, size = (0, 1) if config.is_mla_model else (config.tp_rank, config.tp_size)
    if served.tp_size > 1 and (served.tp_rank, served.tp_size) != (rank, size):
        raise ConfigError(
            "model.tp_rank", f"{served.tp_rank} of {served.tp_size}", f"rank {rank} of {size}"
        )
    if host.page_size % served.block_tokens:
        raise ConfigError(
            "block_tokens",
            served.block_tokens,
            f"a divisor of SGLang's page size ({host.page_size})",
        )
    return buffer, layout


def host_buffer(host: Any) -> tuple[torch.Tensor, str]:
    """SGLang's host pool's `kv_buffer` as an MHA layout's `[2, ...]` buffer, and the layout
    (an MLA pool's latent as one head of K and V halves: `paged.mla_host_view`); a
    `ConfigError` for a pool or layout kvtier cannot copy (`HOST_POOLS`)."""
    name = type(host).__name__
    if type(host) not in HOST_POOLS:
        why = REFUSED.get(name, "a host pool kvtier does not know, which may keep part of a page")
        raise ConfigError(
            "mem_pool_host",
            name,
            f"{' or '.join(c.__name__ for c in HOST_POOLS)} (whose page is all in kv_buffer): "
            f"{why}",
        )
    mla = isinstance(host, MLATokenToKVPoolHost)
    known = list(paged.MLA_HOST_LAYOUTS) if mla else paged.HOST_LAYOUTS
    if host.layout not in known or host.kv_buffer is None:
        raise ConfigError("--hicache-mem-layout", host.layout, f"one of {known}")
    if not mla:
        return host.kv_buffer, host.layout
    if getattr(host, "dsa_kv_cache_store_fp8", False):
        raise ConfigError("MLA host pool", "packed fp8 (DSA)", "an unpacked latent")
    try:
        return paged.mla_host_view(host.kv_buffer, host.layout)
    except KVTierError as e:
        raise ConfigError("MLA host pool", host.layout, str(e)) from None
