"""Tenants: API keys mapped to trust groups, read from a small TOML file.

A tenant *is* a trust group: its name is the ``trust_group`` of every request it sends, so it salts every
block digest and no two tenants ever share a cached block. The principal comes only from the
``Authorization: Bearer`` header, never from the request body.

```toml
[operator]                          # optional: keys that may read /metrics and /admin/ledger
api_keys = ["sk-ops-1"]

[tenants.acme]
api_keys = ["sk-acme-1", "sk-acme-2"]
max_blocks = 256                    # optional: cap on the KV blocks its requests may hold, be promised or
                                    # grow into (its trust group's quota in the engine's ledger)
max_requests = 32                   # optional: its requests in flight or waiting at once (then 429)
priority = 0                        # optional: scheduler priority of its requests (larger runs first)

[tenants.globex]
api_keys = ["sk-globex"]
```

Without a file the server runs single-tenant: every request is in the trust group ``default`` and no
key is checked (or one key, given by ``--api-key``, is required of every request).
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

DEFAULT_TENANT = "default"  # the trust group of single-tenant mode (CacheContext's default)
# Tenant names become trust groups and metric labels: letters, digits and a few separators only.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TENANT_KEYS = {"api_keys", "max_blocks", "max_requests", "priority"}


@dataclass(frozen=True, slots=True)
class Tenant:
    """One principal: its trust group and its limits."""

    name: str
    max_blocks: int | None = None  # its trust group's quota in the ledger (None: no cap)
    max_requests: int | None = None  # its requests in flight or waiting at once (None: no own limit)
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request: a tenant, or the operator (who may read server-wide state)."""

    tenant: Tenant | None
    operator: bool = False


def _digest(key: str) -> bytes:
    # Look keys up by digest: the dict lookup then compares digests, not the secrets themselves.
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """The key table. ``authenticate(header)`` returns the principal or None (-> 401)."""

    def __init__(self, tenants: list[Tenant], keys: dict[str, str], operator_keys: list[str], *,
                 single: bool = False, open_access: bool = False) -> None:
        self.by_name = {t.name: t for t in tenants}
        self._keys = {_digest(k): name for k, name in keys.items()}
        self._operator = {_digest(k) for k in operator_keys}
        self.single = single  # one tenant, "default"
        self.open_access = open_access  # no key checked at all

    @classmethod
    def single_tenant(cls, api_key: str | None = None) -> Tenants:
        """Everyone is the ``default`` tenant; with ``api_key``, that key is required (and it is also
        the operator's key: there is nobody else to hide anything from)."""
        tenant = Tenant(DEFAULT_TENANT)
        if api_key is None:
            return cls([tenant], {}, [], single=True, open_access=True)
        if not api_key:
            raise ConfigError("--api-key must not be empty")
        return cls([tenant], {api_key: DEFAULT_TENANT}, [api_key], single=True)

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no tenants file at {path}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "tenants") -> Tenants:
        unknown = set(data) - {"tenants", "operator"}
        if unknown:
            raise ConfigError(f"{where}: unknown section(s) {', '.join(sorted(unknown))} (expected [tenants.NAME] "
                              "and [operator])")
        section = data.get("tenants")
        if not isinstance(section, dict) or not section:
            raise ConfigError(f"{where}: no tenants: add a [tenants.NAME] table with api_keys = [...]")
        keys: dict[str, str] = {}
        tenants: list[Tenant] = []
        for name, spec in section.items():
            if not _NAME.match(name):
                raise ConfigError(f"{where}: tenant name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
            if not isinstance(spec, dict):
                raise ConfigError(f"{where}: [tenants.{name}] must be a table")
            extra = set(spec) - _TENANT_KEYS
            if extra:
                raise ConfigError(f"{where}: [tenants.{name}] has unknown key(s) {', '.join(sorted(extra))} "
                                  f"(known: {', '.join(sorted(_TENANT_KEYS))})")
            for key in _key_list(spec.get("api_keys"), f"{where}: [tenants.{name}] api_keys"):
                if key in keys:
                    raise ConfigError(f"{where}: an API key of tenant {name!r} is also a key of {keys[key]!r}")
                keys[key] = name
            tenants.append(Tenant(name, _opt_int(spec, "max_blocks", name, where, 1),
                                  _opt_int(spec, "max_requests", name, where, 1),
                                  _opt_int(spec, "priority", name, where, None) or 0))
        operator = data.get("operator", {})
        if not isinstance(operator, dict) or set(operator) - {"api_keys"}:
            raise ConfigError(f"{where}: [operator] takes only api_keys = [...]")
        op_keys = _key_list(operator.get("api_keys", []), f"{where}: [operator] api_keys", allow_empty=True)
        for key in op_keys:
            if key in keys:
                raise ConfigError(f"{where}: an operator key is also a key of tenant {keys[key]!r}")
        return cls(tenants, keys, op_keys)

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal behind an ``Authorization`` header value, or None for a missing/unknown key."""
        if self.open_access:
            return Principal(self.by_name[DEFAULT_TENANT], operator=True)
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = _digest(token.strip())
        name = self._keys.get(digest)
        operator = digest in self._operator
        if name is None and not operator:
            return None
        return Principal(self.by_name[name] if name is not None else None, operator=operator)

    @property
    def has_operator(self) -> bool:
        return self.open_access or bool(self._operator)

    def describe(self) -> str:
        """One line for the startup banner (never a key)."""
        if self.single:
            how = "no API key is checked" if self.open_access else "one API key (--api-key) is required"
            return f"single-tenant mode: every request is in trust group {DEFAULT_TENANT!r}; {how}"
        names = ", ".join(sorted(self.by_name))
        ops = ("operator keys may read /metrics and /admin/ledger" if self._operator
               else "no [operator] keys: /metrics and /admin/ledger are closed")
        return f"multi-tenant mode: {len(self.by_name)} tenants ({names}), each its own trust group; {ops}"


def _key_list(value: Any, what: str, allow_empty: bool = False) -> list[str]:
    if value is None and not allow_empty:
        raise ConfigError(f"{what} is missing")
    if not isinstance(value, list) or not all(isinstance(k, str) and k.strip() == k and k for k in value):
        raise ConfigError(f"{what} must be a list of non-empty strings without surrounding spaces")
    if not value and not allow_empty:
        raise ConfigError(f"{what} is empty")
    if len(set(value)) != len(value):
        raise ConfigError(f"{what} lists a key twice")
    return list(value)


def _opt_int(spec: dict[str, Any], key: str, name: str, where: str, minimum: int | None) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{where}: [tenants.{name}] {key} must be an integer{bound}, got {value!r}")
    return value


__all__ = ["DEFAULT_TENANT", "Principal", "Tenant", "Tenants"]
