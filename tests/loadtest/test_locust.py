"""Locust against the real stack on loopback (gateway, one worker process, REST shim), run as a
headless subprocess (gevent's patching never touches pytest) and judged on its CSV files: the
well-behaved scenario has no failed request; with an abusive tenant flooding beside it, the
abuser is refused (TENANT_CONCURRENCY_EXCEEDED) and the well-behaved tenant's p95 stays within
2x + 1 s of its p95 without the abuser."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.auth import ApiKeys
from gateway.runner import GatewayRunner
from gateway.serve import serve_rest
from tests.gateway.conftest import pool_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
REPO = Path(__file__).resolve().parents[2]
GOOD_KEY, ABUSER_KEY = "key-good-tenant", "key-abusive-tenant"
# The well-behaved tenant's four users fit well inside its limits; the abuser's bursts do not.
KEYS = (f"{GOOD_KEY}=good;max_inflight=8;max_queued=8,"
        f"{ABUSER_KEY}=abuser;max_inflight=2;max_queued=2")
WELL_BEHAVED = {"ShortChatGrpc": 2, "ShortChatRest": 1, "AgentRest": 1}
ITERATIONS = 6
MARGIN = (2.0, 1000.0)  # p95 with the abuser <= 2x p95 without it + 1,000 ms

Rows = dict[tuple[str, str], dict[str, str]]


class Stack:
    def __init__(self, runner: GatewayRunner, rest_url: str) -> None:
        self.runner, self.rest_url = runner, rest_url

    def locust(self, out: Path, classes: dict[str, int],
               abuser: bool = False) -> tuple[Rows, list[dict[str, str]]]:
        """Runs locust headless until every well-behaved user did its iterations; its stats
        and failures CSV rows."""
        users = [{"user_class_name": name, "fixed_count": n} for name, n in classes.items()]
        names = list(classes) + (["AbusiveTenant"] if abuser else [])
        # NOTE: the user classes before the options: --config-users takes every word after it.
        cmd = [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", *names,
               "--headless",
               "-u", str(sum(classes.values()) + abuser), "-r", "20", "-t", "90s",
               "--max-iterations", str(ITERATIONS), "--host", self.rest_url,
               "--grpc-target", self.runner.target, "--api-key", GOOD_KEY,
               "--abuser-api-key", ABUSER_KEY, "--max-tokens", "16", "--agent-turns", "3",
               "--abuse-burst", "24", "--csv", str(out), "--only-summary",
               "--exit-code-on-error", "0", "--loglevel", "WARNING",
               "--config-users", json.dumps(users)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        start = time.monotonic()
        done = subprocess.run(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stderr[-4000:]
        with open(f"{out}_stats.csv") as f:
            stats = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
        with open(f"{out}_failures.csv") as f:
            failures = list(csv.DictReader(f))
        print(f"\n{out.name}: locust ran {time.monotonic() - start:.1f} s")
        return stats, failures


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    config = pool_config(min_workers=1, max_workers=1, max_inflight=8, worker_args=())
    runner = GatewayRunner([config], ApiKeys.parse(KEYS)).start()
    rest = serve_rest(runner, "127.0.0.1", 0)
    yield Stack(runner, rest.url)
    runner.call(rest.stop(grace_s=0))
    runner.stop()


def value(rows: Rows, kind: str, name: str, column: str) -> float:
    return float(rows[(kind, name)][column])


def test_well_behaved_load_has_no_failures_and_an_abuser_does_not_slow_it(stack, tmp_path):
    base, base_failures = stack.locust(tmp_path / "baseline", WELL_BEHAVED)
    assert base_failures == [] and value(base, "", "Aggregated", "Failure Count") == 0
    assert value(base, "gRPC", "Chat [short]", "Request Count") == 2 * ITERATIONS
    for route in ("/v1/chat/completions [short]", "/ai/run [short]"):
        assert value(base, "POST", route, "Request Count") == ITERATIONS / 2
    assert value(base, "POST", "/v1/chat/completions [agent]", "Request Count") == ITERATIONS
    assert value(base, "TTFT", "Chat [short]", "Request Count") == 2 * ITERATIONS
    assert value(base, "TOKENS", "Chat [short]", "Min Response Time") == 16
    assert value(base, "CACHED", "/v1/chat/completions [agent]", "Max Response Time") > 0, \
        "agent turns after the first reuse their session's cached prefix"

    mixed, mixed_failures = stack.locust(tmp_path / "abusive", WELL_BEHAVED, abuser=True)
    refused = {(f["Name"], f["Error"]): int(f["Occurrences"]) for f in mixed_failures}
    assert set(refused) == {("Chat [abuse]", "TENANT_CONCURRENCY_EXCEEDED")}
    abuse_requests = value(mixed, "gRPC", "Chat [abuse]", "Request Count")
    abuse_refused = refused[("Chat [abuse]", "TENANT_CONCURRENCY_EXCEEDED")]
    print(f"abuser: {abuse_requests:.0f} requests, {abuse_refused} refused")
    assert abuse_requests > abuse_refused, "the abuser is limited, not cut off"
    for (kind, name), row in mixed.items():
        if "[abuse]" not in name and kind not in ("", "TOKENS", "CACHED"):
            assert row["Failure Count"] == "0", (kind, name)
    slope, offset_ms = MARGIN
    for kind, name in (("gRPC", "Chat [short]"), ("TTFT", "Chat [short]"),
                       ("POST", "/v1/chat/completions [agent]")):
        before, after = value(base, kind, name, "95%"), value(mixed, kind, name, "95%")
        print(f"{kind} {name}: p95 {before:.0f} ms alone, {after:.0f} ms beside the abuser")
        assert after <= slope * before + offset_ms, (kind, name, before, after)
