"""`/docs` (Swagger UI) and `/redoc` render from files this server serves itself (no CDN: they
work offline), checked in headless chromium; `/health` on the API port follows the gateway's
gRPC health."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ARTIFACTS = Path(__file__).parent / "artifacts"


def test_health_is_ok_while_the_gateway_serves_and_503_while_the_shim_drains(shim) -> None:
    r = httpx.get(f"{shim.url}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    with shim.another_server() as server:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        server.drain.draining = True
        r = httpx.get(f"{server.url}/health", timeout=30)
        assert r.status_code == 503 and r.json() == {"status": "unavailable"}
        server.drain.draining = False


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_only_from_this_server(shim, page) -> None:
    html = httpx.get(f"{shim.url}{page}", timeout=30).text
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", html)
    assert urls and all(u.startswith("/") for u in urls), urls
    assert "http://" not in html and "https://" not in html.replace("https://swagger.io", "")
    for url in urls:
        assert httpx.get(f"{shim.url}{url}", timeout=30).status_code == 200, url


def test_docs_page_renders_the_api_in_chromium(shim, browser) -> None:
    browser.navigate(f"{shim.url}/docs")
    title = browser.wait_for("(document.querySelector('.swagger-ui .info .title') || {})"
                             ".textContent")
    assert "tessera REST shim" in title
    paths = browser.wait_for("""(() => { const ps = [...document.querySelectorAll(
        '.opblock-summary-path')].map(e => e.textContent); return ps.length ? ps : null; })()""")
    assert "/v1/chat/completions" in "".join(paths)
    path = browser.screenshot(ARTIFACTS / "docs_page.png")
    assert path.stat().st_size > 10_000
    print(f"docs page screenshot: {path}")
    browser.navigate(f"{shim.url}/redoc")
    assert "tessera REST shim" in browser.wait_for("(document.querySelector('h1') || {})"
                                                   ".textContent")
