"""API keys -> tenants. Keys are kept only as SHA-256 digests, compared in constant time over
every known key, and never logged; the tenant name is what the rest of the gateway sees."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import PermissionDenied, Unauthenticated
from gateway.fairness import NO_LIMITS, TenantLimits
from runtime.errors import InvalidArgument

ENV_VAR = "TESSERA_API_KEYS"
LIMIT_NAMES = ("max_inflight", "max_queued")


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str] | None = None  # None: every model
    limits: TenantLimits = NO_LIMITS  # the key's own; unset ones fall back to serve's defaults

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def _parse_limits(options: list[str]) -> TenantLimits:
    """`max_inflight=N`, `max_queued=M` (in any order, each at most once)."""
    values: dict[str, int] = {}
    for option in (o.strip() for o in options):
        if not option:
            continue
        name, _, value = option.partition("=")
        name = name.strip()
        # NOTE: the message never quotes the entry: it holds a secret key.
        if name not in LIMIT_NAMES or name in values or not value.strip().isdigit():
            raise InvalidArgument(f"API key options are {' and '.join(LIMIT_NAMES)}, each once, "
                                  "with a whole number", field="api_keys")
        values[name] = int(value)
    return TenantLimits(**values)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._entries = [(_digest(k), t) for k, t in keys.items()]

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def parse(cls, spec: str | Iterable[str]) -> ApiKeys:
        """Entries `key=tenant[:model|model][;max_inflight=N][;max_queued=M]`, comma- or
        line-separated; `#` starts a comment line."""
        items = spec.replace("\n", ",").split(",") if isinstance(spec, str) else spec
        keys: dict[str, Tenant] = {}
        for item in (i.strip() for i in items):
            if not item or item.startswith("#"):
                continue
            entry, *options = item.split(";")
            key, sep, rest = entry.partition("=")
            tenant, _, models = rest.partition(":")
            if not sep or not key.strip() or not tenant.strip():
                raise InvalidArgument("API key entries look like key=tenant[:model|model]"
                                      "[;max_inflight=N][;max_queued=M]", field="api_keys")
            allowed = frozenset(m for m in models.split("|") if m) if models else None
            keys[key.strip()] = Tenant(tenant.strip(), allowed, _parse_limits(options))
        return cls(keys)

    @classmethod
    def load(cls, path: str | Path | None = None) -> tuple[ApiKeys, str | None]:
        """From a file, else $TESSERA_API_KEYS, else one fresh dev key (returned to print once)."""
        if path is not None:
            return cls.parse(Path(path).read_text()), None
        if os.environ.get(ENV_VAR):
            return cls.parse(os.environ[ENV_VAR]), None
        dev = f"tsk-dev-{secrets.token_urlsafe(18)}"
        return cls({dev: Tenant("dev")}), dev

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        presented = None
        for name, value in metadata or ():
            if name == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    presented = token.strip()
        if presented is None:
            raise Unauthenticated("missing `authorization: Bearer <api key>` metadata")
        digest = _digest(presented)
        found: Tenant | None = None
        for known, tenant in self._entries:  # NOTE: no early exit, so timing says nothing
            if hmac.compare_digest(known, digest):
                found = tenant
        if found is None:
            raise Unauthenticated("unknown API key")
        return found

    @staticmethod
    def authorize(tenant: Tenant, model: str) -> None:
        if not tenant.may_use(model):
            raise PermissionDenied(f"tenant {tenant.name!r} may not use model {model!r}",
                                   model=model)
