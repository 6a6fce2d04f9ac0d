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
from runtime.errors import InvalidArgument

ENV_VAR = "TESSERA_API_KEYS"


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str] | None = None  # None: every model

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._entries = [(_digest(k), t) for k, t in keys.items()]

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def parse(cls, spec: str | Iterable[str]) -> ApiKeys:
        """`key=tenant` or `key=tenant:model1|model2` entries, comma- or line-separated."""
        items = spec.replace("\n", ",").split(",") if isinstance(spec, str) else spec
        keys: dict[str, Tenant] = {}
        for item in (i.strip() for i in items):
            if not item or item.startswith("#"):
                continue
            key, sep, rest = item.partition("=")
            tenant, _, models = rest.partition(":")
            if not sep or not key.strip() or not tenant.strip():
                raise InvalidArgument("API key entries look like key=tenant[:model|model]",
                                      field="api_keys")
            allowed = frozenset(m for m in models.split("|") if m) if models else None
            keys[key.strip()] = Tenant(tenant.strip(), allowed)
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
