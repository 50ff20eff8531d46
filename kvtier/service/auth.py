"""Who a request acts as: API keys -> tenants, the admin key, and the server secret.

- Keys come from the config (`tenants.<id>.api_keys`, `service.admin_key`), literally or as
  `env:NAME` (read from the environment once, at start). Only their SHA-256 digests are kept;
  a key never appears in a log, a status or an error.
- Auth is on when any tenant has a key. Then every data-plane request carries
  `Authorization: Bearer <key>` and acts as that key's tenant (401 without a key, 403 with an
  unknown one); a request can never name another tenant. Without auth every request acts as
  the tenant it names (`X-Kvtier-Tenant`, default `default`): for loopback use only, which the
  server enforces at start (`require_loopback`).
- Admin endpoints need the admin key (403 otherwise, 403 too when none is configured).
- The server secret keys the tenant salts (`hashing.tenant_salt`): 32 random bytes generated at
  the first start in `service.state_dir/secret`, mode 0600, and read back on every later start,
  so that block ids (and a disk tier's contents) stay valid across restarts. A client never
  supplies a salt.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError

SECRET_BYTES = 32


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def resolve_key(ref: str, field: str) -> str:
    """A configured key: the literal, or the value of `$NAME` for `env:NAME`."""
    if not ref.startswith("env:"):
        return ref
    name = ref.removeprefix("env:")
    value = os.environ.get(name)
    if value is None or len(value) < 16:
        raise ConfigError(field, ref, f"${name} set to a key of at least 16 characters")
    return value


class Auth:
    def __init__(self, config: KVTierConfig) -> None:
        self._tenants: dict[bytes, str] = {}
        for tenant, tenant_cfg in config.tenants.items():
            for i, ref in enumerate(tenant_cfg.api_keys):
                self._tenants[_digest(resolve_key(ref, f"tenants.{tenant}.api_keys.{i}"))] = tenant
        admin = config.service.admin_key
        self._admin = None if admin is None else _digest(resolve_key(admin, "service.admin_key"))
        self.enabled = bool(self._tenants)

    def tenant(self, authorization: str | None, named: str | None) -> str | None:
        """The tenant a request acts as, or None when its key is missing or unknown."""
        if not self.enabled:
            return named or "default"
        key = _bearer(authorization)
        return None if key is None else self._tenants.get(_digest(key))

    def is_admin(self, authorization: str | None) -> bool:
        key = _bearer(authorization)
        return self._admin is not None and key is not None and _digest(key) == self._admin


def _bearer(header: str | None) -> str | None:
    if header is None or not header.startswith("Bearer "):
        return None
    return header.removeprefix("Bearer ").strip() or None


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
    """The persisted server secret; created (0600) at the first start."""
    path = Path(state_dir) / "secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_bytes()
        if len(secret) != SECRET_BYTES:
            raise ConfigError(
                "service.state_dir", str(path), f"a secret file of {SECRET_BYTES} bytes"
            ) from None
        return secret
    secret = secrets.token_bytes(SECRET_BYTES)
    with os.fdopen(fd, "wb") as out:
        out.write(secret)
        out.flush()
        os.fsync(out.fileno())
    return secret
