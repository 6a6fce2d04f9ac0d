"""API keys: parsing, bearer metadata, unknown keys, per-tenant model permissions and limits."""

from __future__ import annotations

import pytest

from gateway.auth import ApiKeys, Tenant
from gateway.errors import PermissionDenied, Unauthenticated
from gateway.fairness import TenantLimits
from runtime.errors import InvalidArgument


def test_bearer_key_maps_to_its_tenant() -> None:
    keys = ApiKeys.parse("k1=acme, k2=bob:m1|m2")
    assert keys.authenticate([("authorization", "Bearer k1")]) == Tenant("acme")
    bob = keys.authenticate([("authorization", "bearer k2")])
    assert bob.name == "bob" and bob.may_use("m2") and not bob.may_use("m3")


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer nope")],
                                      [("authorization", "k1")], [("authorization", "Basic k1")]])
def test_missing_or_unknown_key_is_unauthenticated(metadata: list[tuple[str, str]]) -> None:
    with pytest.raises(Unauthenticated) as info:
        ApiKeys.parse("k1=acme").authenticate(metadata)
    assert "k1" not in str(info.value) and "nope" not in str(info.value)


def test_model_outside_the_tenants_list_is_permission_denied() -> None:
    with pytest.raises(PermissionDenied):
        ApiKeys.authorize(Tenant("bob", frozenset({"m1"})), "m2")


def test_malformed_entries_are_rejected_and_keys_are_not_kept_in_clear() -> None:
    with pytest.raises(InvalidArgument):
        ApiKeys.parse("no-tenant-here")
    keys = ApiKeys.parse("secret-key=acme")
    assert "secret-key" not in repr(vars(keys))


def test_without_file_or_env_a_dev_key_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TESSERA_API_KEYS", raising=False)
    keys, dev = ApiKeys.load()
    assert dev is not None
    assert keys.authenticate([("authorization", f"Bearer {dev}")]).name == "dev"
    monkeypatch.setenv("TESSERA_API_KEYS", "a=t1,b=t2")
    keys, dev = ApiKeys.load()
    assert dev is None and len(keys) == 2


def test_key_entries_carry_per_tenant_limits() -> None:
    keys = ApiKeys.parse("k1=acme:m1;max_inflight=4;max_queued=0\nk2=bob; max_queued = 2\nk3=eve")
    acme = keys.authenticate([("authorization", "Bearer k1")])
    assert acme.limits == TenantLimits(max_inflight=4, max_queued=0) and acme.may_use("m1")
    assert keys.authenticate([("authorization", "Bearer k2")]).limits == TenantLimits(None, 2)
    assert keys.authenticate([("authorization", "Bearer k3")]).limits == TenantLimits()


@pytest.mark.parametrize("entry", ["sk-1=acme;max_inflight=0", "sk-1=acme;max_queued=-1",
                                   "sk-1=acme;max_inflight=two", "sk-1=acme;burst=3",
                                   "sk-1=acme;max_queued=1;max_queued=2"])
def test_bad_limits_are_refused_without_quoting_the_key(entry: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        ApiKeys.parse(entry)
    assert "sk-1" not in str(info.value)
