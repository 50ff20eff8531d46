"""What the vLLM connector (`vllm.py`) is configured with and what it accepts of vLLM's KV
cache, checked when vLLM builds it.

- `ConnectorSettings.parse` reads `kv_connector_extra_config`: every key that starts with
  `kvtier` is known (a misspelt one, `kvtier_url` or `" kvtier.url"` too, is a `ConfigError`
  listing the known ones, never silently ignored), every value has its type (a string "false"
  is not a boolean), keys are resolved (`env:NAME`), `kvtier.url` and `kvtier.urls` are not
  both set. Other keys belong to other connectors and are left alone.
- `closed` and `api_key` are the checks the SGLang backend (`sglang.py`) shares.
- `check_layout` refuses a sidecar whose model layout is not the worker's KV, or (with
  `kvtier.model`, `served_model`) whose model has another name.
- `shard` is the tensor-parallel rank and size whose KV this process holds; pipeline and
  context parallelism are refused (their ranks' KV would share keys).
- `check_blocks` refuses KV tensors viewed in kernel blocks other than vLLM's blocks.
- `kv_cache_refusal` says why a KV cache would make kvtier hand out wrong bytes, or None.
  kvtier keys a block by its tokens and copies a request's blocks whole, so it takes only a
  cache whose blocks each hold the causal KV of their tokens for as long as the request runs:
  one group of full attention (or MLA). A group of sliding-window or chunked-local layers (a
  model whose layers are all so: vLLM keeps its own manager for them) swaps the blocks that
  leave the window for its null block, whose zeros a save would store as those tokens' KV;
  a spec that drops other blocks (R-SWA), keeps sink tokens besides, or attends non-causally
  (a prefix LM: a token's KV depends on the tokens after it) is refused the same way. vLLM's
  own prefix cache still serves such models.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.client.connections import check_url
from kvtier.config.events import is_peer_address
from kvtier.config.fields import HiddenText, resolve_api_key
from kvtier.errors import ConfigError, InvalidArgumentError, shown
from kvtier.integrations import paged

_BOOLEANS = {"kvtier.load_async": True, "kvtier.save_async": True, "kvtier.save_decode": True,
             "kvtier.trust_tenant_param": False}  # fmt: skip
_RELAY = ("kvtier.events_endpoint", "kvtier.events_replay_endpoint", "kvtier.events_topic")
KNOWN = ("kvtier.url", "kvtier.urls", "kvtier.api_key", "kvtier.tenant_keys", "kvtier.model",
         "kvtier.timeout_s", *_BOOLEANS, *_RELAY)  # fmt: skip
WORKER_TIMEOUT_S = 120.0
"""The most a vLLM worker's load or save, or the scheduler's reset, waits by default
(`kvtier.timeout_s`; the scheduler's lookups wait `lookups.LOOKUP_TIMEOUT_S`)."""


@dataclass(frozen=True)
class RelaySettings:
    """Where the sidecar publishes its KV events, for vLLM's stream (`vllm_events.py`)."""

    endpoint: str  # the sidecar's `events.endpoint`, as this host reaches it
    replay_endpoint: str | None = None  # its `events.replay_endpoint`
    topic: str = ""  # relay only it and the topics under it (`vllm_events.relayed`)

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> RelaySettings | None:
        """None unless `kvtier.events_endpoint` is set."""
        where = {key: extra.get(key) for key in _RELAY}
        topic = where["kvtier.events_topic"] or ""
        if not isinstance(topic, str) or len(topic) > 200:  # (checked unrelayed too: a typo)
            raise ConfigError("kvtier.events_topic", topic, "a topic of at most 200 characters")
        if where["kvtier.events_endpoint"] is None:
            for key in _RELAY[1:]:  # set for a relay that is not there: never ignored
                if where[key] not in (None, ""):
                    raise ConfigError("kvtier.events_endpoint", None, f"set, with {key}")
            return None
        for key in _RELAY[:2]:
            if where[key] is not None and not is_peer_address(where[key]):
                raise ConfigError(key, where[key], "tcp://HOST:PORT (no *) or ipc://PATH")
        return cls(str(where[_RELAY[0]]), where[_RELAY[1]], topic)


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's `kvtier.*` keys, parsed (README "Using kvtier with vLLM")."""

    urls: tuple[str, ...]  # one sidecar, or one per tensor-parallel rank in rank order
    key: str = ""  # the engine's own tenant's API key ("": the sidecar's anonymous tenant)
    tenant_keys: dict[str, str] = field(default_factory=dict)  # salt or name -> API key
    load_async: bool = True
    save_async: bool = True  # saves on a thread of their own (`saving.py`), not in the step
    save_decode: bool = True  # save the blocks a request's output filled when it finishes
    trust_tenant_param: bool = False
    events: RelaySettings | None = None  # relay the sidecar's KV events to vLLM's

    @classmethod
    def parse(cls, extra: Mapping[str, Any], tp_size: int) -> ConnectorSettings:
        closed(extra, KNOWN)
        urls = sidecar_urls(extra)
        if len(urls) != tp_size:
            raise ConfigError(
                "kvtier.urls",
                masked(urls),
                f"one sidecar URL per tensor-parallel rank ({tp_size}): "
                "each rank holds other heads, in a sidecar of its own",
            )
        for rank, one in enumerate(urls if "kvtier.urls" in extra else ()):
            if not _well_formed(one):
                expected = f"the sidecar's URL, {_URL}"
                raise ConfigError(f"kvtier.urls[{rank}]", masked(one), expected)
        key = api_key(extra)
        named = extra.get("kvtier.tenant_keys")
        named = {} if named is None else named  # (JSON null: unset)
        if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
            raise ConfigError("kvtier.tenant_keys", "(not shown)", "a map of name to API key")
        flags = {}
        for name, default in _BOOLEANS.items():
            flags[name] = extra.get(name, default)
            if not isinstance(flags[name], bool):
                raise ConfigError(name, flags[name], "true or false")
        return cls(
            urls=tuple(urls),
            key=key or "",
            tenant_keys={
                str(n): resolve_api_key(ref, f"kvtier.tenant_keys.{n}") for n, ref in named.items()
            },
            load_async=flags["kvtier.load_async"],
            save_async=flags["kvtier.save_async"],
            save_decode=flags["kvtier.save_decode"],
            trust_tenant_param=flags["kvtier.trust_tenant_param"],
            events=RelaySettings.parse(extra),
        )

    def api_keys(self) -> list[str]:
        """Every API key requests may use: the engine's own, then `tenant_keys`' (each once)."""
        return list(dict.fromkeys([self.key, *self.tenant_keys.values()]))

    def key_for(self, request: Any) -> tuple[str | None, str | None]:
        """The API key of a vLLM request's tenant (None: kvtier is not used for it), and the
        `REFUSALS` counter of why, if it named a tenant it may not. `kv_transfer_params
        ["kvtier_tenant"]` counts only with `trust_tenant_param` (a client can write any name
        there; without it such a request does not use kvtier), and only with a `cache_salt`
        (unless it names the engine's own tenant) that names no other tenant in `tenant_keys`:
        vLLM's prefix cache shares blocks between requests of one salt, whatever their
        `kv_transfer_params`, so a block one tenant's request loaded from kvtier would be
        reused by, and saved into, another's. Else the request's `cache_salt` names it; neither:
        the engine's own key. Each looked up in `tenant_keys`."""
        params = getattr(request, "kv_transfer_params", None) or {}
        named = params.get("kvtier_tenant") if isinstance(params, dict) else None
        salt = getattr(request, "cache_salt", None)
        if named is None:
            return (self.key if salt is None else self.tenant_keys.get(str(salt))), None
        if not self.trust_tenant_param:
            return None, "untrusted_names"
        key = self.tenant_keys.get(str(named))
        if key is None:
            return None, None
        other = self.key if salt is None else self.tenant_keys.get(str(salt), key)
        if other != key:  # the requests sharing its blocks in vLLM may be another tenant's
            return None, "unsalted_names"
        return key, None


REFUSALS = {  # `key_for`'s refusals, logged once each
    "untrusted_names": "a request named kvtier_tenant, which kvtier.trust_tenant_param does not "
    "allow: such requests do not use kvtier",
    "unsalted_names": "a request named kvtier_tenant without a cache_salt of that tenant's own "
    "(vLLM's prefix cache would share its blocks with other tenants): such requests do not use "
    "kvtier",
}


def sidecar_urls(extra: Mapping[str, Any]) -> list[str]:
    """The sidecars of `kvtier.urls`, or `kvtier.url`'s one (default `http://127.0.0.1:8750`);
    a `ConfigError` naming the key for both set, an empty list, or a URL not a string."""
    url, urls = extra.get("kvtier.url"), extra.get("kvtier.urls")
    if urls is None:
        url = "http://127.0.0.1:8750" if url is None else url
        if not (isinstance(url, str) and _well_formed(url)):
            raise ConfigError("kvtier.url", masked(url), f"the sidecar's URL, {_URL}")
        return [url]
    if url is not None:
        raise ConfigError(
            "kvtier.url", masked(url), "unset when kvtier.urls is set (one or the other)"
        )
    if not (isinstance(urls, list) and urls and all(isinstance(u, str) for u in urls)):
        raise ConfigError(
            "kvtier.urls",
            masked(urls),
            "a non-empty list of sidecar URLs, one per tensor-parallel rank",
        )
    return urls


_URL = "a string: http://HOST:PORT (or https://; an IPv6 host in brackets; no spaces)"


def _well_formed(url: str) -> bool:
    """Whether the sidecar clients take `url` (checked at start: a bad one would fail each
    lookup, load and save, or raise from the client's socket, only once vLLM serves)."""
    if not url or any(c.isspace() or not c.isprintable() for c in url):
        return False  # http.client refuses a host or path with them, with an error of its own
    try:
        check_url(url)
    except InvalidArgumentError:
        return False
    return True


def masked(url: object) -> object:
    """`url` (or each of a list of them) with the credentials in it (`user:password@`) not
    shown."""
    if isinstance(url, list):
        return [masked(one) for one in url]
    return re.sub(r"//[^/]*@", "//(credentials not shown)@", url) if isinstance(url, str) else url


def closed(extra: Mapping[str, Any], known: tuple[str, ...]) -> None:
    """`ConfigError` for a key of an engine's extra config that looks like kvtier's and is not
    `known`: one that starts with `kvtier` in any case, once stripped, whatever follows
    (`KVTIER.url`, `kvtier.URL`, `kvtier_url`, `" kvtier.url"` are refused, never ignored).
    Other keys belong to other connectors or the engine and are left alone. The value is not
    shown: a misspelt `kvtier.api_key`'s is the key, and the error goes to the engine's log."""
    ours = (k for k in extra if str(k).strip().lower().startswith("kvtier"))
    unknown = sorted((k for k in ours if k not in known), key=str)
    if unknown:
        hidden = HiddenText.of(extra[unknown[0]])
        raise ConfigError(str(unknown[0]), hidden, f"one of {', '.join(known)}")


def served_model(extra: Mapping[str, Any]) -> str | None:
    """`kvtier.model`: the name the sidecar's model must have (`check_layout`); None: unset."""
    model = extra.get("kvtier.model")
    if model is not None and not (isinstance(model, str) and model.strip()):
        raise ConfigError("kvtier.model", model, "the sidecar's model.name, a non-empty string")
    return model


def call_timeout(extra: Mapping[str, Any], default: float) -> float:
    """`kvtier.timeout_s`: the most seconds one call to the sidecar may wait (`default` when
    unset); a `ConfigError` naming it for a bool, a non-number, or one outside [0.1, 3600]
    (audits BP, BR: `1e-9` was taken, every call timed out, and the start failed 30 s later
    blaming `kvtier.url`)."""
    value = extra.get("kvtier.timeout_s", default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.1 <= value <= 3600:
        raise ConfigError("kvtier.timeout_s", value, "seconds, a number in [0.1, 3600]")
    return float(value)


def api_key(extra: Mapping[str, Any]) -> str | None:
    """`kvtier.api_key`, resolved (`env:NAME`); None when unset."""
    key = extra.get("kvtier.api_key")
    if key is not None and not isinstance(key, str):
        raise ConfigError("kvtier.api_key", type(key).__name__, "a key or env:NAME")
    return resolve_api_key(key, "kvtier.api_key") if key else None


def check_blocks(layers: list[Any], block_size: int) -> None:
    """`ConfigError` unless the KV tensors' blocks are vLLM's (`cache_config.block_size`, the
    tokens of the block ids the scheduler plans with): vLLM may view its blocks as several
    smaller kernel blocks of an attention backend, whose ids the copies would misread."""
    size = paged.geometry(layers)[2]
    if size != block_size:
        raise ConfigError(
            "cache_config.block_size",
            block_size,
            f"the KV tensors' block size, {size}: vLLM views each block of {block_size} tokens "
            f"as kernel blocks of {size}, which kvtier does not copy (start vLLM with "
            f"--block-size {size}, or an attention backend whose kernel blocks are {block_size})",
        )


def check_layout(
    layers: list[Any], served: Any, shard: tuple[int, int], url: str, model: str | None = None
) -> None:
    """`ConfigError` unless the sidecar's model layout (`served`, its `Layout`) is this vLLM
    worker's paged KV (`layers`) and tensor-parallel `shard`, its `block_tokens` divides
    vLLM's block size, and (with `model`, `kvtier.model`) its model is named `model`: two
    models of one geometry (a base model and its fine-tune) have KV of the same shape, and
    only the name tells them apart."""
    if model is not None and served.model_name != model:
        raise ConfigError(
            "kvtier.model",
            model,
            f"the model.name of the sidecar at {url}, {shown(served.model_name)}: its KV is "
            "another model's (point kvtier.url at this model's sidecar, or fix the name)",
        )
    _, heads, size, dim, dtype = paged.geometry(layers)
    ours = (len(layers), heads, dim, dtype, *shard)
    theirs = (served.num_layers, served.num_kv_heads, served.head_dim, served.dtype,
              served.tp_rank, served.tp_size)  # fmt: skip
    if ours != theirs:
        raise ConfigError(
            "model",
            f"{theirs} (layers, KV heads per rank, head_dim, dtype, tp_rank, tp_size) at {url}",
            f"{ours}, as this vLLM worker's KV",
        )
    if size % served.block_tokens:
        raise ConfigError(
            "block_tokens", served.block_tokens, f"a divisor of vLLM's block_size ({size})"
        )


_SPLITS = {  # vLLM's ways of splitting a model's KV that `shard` cannot key apart
    "pipeline_parallel_size": "each stage holds other layers",
    "decode_context_parallel_size": "each rank holds other tokens of every block",
    "prefill_context_parallel_size": "each rank holds other tokens of every block",
}


def shard(vllm_config: Any) -> tuple[int, int]:
    """(rank, size) of the KV this process holds: vLLM's tensor-parallel rank and size,
    (0, 1) for an MLA model, whose ranks hold the same KV. A `ConfigError` naming the setting
    under pipeline or context parallelism (`_SPLITS`): its ranks hold other layers or other
    tokens under one tensor-parallel rank, which kvtier's keys do not tell apart (one rank
    would load another's bytes)."""
    parallel = vllm_config.parallel_config
    for name, why in _SPLITS.items():
        value = getattr(parallel, name, 1)
        if value != 1:
            raise ConfigError(
                f"parallel_config.{name}", value,
                f"1 ({why}, which kvtier does not keep apart; supported: tensor parallelism)",
            )  # fmt: skip
    size = int(parallel.tensor_parallel_size)
    if size == 1 or getattr(vllm_config.model_config, "use_mla", False):
        return 0, 1
    return tp_rank(), size


def tp_rank() -> int:
    """vLLM's tensor-parallel rank of this process; 0 without a TP group (the scheduler). An
    MLA model's ranks hold the same KV (`shard` keys them as one): the vLLM connector's rank
    0 alone saves it and counts its tokens (before, each rank sent every save and the token
    counts were summed over the ranks)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError, RuntimeError):  # no TP group: the scheduler
        return 0


def kv_cache_refusal(kv_cache_config: Any) -> tuple[str, object, str] | None:
    """(field, value, expected) of the `ConfigError` a KV cache earns (module doc), or None."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) > 1:  # block ids are group 0's: another group's layers would take them
        return "kv_cache_groups", len(groups), "1 (vLLM's hybrid manager turned off)"
    if not groups:  # no config (an older vLLM's scheduler): nothing to check
        return None
    spec = groups[0].kv_cache_spec
    specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]  # a uniform type's
    for one in specs:
        causal = not getattr(one, "non_causal", False)
        if type(one) not in (FullAttentionSpec, MLAAttentionSpec) or not causal:
            return (
                "kv_cache_spec",
                type(one).__name__ + ("" if causal else " (non_causal)"),
                "full causal attention (FullAttentionSpec or MLAAttentionSpec): blocks that "
                "leave a window are swapped for zeros, which kvtier would store as their KV",
            )
    return None
