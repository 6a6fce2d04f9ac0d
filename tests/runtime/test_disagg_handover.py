"""What crosses a KV transfer besides the KV, between two real engines in one process: the
first token's place in the detokenizer, grammar, logprobs and seeded generator (the public
routes over worker processes: tests/rest/test_disagg_public.py), and the begin frame's
checks on them (fail closed, the reservation freed)."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.disagg import frames as wire
from runtime.disagg.export import KVExport
from runtime.disagg.importer import KVImport
from runtime.disagg.local import LocalTransfer
from runtime.errors import KVIntegrityViolation
from runtime.sampling_params import SamplingParams
from runtime.structured_output import StructuredOutput

pytestmark = pytest.mark.slow

PROMPT = "Write a haiku about the sea. The waves"
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of the module on one torch thread (see `one_torch_thread`)."""


def _colocated(engine, rid: str, ids: list[int], params: SamplingParams):
    engine.add_request(rid, ids, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out is not None and out.error is None
    return out.outputs[0]


def test_a_seeded_request_draws_on_where_the_prefill_engine_stopped(engine):
    ids = engine.tokenizer.encode(PROMPT)
    got = LocalTransfer(engine, engine).generate({"s": ids}, SEEDED)["s"]
    assert got.error is None
    assert got.token_ids == _colocated(engine, "colo", ids, SEEDED).token_ids


def test_a_json_schema_answer_goes_on_from_the_first_token(engine):
    schema = '{"type": "object", "required": ["name"], "additionalProperties": false, ' \
             '"properties": {"name": {"type": "string", "maxLength": 8}}}'
    params = SamplingParams(max_tokens=24, temperature=0.0,
                            structured_output=StructuredOutput("json_schema", schema))
    ids = engine.tokenizer.encode("A person as JSON:")
    got = LocalTransfer(engine, engine).generate({"j": ids}, params)["j"]
    want = _colocated(engine, "colo", ids, params)
    assert got.error is None and (got.token_ids, got.finish_reason) == (want.token_ids, "stop")


def _begin_with(engine, ids: list[int], params: SamplingParams, **header: object):
    """A reservation, and the export's frames with the begin frame's fields replaced."""
    imp = KVImport.reserve(engine, "b", ids, params)
    exp = KVExport.start(engine, "b-src", ids, params)
    while not exp.prefilled:
        engine.step()
    frames = list(exp.frames(imp.first_page))
    exp.release()
    begin = wire.decode(frames[0])
    bad = dataclasses.replace(begin, request_id="b", header={**begin.header, **header})
    return imp, [wire.encode(bad)]


@pytest.mark.parametrize("header", [{"generator_state": None},
                                    {"generator_state": b"not a generator"},
                                    {"first_logprobs": [[1, -0.5]]}])
def test_a_begin_frame_whose_request_state_does_not_fit_is_refused(engine, header):
    ids = engine.tokenizer.encode(PROMPT)
    imp, frames = _begin_with(engine, ids, SEEDED, **header)
    held = imp.num_pages
    with pytest.raises(KVIntegrityViolation) as info:
        imp.accept(frames[0])
    assert info.value.metadata["cause"] == "transfer" and held > 0
    assert imp.state == "failed" and imp.reserved == [] and "b" not in engine.requests
