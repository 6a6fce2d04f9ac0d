"""Outputs leave the engine as deltas (new token ids, new text per step: `step_core`), and the
RequestOutputs rebuilt from them are what the engine produced before the deltas existed."""

from __future__ import annotations

from runtime.outputs import EngineCoreOutput, OutputAccumulator
from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _run_core(engine, rid: str, params: SamplingParams) -> list[EngineCoreOutput]:
    engine.add_request(rid, PROMPT, params)
    deltas = []
    while rid in engine.requests:
        deltas += [d for d in engine.step_core() if d.request_id == rid]
    return deltas


def test_each_step_carries_only_what_it_added(engine):
    deltas = _run_core(engine, "core-1", GREEDY)
    assert [len(d.new_token_ids) for d in deltas] == [1] * GREEDY.max_tokens
    assert all(len(d.new_logprobs or ()) == 1 for d in deltas)
    assert [d.finished for d in deltas] == [False] * (GREEDY.max_tokens - 1) + [True]
    assert deltas[-1].finish_reason == "length"


def test_deltas_rebuild_the_outputs_of_step(llm, engine):
    deltas = _run_core(engine, "core-2", GREEDY)
    acc = OutputAccumulator("core-2", PROMPT, engine.processor.process(PROMPT).token_ids)
    final = [acc.add(d) for d in deltas][-1]
    want = llm.generate(PROMPT, GREEDY)[0]
    assert final.outputs[0].token_ids == want.outputs[0].token_ids
    assert final.outputs[0].text == want.outputs[0].text
    assert final.outputs[0].logprobs == want.outputs[0].logprobs
    assert final.prompt_token_ids == want.prompt_token_ids and final.finished


def test_merged_deltas_are_the_deltas_in_order():
    a = EngineCoreOutput("r", [1], "a", None, False)
    b = EngineCoreOutput("r", [2, 3], "bc", [{2: -0.1}, {3: -0.2}], True, "stop", "x", 4)
    m = a.merge(b)
    assert (m.new_token_ids, m.new_text, m.new_logprobs) == ([1, 2, 3], "abc",
                                                            [{2: -0.1}, {3: -0.2}])
    assert (m.finished, m.finish_reason, m.stop_reason, m.num_cached_tokens) == (
        True, "stop", "x", 4)


def test_a_sequences_token_ids_are_one_list_grown_in_place():
    seq = Sequence("s", [5, 6], SamplingParams(max_tokens=4))
    ids = seq.token_ids
    seq.output_token_ids.append(7)
    seq.output_token_ids.extend([8])
    assert seq.token_ids is ids and ids == [5, 6, 7, 8] and seq.num_tokens == 4
    assert seq.output_token_ids == [7, 8]
