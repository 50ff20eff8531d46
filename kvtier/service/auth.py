"""Who a request acts as: API keys -> tenants, the admin key, and the server secret.

- Keys come from the config (`tenants.<id>.api_keys`, `service.admin_key`), literally or as
  `env:NAME` (read from the environment once, at start). Only their SHA-256 digests are kept;
  a key never appears in a log, a status or an error: an error names the key's place
  (`tenants.a.api_keys.0`) and what was expected, never its value.
- A key acts as one tenant or as the admin, never two of them: the same key under two tenants,
  or a tenant's key equal to the admin key, is a `ConfigError` at start naming both places.
- Auth is on when any tenant has a key. Then every data-plane request carries
  `Authorization: Bearer <key>` and acts as that key's tenant (401 without a key, 403 with an
  unknown one); a request can never name another tenant. Without auth every request acts as
  the tenant it names (`X-Kvtier-Tenant`, default `default`): for loopback use only, which the
  server enforces at start (`require_loopback`).
- Admin endpoints need the admin key (403 otherwise, 403 too when none is configured).
- The server secret keys the tenant salts (`hashing.tenant_salt`): 32 random bytes generated at
  the first start in `service.state_dir/secret`, mode 0600, and read back on every later start,
  so that block ids (and a disk tier's contents) stay valid across restarts. A client never
  supplies a salt. The state directory is made 0700 (refused if a group or other user can
  write it); the secret is created whole (never half-written) and read without following a
  link; one another user could read, a link, or anything but a regular file of 32 bytes is
  refused with a `ConfigError` naming the path (`private_files.py`), and so is a directory the
  secret cannot be written in (a read-only or full filesystem), with the OS's reason.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from pathlib import Path

from kvtier.config import HiddenKey, KVTierConfig
from kvtier.config.fields import resolve_api_key
from kvtier.errors import ConfigError
from kvtier.private_files import create_once, private_dir, read_regular

SECRET_BYTES = 32


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _key_digest(ref: str, place: str, unset_ok: bool) -> bytes:
    """The digest of the key `ref` names (`resolve_api_key`); with `unset_ok`, an `env:NAME`
    whose variable is unset is keyed by `env:NAME` itself (one variable in two places is one
    key), for `kvtier validate` where the service's environment is not."""
    if unset_ok and ref.startswith("env:") and ref.removeprefix("env:") not in os.environ:
        return _digest(ref)
    return _digest(resolve_api_key(ref, place))


class Auth:
    def __init__(self, config: KVTierConfig, *, unset_ok: bool = False) -> None:
        """Resolve every key; `ConfigError` for an unset `env:` key (unless `unset_ok`), one
        that is not a key (`resolve_api_key`) and for one key in two places (two tenants, or a
        tenant and the admin). Nothing is written: `kvtier validate` checks a config so."""
        self._tenants: dict[bytes, str] = {}
        places: dict[bytes, str] = {}
        for tenant, tenant_cfg in config.tenants.items():
            for i, ref in enumerate(tenant_cfg.api_keys):
                place = f"tenants.{tenant}.api_keys.{i}"
                digest = _key_digest(ref, place, unset_ok)
                owner = self._tenants.setdefault(digest, tenant)
                if owner != tenant:
                    raise ConfigError(
                        place,
                        HiddenKey(),
                        f"a key of one tenant only: tenant {tenant!r} and tenant {owner!r} "
                        f"list the same key ({places[digest]})",
                    )
                places.setdefault(digest, place)
        admin = config.service.admin_key
        self._admin = None if admin is None else _key_digest(admin, "service.admin_key", unset_ok)
        if self._admin in places:
            raise ConfigError(
                "service.admin_key",
                HiddenKey(),
                f"a key no tenant uses: {places[self._admin]} is the same key",
            )
        self.enabled = bool(self._tenants)

    def tenant(self, authorization: str | None, named: str | None) -> str | None:
        """The tenant a request acts as, or None when its key is missing or unknown; without
        auth the tenant `named` (default `default`), which the calls that act as a tenant check
        against the config (`UnknownTenantError`); `/v1/pools`, the same for every tenant, and
        a lease's id, which only its tenant finds, do not need to."""
        if not self.enabled:  # (an empty name is a name: refused as unknown, as in process)
            return "default" if named is None else named
        key = bearer(authorization)
        return None if key is None else self._tenants.get(_digest(key))

    def is_admin(self, authorization: str | None) -> bool:
        key = bearer(authorization)
        return self._admin is not None and key is not None and _digest(key) == self._admin


def bearer(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value, or None. The scheme is matched in any
    case (RFC 9110 11.1: `bearer KEY` was refused as no key at all)."""
    scheme, _, key = (header or "").partition(" ")
    return (key.strip() or None) if scheme.lower() == "bearer" else None


def require_loopback(host: str, auth: Auth) -> None:
    """Refuse (`ConfigError`) to serve a non-loopback address without auth."""
    if auth.enabled:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ConfigError(
            "service.host",
            host,
            "a loopback address (127.0.0.1, ::1), unless a tenant has api_keys (auth on)",
        )


def server_secret(state_dir: str | os.PathLike[str]) -> bytes:
    """The persisted server secret; created (0600, in a 0700 directory) at the first start."""
    path = private_dir(state_dir, "service.state_dir") / "secret"
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        if create_once(path, secret):
            return secret
    except OSError as exc:  # a read-only or full filesystem: the start stops, named
        raise ConfigError(
            "service.state_dir",
            str(path.parent),
            f"a directory the server can write its secret in ({exc.strerror or exc})",
        ) from None
    return read_secret(path)


def read_secret(path: Path) -> bytes:
    """The server secret at `path` (`service.state_dir`'s `secret`): an owner-only regular file
    of `SECRET_BYTES`; a `ConfigError` naming `service.state_dir` otherwise."""
    secret = read_regular(path, "service.state_dir", SECRET_BYTES, private=True)
    if len(secret) != SECRET_BYTES:
        raise ConfigError(
            "service.state_dir",
            str(path),
            f"a secret file of {SECRET_BYTES} bytes, found {len(secret)}",
        )
    return secret
