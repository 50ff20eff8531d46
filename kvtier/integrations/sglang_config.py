"""The settings of kvtier's SGLang HiCache storage backend (`sglang.py`) that come from
SGLang's storage config, checked before the sidecar is asked anything:

- `extra_config(config)`: `--hicache-storage-backend-extra-config` as a dict; any other JSON
  value (a list, a string, a number) is a `ConfigError` naming `extra_config` (it was a bare
  ValueError or TypeError out of `dict(...)`).
- `sidecar_url(url)`: `kvtier.url`, `http(s)://HOST[:PORT]`, nothing after it (an empty
  query or fragment, a trailing `?` or `#`, included); else a `ConfigError` naming it.
- `scope(config)`: the keys' scope (`keyed.py`) of an SGLang rank.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError


def extra_config(config: Any) -> dict[Any, Any]:
    """The storage config's `extra_config` as a new dict (None: empty); another type than a
    mapping is a `ConfigError` naming it (its value not shown: it may hold an API key)."""
    extra = config.extra_config
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ConfigError(
            "extra_config", f"a {type(extra).__name__} (not shown)", "a JSON object of settings"
        )
    return dict(extra)


def sidecar_url(url: Any) -> str:
    """`kvtier.url`, checked: `http(s)://host[:port]`; else a `ConfigError` naming it."""
    expected = "the sidecar's URL, http://HOST:PORT or https://HOST:PORT"
    if not isinstance(url, str) or not url or any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError("kvtier.url", url, expected)
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (a port out of range or not a number raises)
    except ValueError:
        raise ConfigError("kvtier.url", url, expected) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port == 0:
        raise ConfigError("kvtier.url", url, expected)
    if "@" in parts.netloc:  # credentials: never shown
        raise ConfigError("kvtier.url", "(a URL with a user, not shown)", f"{expected}, no user")
    if parts.path not in ("", "/") or "?" in url or "#" in url:  # an empty query too (`"?"`):
        # urlsplit reads none, but the client refused it with an error not naming the key
        raise ConfigError("kvtier.url", url, f"{expected}: no path, query or fragment")
    return url


def scope(config: Any) -> str:
    """The keys' scope (`keyed.py`) of an SGLang rank: the model's name (two models of one
    geometry hold different KV for the same keys), then the part of the KV this rank holds:
    its tensor-parallel rank (its heads; an MLA model's ranks hold the same latent), pipeline
    rank (its layers), attention context-parallel rank and decode context-parallel rank
    (their slices of every page), each only when its size is over 1 (an older SGLang without
    a field: 1). The name is JSON-quoted, so different configs never give the same scope."""
    part = "mla" if config.is_mla_model else f"tp{config.tp_rank}/{config.tp_size}"
    for field, rank, size in (("pp", "pp_rank", "pp_size"), ("cp", "attn_cp_rank", "attn_cp_size"),
                              ("dcp", "dcp_rank", "dcp_size")):  # fmt: skip
        if getattr(config, size, 1) > 1:
            part += f" {field}{getattr(config, rank, 0)}/{getattr(config, size, 1)}"
    if getattr(config, "dcp_size", 1) > 1:  # which tokens of a page a DCP rank holds
        part += f" page{getattr(config, 'logical_page_size', None)}"
    return f"model={json.dumps(getattr(config, 'model_name', None))} {part}"
