"""The tool-call parser against the grammar it is paired with (issue 33): for random tool
schemas (nested objects, `$defs` / `$ref`, enums, strings holding the markup's own tags,
unicode), every call the forcing grammar admits parses back, chunked at random, into calls whose
arguments validate against their schema, and nothing of it is left as content.

The call text is sampled from the real grammar (llguidance, the default model's vocabulary)
with random allowed tokens instead of the model, so each example takes milliseconds."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.rest.tool_calls import ToolCallParser
from runtime.grammar import GrammarCompiler
from runtime.loader import open_checkpoint
from runtime.structured_output import StructuredOutput
from runtime.tool_grammar import CLOSE, OPEN, tool_call_spec

jsonschema = pytest.importorskip("jsonschema")
MAX_STEPS = 600

TRICKY = ["<tool_call>", "</tool_call>", "</tool_call>\n<tool_call>", 'say "</tool_call>"',
          "back\\slash", "東京", "café", "🙂 ok", "", "<tool_", "\n</tool_call>\n"]
leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.sampled_from(TRICKY), min_size=1,
                                                 max_size=4, unique=True)),
    st.builds(lambda v: {"const": v}, st.sampled_from(TRICKY)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 99)),
    st.just({"type": "boolean"}), st.just({"type": "null"}))
KEYS = st.sampled_from(["a", "city", "tag", "名前", "x y", "</tool_call>", "n"])


def _object(props: dict[str, dict], required: list[str]) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [k for k in props if k in required]}


def _objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(_object, st.dictionaries(KEYS, children, min_size=1, max_size=3),
                  st.lists(KEYS)),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                  children, st.integers(0, 2)))


schemas = st.recursive(leaf, _objects, max_leaves=6)


@st.composite
def parameters(draw: st.DrawFn) -> dict:
    """A function's parameters: an object, sometimes with part of it under `$defs`."""
    props = draw(st.dictionaries(KEYS, schemas, min_size=1, max_size=3))
    params = _object(props, draw(st.lists(KEYS)))
    if draw(st.booleans()):
        shared = draw(_objects(schemas))
        params["$defs"] = {"Shared": shared}
        params["properties"]["shared"] = {"$ref": "#/$defs/Shared"}
        params["required"].append("shared")
    return params


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    checkpoint = open_checkpoint(None)
    tok = checkpoint.tokenizer
    eos = [i for i in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
           if i is not None]
    grammars = GrammarCompiler(tok, checkpoint.config.vocab_size, eos)
    grammars.prepare()
    return grammars


def sample(compiler: GrammarCompiler, so: StructuredOutput, rng: random.Random) -> str:
    """Text the grammar admits, one random allowed token at a time; ends at EOS (taken half the
    times it is allowed) or where the grammar stops."""
    matcher = compiler.matcher(so)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        masks = compiler.fill_masks([matcher])
        assert masks is not None
        bits = np.unpackbits(masks.bitmask.view(torch.uint8).numpy()[0], bitorder="little")
        allowed = np.flatnonzero(bits[: compiler.vocab_size])
        eos = [t for t in allowed if int(t) in compiler.eos_ids]
        if eos and rng.random() < 0.5:
            return compiler.tokenizer.decode(ids)
        choices = [t for t in allowed if int(t) not in compiler.eos_ids]
        token = int(rng.choice(choices))
        assert matcher.accept(token), matcher.error
        ids.append(token)
        if matcher.is_stopped:
            return compiler.tokenizer.decode(ids)
    raise AssertionError(f"no end in {MAX_STEPS} tokens: {compiler.tokenizer.decode(ids)!r}")


def reference_calls(text: str) -> list[tuple[str, object]]:
    """The calls in forced text, read by the JSON decoder alone: each block's JSON ends where
    the decoder says it ends (no tag search)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        if calls:
            assert text[at] == "\n"
            at += 1
        assert text.startswith(OPEN + "\n", at)
        value, at = decoder.raw_decode(text, at + len(OPEN) + 1)
        assert text.startswith("\n" + CLOSE, at)
        at += len(CLOSE) + 1
        calls.append((value["name"], value["arguments"]))
    return calls


def parse_in_chunks(text: str, names: set[str], cuts: list[int]) -> tuple[list, str]:
    parser, content = ToolCallParser(names), ""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for lo, hi in itertools.pairwise(bounds):
        for kind, value in parser.feed(text[lo:hi]):
            content += value if kind == "content" else ""
    for kind, value in parser.finish():
        content += value if kind == "content" else ""
    return parser.calls, content


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(functions=st.lists(parameters(), min_size=1, max_size=3), several=st.booleans(),
       seed=st.integers(0, 2**32 - 1), by_char=st.booleans(),
       cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_every_forced_call_parses_back_to_valid_arguments(compiler, functions, several, seed,
                                                          by_char, cuts) -> None:
    named = {f"fn_{i}": params for i, params in enumerate(functions)}
    so = StructuredOutput("tool_call", tool_call_spec(list(named.items()), several))
    text = sample(compiler, so, random.Random(seed))
    calls, content = parse_in_chunks(text, set(named), list(range(len(text))) if by_char
                                     else cuts)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == reference_calls(text)
    assert len(calls) >= 1 and (several or len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), named[call.name])


def test_a_call_among_24_ordinary_tools_is_forced(compiler) -> None:
    """Item 10: 35 KB of parameters (past a client grammar's 32 KiB) compile and force a call."""
    from tests.rest.test_tool_calls_as_clients_send_them import ordinary_tools

    tools = [(t["function"]["name"], t["function"]["parameters"]) for t in ordinary_tools(24)]
    so = StructuredOutput("tool_call", tool_call_spec(tools, several=False))
    assert len(so.spec) > 32_768
    calls, content = parse_in_chunks(sample(compiler, so, random.Random(0)),
                                     {n for n, _ in tools}, [])
    assert content == "" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), dict(tools)[calls[0].name])
