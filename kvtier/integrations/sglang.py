"""kvtier as an SGLang HiCache storage backend (issue 15): SGLang's host-memory cache (L2) backs
up to, and prefetches from, a `kvtier serve` sidecar, which keeps the pages in its tiers
(and its remote tier, shared by nodes).

    python -m sglang.launch_server ... --enable-hierarchical-cache --page-size 64 \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": true,
        "kvtier.url": "http://127.0.0.1:8750", "kvtier.api_key": "env:KVTIER_API_KEY"}'

SGLang names a page by a key: the chained SHA-256 of the page's tokens and every page before
it. kvtier's keyed API (`keyed.py`) stores a chain of such keys as pages of synthetic tokens,
so kvtier's index, prefix closure and tiers hold them as they hold prompts:

- `batch_exists(keys)`: one `lookup` of the chain (the prefix keys SGLang passes, then `keys`);
  the number of leading `keys` kvtier holds. 0, unasked (`skipped_calls`), once a load or store
  found the sidecar restarted on another layout, until one succeeds again or `STALE_S` has
  passed (`_stale`): those pages cannot be served here, and each hit would cost SGLang host
  slots and a failed prefetch.
- `batch_set_v1(keys, host_indices)`: the pages' KV read from SGLang's host pool (any of its
  MHA layouts, `paged.host_gather`) and stored below the prefix (`store(..., start=)`): a
  page is stored only under the pages before it, so with `hicache_storage_pass_prefix_keys`
  off, each batch of a sequence is a chain of its own (still exact, fewer hits). Pages the
  sidecar answers it did not take (`NOT_STORED`: no room, a disk that could not keep up, or
  their prefix gone) are False, counted in `stats["pages_not_stored"]`
  and logged.
- `batch_get_v1(keys, host_indices)`: `load` of the chain's keys' part only (`start=` past
  the prefix keys), the leading pages written into the host slots; per key whether it was.

Contract:
- Constructed by SGLang's `StorageBackendFactory` as `cls(storage_config, kwargs)`; options
  from `storage_config.extra_config`: `kvtier.url`, `kvtier.api_key` ('env:NAME' or a key),
  and `interface_v1: 1`, which makes SGLang call the zero-copy `batch_*_v1` methods. Another
  key that starts with `kvtier` (any case or separator, spaces stripped: `kvtier_url`,
  `" kvtier.url"`, `KVTIER.url`; `settings.closed`), a value of the wrong type, or a
  `kvtier.url` that is not `http(s)://HOST[:PORT]` is a `ConfigError` naming it (a
  misspelt key's value, maybe an API key, is never shown); so is an extra config that is not
  a JSON object (`sglang_config.py`), and a key the sidecar refuses (`kvtier.api_key`).
  Without `interface_v1` SGLang calls the copying `batch_get` / `batch_set`, which kvtier
  does not serve: an error logged at construction names the key, and each such call is
  refused and counted in `stats`.
- Pages round trip bit-exact and land in kvtier in its own layout (`[layers, 2, tokens,
  heads, dim]`), whatever SGLang's host layout: two SGLang processes with different host
  layouts share pages.
- Keys are scoped (`scope`) by SGLang's model name (two models of one geometry hold different
  KV under the same keys) and by the part of the KV the rank holds: tensor-parallel rank (its
  heads; an MLA model's ranks share one), and pipeline, attention context-parallel and decode
  context-parallel rank (its layers, its slice of every page) when their size is over 1.
- Only the host pools whose `kv_buffer` is the whole page are taken (`HOST_POOLS`: SGLang's
  `MHATokenToKVPoolHost` and `MLATokenToKVPoolHost`, exactly); another (the MXFP8 pool, whose
  scales live apart; the asymmetric pool; any subclass) is a `ConfigError` naming its class
  when SGLang registers it, never copied in part (`sglang_pools.py`). The sidecar's model
  layout must be one rank's: its layers, KV heads per rank, head_dim and dtype are checked
  against the host pool when SGLang registers it (`ConfigError` naming the field), and
  SGLang's page size must be a multiple of kvtier's `block_tokens` and at least 8 tokens. A
  storage config whose `is_mla_model` (ranks share their KV: the scope names no rank) comes
  with an MHA pool (one rank's heads) is a `ConfigError`: a rank would be served another's
  heads. An fp8 KV cache's pools hold its bytes as uint8 (SGLang's store dtype): under a
  sidecar of an fp8 dtype (`FP8`) they are copied as that dtype, bit for bit.
- A sidecar that fails is a miss (`batch_exists` 0, `batch_get_v1` all False, `batch_set_v1`
  all False: those pages stay out of kvtier; SGLang 0.5.23 does not back them up again),
  logged and counted in `stats`, never an exception into SGLang's threads; so is a host index
  the gather or scatter refuses, and a load whose KV is not the layout SGLang's host pool
  registered with (a sidecar restarted on another model behind the same URL): never cast
  into the host pool.
- A call waits `kvtier.timeout_s` (`TIMEOUT_S`, 8 s) at most; after one the sidecar did not
  answer (a timeout, a connection refused or cut), none is made for `lookups.QUIET_S` (10 s),
  or until a probe (a one-token lookup every 0.5 s, on a thread of its own) is answered:
  `batch_exists`, `batch_get_v1` and `batch_set_v1` answer misses meanwhile, each counted in
  `stats["skipped_calls"]`. A sidecar that hangs then holds SGLang's backup and prefetch
  threads one timeout every 10 s, not the client's 120 s per call; one that answers again
  after it was out of reach (resumed, restarted) is asked again within about 0.5 s. SGLang's
  clear is always asked (its failure must be heard).

MLA (`MLATokenToKVPoolHost`: one latent of C values per token and layer, no separate V): kvtier
holds the latent as one head of K and V halves, so the sidecar's model is `num_kv_heads: 1`,
`head_dim: C / 2` (288 for DeepSeek's 576), and the pool is copied through
`paged.mla_host_view` (its layouts `layer_first`, `page_first`, `page_first_direct`,
`page_unified`). Split or packed MLA pools (`page_first_kv_split`, DSA's fp8) are refused.

Not here yet: hybrid models' `*_v2` pools, and a GPU run. Through the mapped pools a load
still leases the whole chain on the sidecar's gpu tier (a lease is a prefix); only the keys'
part is copied.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier.errors import ConfigError, KVTierError, LayoutChangedError
from kvtier.integrations import paged
from kvtier.integrations.lookups import PROBE_TOKENS, Quiet
from kvtier.integrations.resets import reset_tenants
from kvtier.integrations.settings import api_key, call_timeout, closed
from kvtier.integrations.sglang_config import extra_config, scope, sidecar_url
from kvtier.integrations.sglang_pools import (
    FP8,
    HOST_POOLS,
    REFUSED,
    host_buffer,
    registered,
    sidecar_client,
)
from kvtier.keyed import KeyedPages

log = logging.getLogger("kvtier.sglang")

__all__ = ["FP8", "HOST_POOLS", "REFUSED", "KvtierHiCacheStorage", "host_buffer", "scope",
           "sidecar_url"]  # fmt: skip


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = extra_config(storage_config)
        closed(extra, ("kvtier.url", "kvtier.api_key", "kvtier.timeout_s"))  # never ignored
        self.url = sidecar_url(extra.get("kvtier.url", "http://127.0.0.1:8750"))
        self.timeout_s = call_timeout(extra, TIMEOUT_S)  # each try (lane, HTTP) half of it
        self.client = sidecar_client(self.url, api_key(extra), self.timeout_s / 2)  # waits
        # none asked for a while after the sidecar did not answer, or until a probe is answered
        self.quiet = Quiet(probe=partial(self.client.lookup, PROBE_TOKENS))
        self.config = storage_config
        self.scope = scope(storage_config)
        self.pages: KeyedPages | None = None
        self.mem_pool_host: Any = None
        self.buffer: Any = None  # the host pool's kv_buffer as an MHA one (`host_buffer`)
        self.layout = ""
        self.stats = dict.fromkeys(("exists_calls", "pages_set", "pages_got", "errors"), 0)
        self.stats["skipped_calls"] = 0  # misses not asked: `quiet`, `_stale`, stores in a clear
        self.stats["pages_not_stored"] = 0  # a store's pages the sidecar answered it did not take
        self.stale_until = 0.0  # the sidecar's layout changed under us (`_stale`), till then
        self.stale_s = STALE_S
        self._lock = threading.Lock()
        self._sets = threading.Condition()  # stores under way, and a clear that waits for them
        self._storing, self._clearing = 0, False
        self._chains = threading.local()  # each SGLang thread's last chain and tokens (`_tokens`)
        if not extra.get("interface_v1"):  # SGLang's test: bool(extra.get("interface_v1", 0))
            log.error("kvtier: %s", NOT_V1)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Check the host pool against the sidecar's layout; then pages can move."""
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        self.buffer, self.layout = registered(host, self.client.layout(), self.config)
        self.pages = KeyedPages(host.page_size, self.scope)

    # ---- the v1 (zero-copy) interface --------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        prefix = _prefix(extra_info)
        pages = self._pages()
        if not keys:  # none asked: not a lookup of the prefix alone (an error, logged, before)
            return 0
        if self._skipped() or self._stale():
            return 0
        try:
            found = self.client.lookup(self._tokens(prefix, keys)).num_tokens
        except (KVTierError, OSError) as e:
            self._failed("lookup", e)
            return 0
        self._count("exists_calls", 1)
        return max(0, min(len(keys), pages.pages(found) - len(prefix)))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        prefix = _prefix(extra_info)
        pages, host = self._pages(), self.mem_pool_host
        start = len(prefix) * host.page_size
        if self._skipped() or not self._begin_store():
            return [False] * len(keys)
        try:  # SGLang's indices too: a wrong one is a miss, never an exception in its thread
            kv = paged.host_gather(self.buffer, self.layout, host_indices, host.page_size)
            stored = self.client.store(self._tokens(prefix, keys), kv, start=start)
        except (KVTierError, OSError, IndexError, RuntimeError, ValueError) as e:
            self._failed("store", e)
            return [False] * len(keys)
        finally:
            self._end_store()
        held = max(0, min(len(keys), pages.pages(stored.cached_tokens) - len(prefix)))
        self.stale_until = 0.0
        self._count("pages_set", held)
        if held < len(keys):  # answered, but not taken: no room, or the prefix is gone
            self._count("pages_not_stored", len(keys) - held)
            log.warning("kvtier store: %d of %d pages not stored (%s)", len(keys) - held,
                        len(keys), NOT_STORED)  # fmt: skip
        return [i < held for i in range(len(keys))]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        prefix = _prefix(extra_info)
        pages, host = self._pages(), self.mem_pool_host
        ps = host.page_size
        if self._skipped():
            return [False] * len(keys)
        try:  # only the pages asked for: SGLang holds the prefix's
            got = self.client.load(self._tokens(prefix, keys), start=len(prefix) * ps)
        except (KVTierError, OSError) as e:
            self._failed("load", e)
            return [False] * len(keys)
        served = max(0, min(len(keys), pages.pages(got.num_tokens) - len(prefix)))
        if served:
            kv = got.kv[:, :, : served * ps]
            try:  # a sidecar restarted on another layout: a miss, never a cast (`paged`)
                paged.host_scatter(self.buffer, self.layout, host_indices[: served * ps], ps, kv)
            except (KVTierError, IndexError, RuntimeError, ValueError) as e:
                self._failed("load", e)
                return [False] * len(keys)
        self.stale_until = 0.0
        self._count("pages_got", served)
        return [i < served for i in range(len(keys))]

    # ---- the legacy interface (abstract in SGLang; its controller uses v1 here) ----------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        raise self._legacy("batch_get_v1")

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> None:
        raise self._legacy("batch_get_v1")

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        raise self._legacy("batch_set_v1")

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        raise self._legacy("batch_set_v1")

    def clear(self) -> None:
        """SGLang's "clear HiCache storage" (after a weight update): this tenant's KV in the
        sidecar forgotten (`resets.py`); a failure is logged, counted and raised (SGLang's
        storage attachment then reports the clear failed). The stores under way (their pages
        read from the host pool before it, maybe of the old weights) end first, and none
        starts until the reset has: no old page lands after it."""
        with self._sets:
            self._clearing = True
            drained = self._sets.wait_for(lambda: not self._storing, self.timeout_s)
        try:
            why = reset_tenants([self.client]) if drained else "a store did not end in time"
        finally:
            with self._sets:
                self._clearing = False
        if why is not None:
            self._failed("reset", RuntimeError(why))
            raise KVTierError(f"kvtier reset: {why}")

    def close(self) -> None:
        self.client.close()

    # ---- inside -------------------------------------------------------------------------

    def _pages(self) -> KeyedPages:
        if self.pages is None:
            raise ConfigError("mem_pool_host", None, "register_mem_pool_host before any page moves")
        return self.pages

    def _tokens(self, prefix: list[str], keys: list[str]) -> list[int]:
        """The synthetic tokens of the chain `prefix + keys`. SGLang walks a sequence in batches
        of 128 pages, each passing every page before it as `prefix`: mapped anew each time, a
        1M-token sequence at page 64 cost 8.7 s of hashing per walk, 90% of a call. The
        thread's last chain is kept, and reused when it is exactly the head of `prefix` (all
        of its keys compared, never just the last; and mapped by the same `pages`)."""
        pages = self._pages()
        mapped, chain, tokens = getattr(self._chains, "last", (None, [], []))
        n = len(chain)
        if mapped is pages and 0 < n <= len(prefix) and prefix[:n] == chain:
            tokens = tokens + pages.tokens(prefix[n:] + list(keys))
        else:
            tokens = pages.tokens(prefix + list(keys))
        self._chains.last = (pages, prefix + list(keys), tokens)
        return tokens

    def _legacy(self, v1: str) -> NotImplementedError:
        """A call of SGLang's copying interface (`interface_v1` not set): counted as an error,
        and refused naming the key (SGLang logs it and moves no page)."""
        self._count("errors", 1)
        return NotImplementedError(f"kvtier serves SGLang only through {v1}: {NOT_V1}")

    def _begin_store(self) -> bool:
        """Whether a store may start (not while a clear runs: a miss, counted as skipped)."""
        with self._sets:
            if self._clearing:
                self._count("skipped_calls", 1)
                return False
            self._storing += 1
            return True

    def _end_store(self) -> None:
        with self._sets:
            self._storing -= 1
            self._sets.notify_all()

    def _skipped(self) -> bool:
        """Whether to answer a miss without asking: the sidecar did not answer a call in the
        last `Quiet.quiet_s` (counted in `skipped_calls`)."""
        if self.quiet.open():
            return False
        self._count("skipped_calls", 1)
        return True

    def _stale(self) -> bool:
        """Whether to answer `batch_exists` a miss without asking: a load or store found the
        sidecar behind the URL restarted on another layout than the host pool registered
        with, so its pages cannot be served here (each prefetch would allocate host slots and
        fail); until a store or load succeeds again, or `stale_s` after the last such failure,
        when it asks again (counted in `skipped_calls`). The bound is for a rank that never
        stores: an MLA model's ranks past the first (SGLang's storage writer is one rank), whose
        hits SGLang takes the least of across ranks, so one that never asked again kept the
        whole group from hitting after the sidecar came back on the right layout."""
        stale = time.monotonic() < self.stale_until
        if stale:
            self._count("skipped_calls", 1)
        return stale

    def _failed(self, what: str, error: BaseException) -> None:
        if isinstance(error, LayoutChangedError):
            self.stale_until = time.monotonic() + self.stale_s
        self.quiet.failed(error)
        self._count("errors", 1)
        log.warning("kvtier %s failed: %s", what, error)

    def _count(self, stat: str, n: int) -> None:
        with self._lock:  # SGLang calls from its backup and prefetch threads at once
            self.stats[stat] += n


NOT_V1 = (
    'the extra config lacks "interface_v1": 1, so SGLang calls batch_get / batch_set, which '
    "kvtier does not serve: no page is backed up or prefetched (set it)"
)
NOT_STORED = (
    "the sidecar had no room (a batch has more new blocks than its gpu or host tier has slots, "
    "or all are leased), its disk could not keep up, or it no longer holds the pages before them"
)
STALE_S = 30.0
"""How long `batch_exists` answers a miss unasked after a load or store found the sidecar on
another layout (`_stale`)."""
TIMEOUT_S = 8.0
"""The most a call to the sidecar waits by default (`kvtier.timeout_s`): a lookup is a hash walk
(0.07 s for 1M tokens), a batch of pages a shared-memory copy; a sidecar that hangs must not
hold SGLang's backup and prefetch threads for the client's 120 s per call, nor past the 10 s
SGLang's detach waits for each (at 10 s a detach with a hung sidecar could fail)."""


def _prefix(extra_info: Any) -> list[str]:
    """The keys of the pages before a call's keys (SGLang passes them with
    `hicache_storage_pass_prefix_keys`; otherwise a batch is a chain of its own)."""
    keys = getattr(extra_info, "prefix_keys", None)
    return list(keys) if keys else []
