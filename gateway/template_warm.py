"""The engine a model's template builds and warms once for all its workers
(gateway/template_process.py): the workers' configuration on one thread, one request taken
through prefill and decode so that every first-use cost a process can inherit (lazy imports,
op dispatch and native-op first calls, module and weight set-up) is paid before any fork. A
worker forked with the same configuration adopts its copy of that engine (adopt_engine) and
only sets its own threads, seed and grammar executor; its KV pool is the engine's, a private
anonymous mapping (runtime/kv/cache.py) that the fork copies on write, untouched pages unbacked.
CPU only: on a GPU, CUDA and the engine start in the child."""

from __future__ import annotations

import dataclasses
from typing import Any

_REQUEST = "__template_warm_up__"


def warm_config(config: Any) -> Any:
    """`config` (an EngineConfig) as the template builds it: on one thread (a template starts
    no OpenMP pool) and seed 0 (each worker draws its own). Two workers' configurations that
    are equal here can share the template's engine."""
    return dataclasses.replace(config, num_threads=1, seed=0)


def build_warm_engine(checkpoint: Any, config: Any) -> Any:
    """An LLMEngine of warm_config(config) that has served one request (4 prompt tokens, 2
    greedy output tokens) and holds no request or page afterwards. Its grammar executor is not
    started: it runs a thread, and a template must stay single-threaded."""
    from runtime.engine import LLMEngine
    from runtime.sampling_params import SamplingParams

    engine = LLMEngine(checkpoint, warm_config(config))
    engine.add_request(_REQUEST, [1, 2, 3, 4], SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True), tenant=_REQUEST)
    while _REQUEST in engine.requests:
        for out in engine.step():
            if out.error is not None:
                raise out.error
    engine.check_quiescent()
    return engine


def adopt_engine(engine: Any, config: Any) -> None:
    """In a forked worker: make the template's warmed `engine` this worker's, for its own
    `config` (equal to the template's under warm_config): its threads, a fresh seed for
    unseeded requests, the grammar executor, and the shared weights paged in now rather than
    faulted in by the first request. A worker forked before the template built llguidance's
    tokenizer (it does once idle: gateway/template_process.py) leaves it to its first grammar
    request (GrammarCompiler.matcher) rather than delay its readiness by it (~0.4 s)."""
    from runtime.grammar import has_llguidance_tokenizer
    from runtime.threads import apply_num_threads

    engine.config = config
    engine.num_threads = apply_num_threads(config.num_threads)
    engine.sampler.default_generator.manual_seed(config.seed)
    grammars = engine.grammars
    if has_llguidance_tokenizer(grammars.tokenizer, grammars.vocab_size, grammars.eos_ids):
        grammars.prepare()
    engine.checkpoint.populate_pages()

