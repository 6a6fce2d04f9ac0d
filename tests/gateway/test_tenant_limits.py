"""Per-tenant limits through the real gateway and a real worker: a key's in-flight cap makes its
next request wait, past its queue bound it is refused (retryable, with RetryInfo), and another
tenant is served at once meanwhile."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import REGISTRY

from gateway.auth import ApiKeys
from gateway.client import NO_RETRY, Client, TenantConcurrencyExceeded
from gateway.fairness import TenantLimits
from tests.gateway.conftest import KEYS, MODEL, requests_drained, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_key_over_its_limits_waits_then_is_refused_while_another_tenant_is_served(
        two_workers) -> None:
    gateway = two_workers.gateway
    keys, defaults = gateway.keys, gateway.tenant_limits
    gateway.keys = ApiKeys.parse(f"{KEYS['acme']}=acme;max_inflight=1;max_queued=1,"
                                 f"{KEYS['bob']}=bob")
    gateway.tenant_limits = TenantLimits(max_inflight=4, max_queued=4)
    pool = gateway.pools[MODEL]
    acme = Client(two_workers.target, api_key=KEYS["acme"], retry=NO_RETRY)
    bob = Client(two_workers.target, api_key=KEYS["bob"], retry=NO_RETRY)
    labels = {"model": MODEL, "tenant": "acme", "reason": "TENANT_CONCURRENCY_EXCEEDED"}
    refused_before = REGISTRY.get_sample_value("tessera_gateway_tenant_refused_total", labels)
    holder = acme.generate("Count:", max_tokens=600, ignore_eos=True)
    try:
        next(iter(holder))  # acme's one slot is taken
        second = acme.generate("Hi", max_tokens=2)
        waited = threading.Thread(target=lambda: list(second), daemon=True)
        waited.start()
        wait_for(lambda: pool.queue.queued("acme") == 1, 30, "acme's second request to queue")

        with pytest.raises(TenantConcurrencyExceeded) as info:
            list(acme.generate("Hi", max_tokens=2))
        assert float(info.value.metadata["retry_after_s"]) == 1.0
        assert info.value.metadata["max_inflight"] == "1"

        start = time.monotonic()
        served = bob.generate("Hi", max_tokens=2)
        list(served)
        assert served.usage is not None and time.monotonic() - start < 10
        assert waited.is_alive() and second.usage is None, "acme's second still waits"

        holder.cancel()
        waited.join(30)
        assert second.usage is not None and second.usage.completion_tokens == 2
        refused = REGISTRY.get_sample_value("tessera_gateway_tenant_refused_total", labels)
        assert refused == (refused_before or 0.0) + 1
        wait_for(lambda: not pool.queue.inflight, 30, "every slot to be released")
        wait_for(lambda: requests_drained(two_workers), 30, "the workers to be idle")
    finally:
        holder.cancel()
        gateway.keys, gateway.tenant_limits = keys, defaults
        acme.close()
        bob.close()
