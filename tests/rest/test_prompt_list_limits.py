"""A /v1/completions prompt list from a key with small limits (issue 33, item 12), through the
official `openai` client against a real gateway, a real worker and the default model: a list
that fits the key's limits is served on an idle server; one that can never fit is refused for
good (a typed 400, which the client does not retry), never with a retryable 429."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from gateway.auth import ApiKeys
from gateway.rest import GatewayView, RestServer
from gateway.runner import GatewayRunner
from tests.gateway.conftest import pool_config
from tests.rest.conftest import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SMALL_KEY = "key-small"  # one request in flight and one waiting at most


@pytest.fixture(scope="module")
def small() -> Iterator[openai.OpenAI]:
    keys = ApiKeys.parse(f"{SMALL_KEY}=small;max_inflight=1;max_queued=1")
    runner = GatewayRunner([pool_config(model_id=MODEL, min_workers=1, max_workers=1)],
                           keys).start()
    server = RestServer(runner.target, port=0, view=GatewayView(runner.gateway, runner.loop))
    runner.call(server.start())
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=SMALL_KEY, max_retries=0,
                        timeout=120)
    runner.call(server.stop())
    runner.stop()


def test_a_list_within_the_keys_limits_is_served_on_an_idle_server(small) -> None:
    done = small.completions.create(model=MODEL, prompt=["The sky is", "Grass is"],
                                    max_tokens=4, temperature=0)
    assert [c.index for c in done.choices] == [0, 1]
    assert all(c.text for c in done.choices)


def test_a_list_that_can_never_fit_the_keys_limits_is_refused_for_good(small) -> None:
    for _ in range(2):  # the same answer every time: nothing to wait for
        with pytest.raises(openai.BadRequestError) as info:
            small.completions.create(model=MODEL, prompt=["One", "Two", "Three"],
                                     max_tokens=4, temperature=0)
        body = info.value.body
        assert (body["code"], body["param"]) == ("invalid_argument", "prompt"), body
        assert "max_inflight=1, max_queued=1" in body["message"]
        assert "retry-after" not in info.value.response.headers
    assert small.completions.create(model=MODEL, prompt="Still served", max_tokens=2).choices
