"""The status endpoint, for operators only, and the status page, in headless chromium: it
loads with the operator key in its URL's fragment, shows the live numbers, and a test prompt
streams into it. The screenshot is kept as a test artifact."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.rest.conftest import KEYS, MODEL, OPERATOR_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ARTIFACTS = Path(__file__).parent / "artifacts"
OPERATOR = {"authorization": f"Bearer {OPERATOR_KEY}"}


def test_status_reports_workers_pages_tokens_and_reasons(shim) -> None:
    httpx.post(f"{shim.url}/ai/run/{MODEL}", json={"prompt": "Hi", "max_tokens": 2},
               headers=shim.headers(), timeout=60)
    s = httpx.get(f"{shim.url}/status", headers=OPERATOR, timeout=30).json()
    (pool,) = s["gateway"]["pools"]
    assert pool["model"] == MODEL
    (worker,) = [w for w in pool["workers"] if w["state"] == "ready"]
    # used + free + cached = total, as /metrics counts them; the finished request's prompt
    # pages stay in the prefix cache, held by no request
    assert (worker["pages_used"] + worker["pages_free"] + worker["pages_cached"]
            == worker["pages_total"] > 0)
    assert worker["pages_cached"] > 0 and worker["pages_used"] == 0
    assert worker["integrity_checks"] > 0 and "integrity_mismatches" in worker
    assert s["gateway"]["requests_by_reason"]["OK"] >= 1
    assert s["shim"]["requests_by_reason"]["OK"] >= 1
    assert 0.0 <= s["gateway"]["tokens"]["cached_ratio"] <= 1.0
    assert "acme" not in json.dumps(s), "no tenant names, even for operators"


def test_status_counts_every_refused_request_once_by_its_reason(shim) -> None:
    def by_reason() -> dict[str, int]:
        s = httpx.get(f"{shim.url}/status", headers=OPERATOR, timeout=30).json()
        return s["shim"]["requests_by_reason"]

    chat, run = f"{shim.url}/v1/chat/completions", f"{shim.url}/ai/run/{MODEL}"
    before = by_reason()
    refusals = [
        httpx.post(chat, content=b'{"messages": [', headers=shim.headers(), timeout=30),  # 400
        httpx.post(run, json={"prompt": "Hi"}, timeout=30),  # no key: 401
        httpx.get(run, headers=shim.headers(), timeout=30),  # 405
        httpx.get(f"{shim.url}/v1/nothing-here", headers=shim.headers(), timeout=30),  # 404
        # refused by the worker, through a relay: counted there, and only there
        httpx.post(run, json={"prompt": "Hi", "max_tokens": 100_000}, headers=shim.headers(),
                   timeout=60)]
    assert [r.status_code for r in refusals] == [400, 401, 405, 404, 400]
    after = by_reason()
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert delta == {"INVALID_ARGUMENT": 1, "UNAUTHENTICATED": 1, "METHOD_NOT_ALLOWED": 1,
                     "NOT_FOUND": 1, "CONTEXT_LENGTH_EXCEEDED": 1}


def test_status_without_the_operator_key_is_401_and_shows_no_pid(shim) -> None:
    pids = [str(w.pid) for w in shim.runner.gateway.pools[MODEL].workers.values()]
    for headers in ({}, shim.headers(), {"authorization": f"Bearer {OPERATOR_KEY}x"}):
        r = httpx.get(f"{shim.url}/status", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["reason"] == "UNAUTHENTICATED"
        assert "pid" not in r.text and not any(pid in r.text for pid in pids)


def test_status_page_shows_live_numbers_and_streams_a_test_prompt(shim, browser) -> None:
    browser.navigate(f"{shim.url}/#key={OPERATOR_KEY}")
    browser.wait_for("Number(document.body.dataset.polls || 0) >= 2")
    cells = browser.wait_for("""(() => { const r = document.querySelector('#workers tr.worker');
        return r && [...r.cells].map(c => c.textContent); })()""")
    assert cells[0] == MODEL and cells[2] == "ready"
    assert int(cells[5]) + int(cells[6]) > 0  # pages used + free
    assert browser.evaluate("document.getElementById('reasons').textContent").count("OK") == 1
    before = int(browser.evaluate("document.getElementById('prompt-tokens').textContent"))

    browser.evaluate(f"""(() => {{
        document.getElementById('api-key').value = {json.dumps(KEYS['acme'])};
        document.getElementById('max-tokens').value = '12';
        document.getElementById('send').click(); }})()""")
    browser.wait_for("document.getElementById('stream-state').textContent === 'done'", 120)
    output = browser.evaluate("document.getElementById('output').textContent")
    chunks = int(browser.evaluate("document.getElementById('output').dataset.chunks"))
    assert output.strip() and chunks > 1, "the answer must arrive in pieces"
    assert "completion" in browser.evaluate("document.getElementById('usage').textContent")
    browser.wait_for("Number(document.getElementById('prompt-tokens').textContent) > "
                     f"{before}", 10)
    path = browser.screenshot(ARTIFACTS / "status_page.png")
    assert path.stat().st_size > 10_000
    print(f"status page screenshot: {path}")

    browser.navigate(f"{shim.url}/")  # no fragment: no operator key
    browser.wait_for("document.getElementById('updated').textContent.includes('operator key')")
    assert not browser.evaluate("document.querySelector('#workers tr.worker')")
