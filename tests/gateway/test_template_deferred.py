"""What a worker template leaves until it is idle (gateway/template_process.py: finish_load):
llguidance's tokenizer and the tokenizer's plain-text backend, which no first request needs
(without a grammar or a chat), are not on the first worker's path; they are built once the
template has nothing to do and reported to the gateway, and a worker forked before serves
grammar and chat requests all the same (it makes its own on first use)."""

from __future__ import annotations

import re

import pytest

from gateway.client import Client
from gateway.runner import GatewayRunner
from gateway.template_process import Template
from runtime.grammar import has_llguidance_tokenizer
from runtime.structured_output import StructuredOutput
from tests.gateway.conftest import KEYS, MODEL, api_keys, pool_config, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _has_grammar_tokenizer(template: Template) -> bool:
    cfg = template.checkpoint.config
    return has_llguidance_tokenizer(template.checkpoint.tokenizer, cfg.vocab_size,
                                    sorted(set(cfg.eos_token_ids)))


def test_the_templates_load_leaves_the_grammar_tokenizer_until_it_is_idle() -> None:
    template = Template(["--socket", "/nonexistent/w.sock", "--worker-threads", "1",
                         "--kv-cache-bytes", str(8 << 20)])
    assert template.engine is not None  # what the first worker needs is there
    assert not _has_grammar_tokenizer(template)
    assert template.checkpoint.tokenizer._text is None
    assert set(template.finish_load()) == {"grammar_tokenizer", "text_tokenizer"}
    assert template.checkpoint.tokenizer._text is not None
    assert _has_grammar_tokenizer(template)
    assert template.finish_load() == {}  # once per load


def test_a_forked_worker_serves_grammar_and_chat_and_the_idle_template_reports_builds(
) -> None:
    runner = GatewayRunner([pool_config(min_workers=1, max_workers=2, template=True)],
                           api_keys()).start()
    try:
        template = runner.gateway.pools[MODEL]._template
        assert template is not None and template.alive
        with Client(runner.target, api_key=KEYS["acme"]) as client:
            text = "".join(c.text for c in client.generate(
                "A code:", max_tokens=8, temperature=0.0,
                structured_output=StructuredOutput("regex", "[0-9]{3}-[a-z]{2}")))
            chat = list(client.chat([{"role": "user", "content": "Hi"}], max_tokens=2,
                                    ignore_eos=True))
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
        assert sum(len(c.token_ids) for c in chat) == 2
        wait_for(lambda: {"grammar_tokenizer", "text_tokenizer"} <= set(template.phases), 60,
                 "the template's idle build reported")
    finally:
        runner.stop()
